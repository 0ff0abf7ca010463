"""Local accumulation at stages 2 and 3: one gradient reduction per optimizer step.

[Note: local accumulation]
With ``local_accumulation=True`` a backward pass that a front end marks as *deferred* (a micro-batch
before an accumulation boundary: Lightning's ``block_backward_sync``, ``fabric.no_backward_sync``,
``initialize``'s engine off its boundary, or ``ZeroOptimizer.no_sync()`` in a plain loop) issues no
gradient collective: each parameter's gradient is added into this rank's full-size buffer of its
flat group (``LocalAccumulation.buffers``, in fp32 or the working dtype: ``grad_accum_dtype``) and
freed. The next backward that is not deferred (the boundary's) adds its gradients into the same
buffers, and each segment is reduce-scattered from there, divided by the world size, in the usual
launch order (see [Note: launch order] in engine/grads/reducer.py); the buffer's segment is zeroed once it is
handed to the collective. So k micro-batches cost one reduce-scatter per segment instead of k, and
the results equal the reduce-every-micro-batch run up to the order of the additions.

Whether a backward is deferred is decided at its first gradient and holds for the whole pass, so
every segment of one backward goes the same way on every rank: ranks that disagree (one deferring,
one not) would pair a reduce-scatter with nothing, so the front ends decide from the loop's
position, which every rank shares. A ``reduce()`` (the step) that finds accumulated gradients no
boundary backward reduced (a loop that deferred its last micro-batch too) reduces them then, so a
step never uses unreduced gradients. ``zero_grad`` drops what was accumulated.

Stage 3: the buffers belong to the reducer, not to the unit, and are shaped like the unit's full
flat buffer (``FlatGroup.param_views``). A unit is released after its backward as usual (its
parameters freed, its gathered buffer back to the pool); the gradient it produced lives on in
these buffers until the boundary, so a deferred micro-batch holds the whole model's gradients,
unsharded, on every rank: that is the memory this trades for the communication (4 bytes per
trainable parameter in fp32, as ``estimate_memory(local_accumulation=True)`` counts). The buffers
are allocated at the first deferred backward and kept for the next accumulation window.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Optional, Sequence

import torch

from ..buffers.flat import FlatGroup
from ..buffers.layout import Segment


class Deferral:
    """Whether the backward in progress defers (some of) its gradient reduction to the accumulation
    boundary: it runs inside ``no_sync()``, or ``defer_when`` says so. Decided at the backward's first
    gradient and held for the whole pass (see [Note: local accumulation] for why). Local accumulation
    defers every collective; hybrid sharding's ``replica_all_reduce="boundary"`` only the all-reduce
    across the replicas (see [Note: hybrid sharding] in engine/comm/topology.py)."""

    def __init__(self) -> None:
        self._depth = 0  # no_sync() contexts entered
        self.defer_when: Optional[Callable[[], bool]] = None  # asked at each backward's first gradient
        self.deferring = False  # the backward in progress defers its reduction (decided at its first gradient)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def begin_backward(self) -> None:
        """A backward's first gradient: decide whether this pass defers its reduction."""
        self.deferring = self._depth > 0 or (self.defer_when is not None and bool(self.defer_when()))


class LocalAccumulation(Deferral):
    """The full-size local gradient buffers of a reducer's flat groups (see [Note: local accumulation])."""

    def __init__(self, groups: Sequence[FlatGroup], grad_accum_dtype: str) -> None:
        super().__init__()
        self.groups = list(groups)
        self.dtypes = [torch.float32 if grad_accum_dtype == "fp32" else g.dtype for g in self.groups]
        self.buffers: list[Optional[torch.Tensor]] = [None] * len(self.groups)
        self._views: list[list[torch.Tensor]] = [[] for _ in self.groups]
        self.pending = False  # the buffers hold gradients no reduction has taken yet

    def takes(self, launched: bool) -> bool:
        """Whether the gradient arriving now goes into the local buffer: in a deferred backward, or
        in the boundary's while its segment has not been handed to the reduction yet (a late gradient
        for a launched segment goes the usual way: see [Note: late gradients] in engine/grads/reducer.py)."""
        return self.deferring or (self.pending and not launched)

    def add(self, gi: int, i: int, grad: torch.Tensor) -> None:
        if self.buffers[gi] is None:
            group = self.groups[gi]
            self.buffers[gi] = torch.zeros(group.layout.numel, dtype=self.dtypes[gi], device=group.device)
            self._views[gi] = group.param_views(self.buffers[gi])
        view = self._views[gi][i]
        view.add_(grad.reshape(view.shape))
        self.pending = True

    def take_segment(self, gi: int, seg: Segment, out: torch.Tensor, world_size: int) -> bool:
        """Write segment ``seg``'s accumulated sum divided by ``world_size`` into ``out`` (the staging
        buffer, in the reduction's dtype) and zero it here; False when nothing is pending."""
        buffer = self.buffers[gi]
        if not self.pending or buffer is None:
            return False
        local = FlatGroup.segment_of(buffer, seg)
        if out.dtype == local.dtype:
            torch.div(local, world_size, out=out[: seg.numel])
        else:  # an fp32 sum, reduced in the working dtype: rounded once, after the division
            out[: seg.numel].copy_(local / world_size)
        local.zero_()
        return True

    def reduced(self) -> None:
        """Every segment was handed to the reduction: nothing is pending."""
        self.pending = False

    def drop(self) -> None:
        """zero_grad: forget what was accumulated."""
        if self.pending:
            for buffer in self.buffers:
                if buffer is not None:
                    buffer.zero_()
        self.pending = False

    def held_tensors(self) -> list[torch.Tensor]:
        return [b for b in self.buffers if b is not None]


@contextlib.contextmanager
def deferred_reduction(optimizers: Iterable) -> Iterator[None]:
    """Backward passes inside defer their gradient reduction to the next one outside, for every
    ZeroOptimizer of ``optimizers`` that defers one (``defers``; others: nothing changes)."""
    with contextlib.ExitStack() as stack:
        for optimizer in optimizers:
            stack.enter_context(optimizer.no_sync())
        yield


def defers(optimizers: Iterable) -> bool:
    """Whether any of ``optimizers`` defers a reduction to the boundary: ``local_accumulation`` at
    stages 2-3, or hybrid sharding's ``replica_all_reduce="boundary"``."""
    return any(getattr(getattr(o, "reducer", None), "deferral", None) is not None for o in optimizers)
