"""The few collectives the engine issues, over one process group.

Everything the engine sends goes through one ``Collectives`` object, so tests can substitute a
subclass that counts or records calls, and a world of size 1 needs no process group at all.

[Note: reduce-scatter on gloo]
gloo implements reduce-scatter as a full all-reduce of a private copy of the input followed by a
copy out of the rank's chunk. Calling the all-reduce ourselves, in place, sends the same bytes
without the two copies (and, at stage 1, leaves the whole gradient averaged).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Pending:
    """A collective in flight. ``wait()`` blocks until it is done, then runs what completes it."""

    def __init__(self, work: Optional[dist.Work] = None, then: Optional[Callable[[], object]] = None) -> None:
        self._work = work
        self._then = then

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._then is not None:
            then, self._then = self._then, None
            then()


def _copy_unless_same(output: torch.Tensor, input: torch.Tensor) -> None:
    if output.data_ptr() != input.data_ptr():
        output.copy_(input)


class Collectives:
    """Asynchronous reduce-scatter and all-gather plus small synchronous helpers on one group."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None) -> None:
        self.group = group
        initialized = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if initialized else 1
        self.rank = dist.get_rank(group) if initialized else 0
        self.backend = str(dist.get_backend(group)) if initialized else "none"

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> Pending:
        """Sum ``input`` (world_size equal chunks) over ranks into ``output`` (this rank's chunk).

        ``output`` may be this rank's chunk of ``input`` itself (in place). ``input``'s other chunks
        are undefined afterwards.
        """
        chunk = input.view(self.world_size, -1)[self.rank]
        if self.world_size == 1:
            return Pending(then=lambda: _copy_unless_same(output, chunk))
        if self.backend == "gloo":  # see [Note: reduce-scatter on gloo]
            work = dist.all_reduce(input, group=self.group, async_op=True)
            return Pending(work, lambda: _copy_unless_same(output, chunk))
        return Pending(_reduce_scatter_single(output, input, group=self.group, async_op=True))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Pending:
        """Concatenate every rank's ``input`` into ``output``; ``input`` may alias its own chunk."""
        if self.world_size == 1:
            return Pending(then=lambda: _copy_unless_same(output, input))
        return Pending(_all_gather_single(output, input, group=self.group, async_op=True))

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """In-place, synchronous broadcast from ``src``."""
        if self.world_size > 1:
            dist.broadcast(tensor, src=src, group=self.group)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        """In-place, synchronous all-reduce of a small tensor."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=op, group=self.group)

    def all_gather_shards(self, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's equally sized ``shard``, stacked: shape (world_size, *shard.shape)."""
        out = shard.new_empty((self.world_size, *shard.shape))
        self.all_gather(out.view(-1), shard.contiguous().view(-1)).wait()
        return out


def wait_all(pending: list[Pending]) -> None:
    """Wait for every collective in ``pending``, in order, and empty the list."""
    for p in pending:
        p.wait()
    pending.clear()
