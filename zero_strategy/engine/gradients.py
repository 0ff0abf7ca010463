"""Gradient hooks, buckets and their reduction across ranks.

[Note: launch order]
Ranks must issue collectives in the same sequence or they hang (or, worse, pair the wrong
tensors). The sequence therefore never depends on data: segments are reduced in one fixed order,
computed identically on every rank from the model's parameter order (the segment whose first
parameter comes last in the model is reduced first, because backward produces it first). At stage
2 a segment is launched once it is complete *and* every segment before it in that order has been
launched; when backward ends, every remaining segment is launched in order, with zeros for the
parameters that got no gradient on this rank. Each backward pass thus reduces every segment exactly
once, in the same order on every rank, whatever the control flow did.
"""

from __future__ import annotations

import functools
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from .collectives import Collectives, wait_all
from .flat import FlatGroup
from .layout import Piece


def launch_order(groups: Sequence[FlatGroup], position: Mapping[torch.nn.Parameter, int]) -> list[tuple[int, int]]:
    """(group, segment) pairs in reduction order (see [Note: launch order])."""
    keys = []
    for gi, group in enumerate(groups):
        for seg in group.segments:
            first = min(position[group.params[i]] for i in seg.params)
            keys.append((-first, gi, seg.index))
    return [(gi, si) for _, gi, si in sorted(keys)]


class GradientReducer:
    """Takes gradients from autograd into flat storage and averages them across ranks.

    Stage 1: every parameter's ``.grad`` is a view of a full flat gradient buffer, so autograd
    accumulates in place; ``reduce()``, called before the step, reduce-scatters each segment in
    place. Stage 2: a hook copies each gradient into its segment's staging buffer and frees it;
    complete segments are reduce-scattered asynchronously into a gradient shard while backward
    goes on, and only that shard outlives the backward pass.
    """

    def __init__(self, groups: Sequence[FlatGroup], stage: int, comm: Collectives,
                 position: Optional[Mapping[torch.nn.Parameter, int]] = None) -> None:
        self.groups = list(groups)
        self.stage = stage
        self.comm = comm
        if position is None:
            position = {p: i for i, p in enumerate(p for g in self.groups for p in g.params)}
        self.order = launch_order(self.groups, position)
        self.received = [[False] * len(g.params) for g in self.groups]
        self._reduced = False  # stage 1: reduce() already ran for the current gradients
        self._inflight: list = []  # (work, staging, output, target)
        if stage == 1:
            self.grad_buffers = [torch.zeros_like(g.buffer) for g in self.groups]
            self._grad_views = [g.param_views(b) for g, b in zip(self.groups, self.grad_buffers)]
            self._attach_grad_views()
        else:
            self.grad_shards = [g.buffer.new_zeros(g.layout.shard_numel) for g in self.groups]
            self._shard_filled = False  # False after zero_grad: the next reduction writes, not adds
            self._reset_backward_state()
        self._handles = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, gi, i))
            for gi, g in enumerate(self.groups) for i, p in enumerate(g.params)
        ]

    # ---- hooks -----------------------------------------------------------------------------

    def _on_grad(self, gi: int, i: int, param: torch.nn.Parameter) -> None:
        self.received[gi][i] = True
        if self.stage == 1:
            view = self._grad_views[gi][i]
            if param.grad is not view:  # e.g. create_graph=True made autograd replace it
                view.add_(param.grad)
                param.grad = view
            return
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            self._callback_queued = True
        grad, param.grad = param.grad, None
        group = self.groups[gi]
        si = group.layout.param_segments[i]
        offset = group.layout.param_offsets[i] - group.segments[si].start
        staging = self._staging.get((gi, si))
        if staging is None:
            staging = self._staging[(gi, si)] = group.buffer.new_zeros(group.segments[si].numel)
        dst = staging[offset : offset + grad.numel()]
        if (gi, i) in self._seen:  # a second gradient in the same backward (reentrant checkpointing)
            dst.add_(grad.reshape(-1))
        else:
            dst.copy_(grad.reshape(-1))
            self._seen.add((gi, i))
            self._missing[(gi, si)] -= 1
        self._launch_ready()

    def _on_backward_end(self) -> None:
        while self._next < len(self.order):
            self._launch(self.order[self._next])
            self._next += 1
        self._finish_inflight()
        self._shard_filled = True
        self._reset_backward_state()

    # ---- stage 2 ---------------------------------------------------------------------------

    def _reset_backward_state(self) -> None:
        self._staging: dict[tuple[int, int], torch.Tensor] = {}
        self._seen: set[tuple[int, int]] = set()
        self._missing = {(gi, s.index): len(s.params) for gi, g in enumerate(self.groups) for s in g.segments}
        self._next = 0
        self._callback_queued = False

    def _launch_ready(self) -> None:
        while self._next < len(self.order) and self._missing[self.order[self._next]] == 0:
            self._launch(self.order[self._next])
            self._next += 1

    def _launch(self, key: tuple[int, int]) -> None:
        gi, si = key
        group = self.groups[gi]
        seg = group.segments[si]
        staging = self._staging.pop(key, None)
        if staging is None:  # no gradient reached this segment on this rank
            staging = group.buffer.new_zeros(seg.numel)
        if self.comm.world_size > 1:
            staging.div_(self.comm.world_size)  # average as DDP does: divide, then sum
        target = self.grad_shards[gi][seg.shard_start : seg.shard_start + seg.shard_numel]
        output = torch.empty_like(target) if self._shard_filled else target
        work = self.comm.reduce_scatter(output, staging)
        self._inflight.append((work, staging, output, target))

    def _finish_inflight(self) -> None:
        for work, _staging, output, target in self._inflight:
            if work is not None:
                work.wait()
            if output is not target:  # accumulating over micro-batches
                target.add_(output)
        self._inflight.clear()

    # ---- stage 1 ---------------------------------------------------------------------------

    def _attach_grad_views(self) -> None:
        for group, views in zip(self.groups, self._grad_views):
            for p, view in zip(group.params, views):
                p.grad = view

    def reduce(self) -> None:
        """Make every piece's gradient the average over ranks. Idempotent until zero_grad."""
        if self.stage != 1 or self._reduced:
            return
        works = []
        for gi, si in self.order:
            group = self.groups[gi]
            seg = group.segments[si]
            full = group.segment_of(self.grad_buffers[gi], seg)
            if self.comm.world_size > 1:
                full.div_(self.comm.world_size)
            works.append(self.comm.reduce_scatter(group.own_shard_of(self.grad_buffers[gi], seg), full))
        wait_all(works)
        self._reduced = True

    # ---- what the optimizer reads ----------------------------------------------------------

    def piece_grad(self, gi: int, piece: Piece) -> torch.Tensor:
        """The averaged gradient of ``piece`` (valid after reduce())."""
        if self.stage == 1:
            return self.groups[gi].piece_of(self.grad_buffers[gi], piece)
        return self.grad_shards[gi][piece.shard_offset : piece.shard_offset + piece.numel]

    def received_anywhere(self) -> list[list[bool]]:
        """Which parameters got a gradient on at least one rank since zero_grad (one all-reduce)."""
        flags = [f for per_group in self.received for f in per_group]
        if not flags:
            return []
        mask = torch.tensor(flags, dtype=torch.uint8, device=self.groups[0].device)
        self.comm.all_reduce(mask, op=dist.ReduceOp.MAX)
        values, out = mask.tolist(), []
        for per_group in self.received:
            out.append([bool(v) for v in values[: len(per_group)]])
            values = values[len(per_group):]
        return out

    def zero_grad(self) -> None:
        self.received = [[False] * len(g.params) for g in self.groups]
        self._reduced = False
        if self.stage == 1:
            for buffer in self.grad_buffers:
                buffer.zero_()
            self._attach_grad_views()
        else:
            self._shard_filled = False
            for group in self.groups:
                for p in group.params:
                    p.grad = None

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
