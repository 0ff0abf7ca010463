"""The few collectives the engine issues, over one process group.

Everything the engine sends goes through one ``Collectives`` object, so tests can substitute a
subclass that counts or records calls, and a world of size 1 needs no process group at all.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Collectives:
    """Asynchronous reduce-scatter and all-gather plus small synchronous helpers on one group."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None) -> None:
        self.group = group
        initialized = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if initialized else 1
        self.rank = dist.get_rank(group) if initialized else 0

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> Optional[dist.Work]:
        """Sum ``input`` (world_size equal chunks) over ranks into ``output`` (this rank's chunk).

        ``output`` may be this rank's chunk of ``input`` itself (in place). Returns the pending work,
        or None when nothing is in flight.
        """
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return None
        return _reduce_scatter_single(output, input, group=self.group, async_op=True)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Optional[dist.Work]:
        """Concatenate every rank's ``input`` into ``output``; ``input`` may alias its own chunk."""
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return None
        return _all_gather_single(output, input, group=self.group, async_op=True)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        """In-place, synchronous all-reduce of a small tensor."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=op, group=self.group)

    def all_gather_shards(self, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's equally sized ``shard``, stacked: shape (world_size, *shard.shape)."""
        out = shard.new_empty((self.world_size, *shard.shape))
        work = self.all_gather(out.view(-1), shard.contiguous().view(-1))
        if work is not None:
            work.wait()
        return out


def wait_all(works: list) -> None:
    """Wait for every pending work in ``works`` and empty the list."""
    for work in works:
        if work is not None:
            work.wait()
    works.clear()
