"""The few collectives the engine issues, over one process group.

Everything the engine sends goes through one ``Collectives`` object, so tests can substitute a
subclass that counts or records calls, and a world of size 1 needs no process group at all.

[Note: reduce-scatter on gloo]
gloo implements reduce-scatter as a full all-reduce of a private copy of the input followed by a
copy out of the rank's chunk. Calling the all-reduce ourselves, in place, sends the same bytes
without the two copies (and, at stage 1, leaves the whole gradient averaged).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .watchdog import Watchdog

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


Describe = Callable[[], str]
"""Names a collective for the watchdog's and the failures' messages: called only when needed."""


def _unnamed() -> str:
    return "collective"


class Pending:
    """A collective in flight. ``wait()`` blocks until it is done, then runs what completes it."""

    def __init__(self, work: Optional[dist.Work] = None, then: Optional[Callable[[], object]] = None,
                 watchdog: Optional[Watchdog] = None, what: Describe = _unnamed) -> None:
        self._work = work
        self._then = then
        self._watchdog = watchdog
        self._what = what

    def wait(self) -> None:
        if self._work is not None:
            work, self._work = self._work, None
            if self._watchdog is not None:
                self._watchdog.wait(work, self._what)
            else:
                work.wait()
        if self._then is not None:
            then, self._then = self._then, None
            then()


def _copy_unless_same(output: torch.Tensor, input: torch.Tensor) -> None:
    if output.data_ptr() != input.data_ptr():
        output.copy_(input)


class Collectives:
    """Asynchronous reduce-scatter and all-gather plus small synchronous helpers on one group.

    ``collective_timeout`` (seconds, None: no limit) arms the watchdog of every wait: see
    [Note: hang watchdog] in watchdog.py. ``what`` arguments name a collective in its messages.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, collective_timeout: Optional[float] = None) -> None:
        self.group = group
        initialized = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if initialized else 1
        self.rank = dist.get_rank(group) if initialized else 0
        self.backend = str(dist.get_backend(group)) if initialized else "none"
        self.watchdog = Watchdog(collective_timeout, self.rank, self.backend)

    def _pending(self, work: Optional[dist.Work], then: Optional[Callable[[], object]], what: Describe) -> Pending:
        return Pending(work, then, self.watchdog, what)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, what: Describe = _unnamed) -> Pending:
        """Sum ``input`` (world_size equal chunks) over ranks into ``output`` (this rank's chunk).

        ``output`` may be this rank's chunk of ``input`` itself (in place). ``input``'s other chunks
        are undefined afterwards.
        """
        chunk = input.view(self.world_size, -1)[self.rank]
        if self.world_size == 1:
            return Pending(then=lambda: _copy_unless_same(output, chunk))
        if self.backend == "gloo":  # see [Note: reduce-scatter on gloo]
            work = dist.all_reduce(input, group=self.group, async_op=True)
            return self._pending(work, lambda: _copy_unless_same(output, chunk), what)
        return self._pending(_reduce_scatter_single(output, input, group=self.group, async_op=True), None, what)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, what: Describe = _unnamed) -> Pending:
        """Concatenate every rank's ``input`` into ``output``; ``input`` may alias its own chunk."""
        if self.world_size == 1:
            return Pending(then=lambda: _copy_unless_same(output, input))
        return self._pending(_all_gather_single(output, input, group=self.group, async_op=True), None, what)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, what: Describe = _unnamed) -> None:
        """In-place, synchronous broadcast from ``src`` (a rank of this group)."""
        if self.world_size > 1:
            work = dist.broadcast(tensor, src=self.global_rank(src), group=self.group, async_op=True)
            self._pending(work, None, what).wait()

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   what: Describe = _unnamed) -> None:
        """In-place, synchronous all-reduce of a small tensor."""
        if self.world_size > 1:
            self._pending(dist.all_reduce(tensor, op=op, group=self.group, async_op=True), None, what).wait()

    def all_gather_shards(self, shard: torch.Tensor, what: Describe = _unnamed) -> torch.Tensor:
        """Every rank's equally sized ``shard``, stacked: shape (world_size, *shard.shape)."""
        out = shard.new_empty((self.world_size, *shard.shape))
        self.all_gather(out.view(-1), shard.contiguous().view(-1), what).wait()
        return out

    # ---- picklable objects (small: settings, records, error messages) -----------------------

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``src``'s ``obj`` on every rank."""
        if self.world_size == 1:
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=self.global_rank(src), group=self.group)
        return holder[0]

    def global_rank(self, rank: int) -> int:
        """The default group's number of this group's ``rank`` (what torch.distributed's ``src`` means)."""
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank


def wait_all(pending: list[Pending]) -> None:
    """Wait for every collective in ``pending``, in order, and empty the list."""
    for p in pending:
        p.wait()
    pending.clear()
