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

[Note: late gradients]
A parameter can receive a second gradient in the same backward after its segment was launched
(reentrant activation checkpointing runs a nested backward). Its segment is staged again and
reduced once more when backward ends, added into the shard. The graph is the same on every rank,
so every rank stages the same late segments and the sequence of collectives still agrees.

[Note: gradients to the host]
With optimizer offload (``host_dtypes``), the gradient shard the step reads lives in host memory,
in the master's dtype. Stage 2 reduce-scatters each segment into a device temporary and copies the
result to the host shard when the reduction completes, during backward (non-blocking from the
device, added on the host when accumulating), so no device gradient shard exists. Stage 1 keeps its
full device buffer for autograd and copies each segment's shard out as soon as that segment is
reduced, while the next one is in flight.

[Note: low-precision reductions]
A flat group with a ``reduce_dtype`` (the gradients of ``low_precision_reduce_modules``: DeepSpeed's
``torch_autocast.lower_precision_safe_modules``) is reduced in that dtype: each segment, already
divided by the ranks in the weights' fp32, is rounded to it, reduce-scattered in it (half the bytes
for bf16 and fp16), and the shard that arrives is converted back and written or added into the fp32
gradient shard, as DeepSpeed copies each such gradient into a bucket of that dtype, reduces the
bucket and adds the result into its fp32 partition. On gloo the shards are summed by one
``torch.sum`` over the ranks' chunks, which rounds once: DeepSpeed's sum on 2 ranks, and a closer
one than a ring that rounds at each hop on more. The groups are split by it (``split_groups``), so a
segment is one dtype; across shard groups (hybrid sharding) the sum stays in fp32. With
``quantized_gradients`` the quantized reduction applies instead.
"""

from __future__ import annotations

import functools
import weakref
from collections import deque
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from ..buffers.flat import FlatGroup
from ..buffers.host import host_empty, wait_for_copies
from ..buffers.layout import Piece
from ..buffers.pool import BufferPool
from ..comm.collectives import Collectives, Pending, after
from ..comm.topology import HybridGroups
from ..diagnose import tally as step_tally
from ..diagnose.breakdown import BACKWARD, OFFLOAD, REDUCE
from ..diagnose.ranges import span
from .accumulation import LocalAccumulation
from .replica_sum import DeferredReplicaSum

if TYPE_CHECKING:
    from ..comm.order_guard import OrderGuard

ROUNDING_SEED = 0x5EED
"""Seed of the stochastic rounding of quantized gradients (plus the rank): runs repeat."""

MAX_INFLIGHT = 2
"""Reductions in flight before the reducer waits for the oldest. Bounds the staging (and, on gloo,
receive) memory to a few buckets (as DeepSpeed's two reduce buckets do) while still overlapping
backward."""


def launch_order(groups: Sequence[FlatGroup], position: Mapping[torch.nn.Parameter, int]) -> list[tuple[int, int]]:
    """(group, segment) pairs in reduction order (see [Note: launch order])."""
    keys = []
    for gi, group in enumerate(groups):
        for seg in group.segments:
            first = min(position[group.params[i]] for i in seg.params)
            keys.append((-first, gi, seg.index))
    return [(gi, si) for _, gi, si in sorted(keys)]


def _on_grad_of(reducer: "weakref.ref[GradientReducer]", gi: int, i: int, param: torch.nn.Parameter) -> None:
    """A parameter's post-accumulate-grad hook: its reducer takes the gradient, while it exists.

    [Note: hooks that hold the reducer weakly]
    torch's garbage collector does not traverse a tensor's post-accumulate-grad hooks (torch 2.13),
    so a hook holding its reducer, which holds the parameters, makes a cycle that is never freed:
    every model and engine built in a process (a notebook, a sweep) would stay in memory. The hook
    holds the reducer weakly; the optimizer holds it strongly. Once the optimizer is gone, the
    parameters' gradients accumulate in ``.grad`` as without this package."""
    target = reducer()
    if target is not None:
        if not target._in_backward:  # this backward's first gradient: count the pass (see [Note: the step's tally])
            target.backwards += 1
            target._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(target._backward_ended)
            target.comm.breakdown.enter(BACKWARD)  # unless the forward's outputs began it (diagnose/breakdown.py)
        target._on_grad(gi, i, param)


class GradientReducer:
    """Takes gradients from autograd into flat storage and averages them across ranks; the common
    part of the two reducers (``make_reducer`` picks one): the groups' fixed launch order (see
    [Note: launch order]), which parameters received a gradient, and the host gradient shards of
    optimizer offload (see [Note: gradients to the host])."""

    def __init__(self, groups: Sequence[FlatGroup], comm: Collectives, position: Mapping[torch.nn.Parameter, int],
                 host_dtypes: Optional[Sequence[torch.dtype]] = None, hybrid: Optional[HybridGroups] = None) -> None:
        self.groups = list(groups)
        self.comm = comm  # the shard group
        # with hybrid sharding, the shards are all-reduced across the replicas: see [Note: hybrid sharding]
        self.replicas = hybrid.replicate if hybrid is not None else None
        self.average_over = comm.world_size * (self.replicas.world_size if self.replicas is not None else 1)
        self.world = hybrid.world if hybrid is not None else comm  # every rank
        # host_grads[gi]: the shard the step reads, in host memory (offload), or None
        self.host_grads: list[Optional[torch.Tensor]] = [
            host_empty(g.layout.shard_numel, dt, g.device).zero_() for g, dt in zip(self.groups, host_dtypes)
        ] if host_dtypes is not None else [None] * len(self.groups)
        self.order = launch_order(self.groups, position)
        self._pool = BufferPool()  # staging and receive buffers, reused: see [Note: reused buffers] in
                                   # engine/buffers/pool.py
        self._rounding: Optional[torch.Generator] = None  # for quantized_gradients: see _reduce_scatter
        if any(g.reduce_quantization is not None for g in self.groups):
            self._rounding = torch.Generator(self.groups[0].device)
            self._rounding.manual_seed(ROUNDING_SEED + self.comm.rank)
        self.received = [[False] * len(g.params) for g in self.groups]
        self.backwards = 0  # backward passes that reached these parameters (see [Note: the step's tally])
        self._in_backward = False
        me = weakref.ref(self)  # see [Note: hooks that hold the reducer weakly]
        self._handles = [
            p.register_post_accumulate_grad_hook(functools.partial(_on_grad_of, me, gi, i))
            for gi, g in enumerate(self.groups) for i, p in enumerate(g.params)
        ]

    def _on_grad(self, gi: int, i: int, param: torch.nn.Parameter) -> None:
        raise NotImplementedError

    def _backward_ended(self) -> None:
        self._in_backward = False

    def _reduce_scatter(self, gi: int, output: torch.Tensor, input: torch.Tensor, what,
                        fold: Optional[torch.Tensor] = None, sum_replicas: bool = True) -> Pending:
        """One segment's reduction, block-quantized when the group says so (``quantized_gradients``:
        see [Note: quantized reduce-scatter] in engine/comm/collectives.py), rounded stochastically with this
        reducer's generator (see [Note: stochastic rounding of blocks] in engine/comm/quantize.py). With hybrid sharding
        the result is then all-reduced across the replicas (unless not ``sum_replicas``), ``fold``
        added into it first (see [Note: hybrid sharding])."""
        spec, low = self.groups[gi].reduce_quantization, self.groups[gi].reduce_dtype
        if spec is not None:
            pending = self.comm.quantized_reduce_scatter(output, input, spec, what, noise=self._rounding)
        elif low is not None:
            pending = self._reduce_scatter_in(low, output, input, what)
        elif not self.comm.reduce_scatter_needs_scratch:
            pending = self.comm.reduce_scatter(output, input, what)
        else:
            scratch = self._pool.take(input.numel(), input.dtype, input.device)  # see [Note: reduce-scatter on gloo]
            pending = after(self.comm.reduce_scatter(output, input, what, scratch), lambda: self._pool.give(scratch))
        if self.replicas is None or not sum_replicas:
            return pending
        replicas = self.replicas  # the shard, summed over the shard groups: see [Note: hybrid sharding]

        def across_replicas() -> None:
            if fold is not None:  # the group's sums of the deferred backwards: see [Note: hybrid sharding]
                if fold.device != output.device:
                    wait_for_copies(output.device)  # an earlier non-blocking copy into it may be in flight
                output.add_(fold.to(output.device, output.dtype))
            replicas.all_reduce(output, what=lambda: f"all-reduce across the shard groups of the {what()}")
        return after(pending, across_replicas)

    def _reduce_scatter_in(self, dtype: torch.dtype, output: torch.Tensor, input: torch.Tensor, what) -> Pending:
        """``input`` rounded to ``dtype``, reduce-scattered in it, and converted into ``output`` (see [Note:
        low-precision reductions]); the buffers come from the pool and go back to it."""
        sent = self._pool.take(input.numel(), dtype, input.device)
        sent.copy_(input.view(-1))
        got = self._pool.take(output.numel(), dtype, output.device)
        scratch = self._pool.take(input.numel(), dtype, input.device) if self.comm.reduce_scatter_needs_scratch \
            else None
        pending = self.comm.reduce_scatter(got, sent, what, scratch)

        def back() -> None:
            output.view(-1).copy_(got)
            for buffer in (sent, got, scratch):
                if buffer is not None:
                    self._pool.give(buffer)
        return after(pending, back)

    def _segment_name(self, gi: int, si: int) -> str:
        """A segment, for a profiler range (see [Note: profiler ranges] in engine/diagnose/ranges.py)."""
        return f"segment {si} of group {gi}" if len(self.groups) > 1 else f"segment {si}"

    def _describe(self, gi: int, si: int) -> str:
        seg = self.groups[gi].segments[si]
        return f"reduce-scatter of gradient segment {si} of flat group {gi} ({len(seg.params)} parameters, " \
               f"{seg.numel} elements)"

    def reduce(self) -> None:
        """Make every piece's gradient the average over ranks (before the step). Idempotent until zero_grad."""

    def piece_grad(self, gi: int, piece: Piece) -> torch.Tensor:
        """The averaged gradient of ``piece`` (valid after reduce(), and on the host once the
        device's copies are done)."""
        raise NotImplementedError

    def received_anywhere(self, steps: int, guard: Optional["OrderGuard"] = None) -> list[list[bool]]:
        """Which parameters got a gradient on at least one rank since zero_grad (one all-reduce,
        which checks that every rank is at its ``steps``-th step after as many backward passes as
        this one, and that ``guard``'s gathers without headers agree: see [Note: the step's tally])."""
        flags = [f for per_group in self.received for f in per_group]
        if not flags:
            return []
        digest = guard.digest() if guard is not None else 0
        tally = step_tally.tally_bytes(steps, self.backwards, digest)
        mask = torch.cat([torch.tensor(flags, dtype=torch.uint8), tally]).to(self.groups[0].device)
        self.world.all_reduce(mask, op=dist.ReduceOp.MAX, what=lambda: "all-reduce of which parameters got gradients")
        key = f"tally/{self.world.key}/{self.world.issued}"  # this all-reduce, named alike on every rank
        step_tally.check(tally, mask[len(flags):], steps, self.backwards, key, self.world.scope, digest,
                         self.world.explain)
        if guard is not None:
            guard.checked()
        values, out = mask[: len(flags)].tolist(), []
        for per_group in self.received:
            out.append([bool(v) for v in values[: len(per_group)]])
            values = values[len(per_group):]
        return out

    def held_tensors(self) -> list[torch.Tensor]:
        """Gradient storage that outlives a step."""
        raise NotImplementedError

    def workspace_tensors(self) -> list[torch.Tensor]:
        """Staging and receive buffers kept free for the next reductions (see [Note: reused buffers])."""
        return self._pool.free_buffers()

    def host_tensors(self) -> list[torch.Tensor]:
        """The gradient storage that lives in host memory (see [Note: gradients to the host])."""
        return [h for h in self.host_grads if h is not None]

    def zero_grad(self) -> None:
        self.received = [[False] * len(g.params) for g in self.groups]

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class FullGradientReducer(GradientReducer):
    """Stage 1: every parameter's ``.grad`` is a view of a full flat gradient buffer, so autograd
    accumulates in place (over micro-batches too); ``reduce()``, called before the step, reduces
    each segment in place."""

    def __init__(self, groups: Sequence[FlatGroup], comm: Collectives, position: Mapping[torch.nn.Parameter, int],
                 host_dtypes: Optional[Sequence[torch.dtype]] = None, hybrid: Optional[HybridGroups] = None) -> None:
        super().__init__(groups, comm, position, host_dtypes, hybrid)
        self.grad_buffers = [torch.zeros(g.layout.numel, dtype=g.dtype, device=g.device) for g in self.groups]
        self._grad_views = [g.param_views(b) for g, b in zip(self.groups, self.grad_buffers)]
        self._reduced = False  # reduce() already ran for the current gradients
        self._attach_grad_views()

    def _attach_grad_views(self) -> None:
        for group, views in zip(self.groups, self._grad_views):
            for p, view in zip(group.params, views):
                p.grad = view

    def _backward_ended(self) -> None:
        super()._backward_ended()
        self.comm.breakdown.leave(BACKWARD)  # nothing to reduce until the step

    def _on_grad(self, gi: int, i: int, param: torch.nn.Parameter) -> None:
        self.received[gi][i] = True
        view = self._grad_views[gi][i]
        if param.grad is not view:  # e.g. create_graph=True made autograd replace it
            view.add_(param.grad)
            param.grad = view

    def reduce(self) -> None:
        if self._reduced:
            return
        self._pool.begin_pass()
        inflight: deque = deque()
        for n, (gi, si) in enumerate(self.order):
            group = self.groups[gi]
            seg = group.segments[si]
            full = group.segment_of(self.grad_buffers[gi], seg)
            if self.average_over > 1:
                full.div_(self.average_over)
            with span(lambda: f"zero/reduce-scatter {self._segment_name(gi, si)}"):
                inflight.append((gi, si, self._reduce_scatter(gi, group.own_shard_of(self.grad_buffers[gi], seg),
                                                              full, functools.partial(self._describe, gi, si))))
            while inflight and (len(inflight) > MAX_INFLIGHT or n == len(self.order) - 1):
                self._finish_segment(*inflight.popleft())
        self._pool.end_pass()
        self._reduced = True

    def _finish_segment(self, gi: int, si: int, pending: Pending) -> None:
        with span(lambda: f"zero/wait reduce-scatter {self._segment_name(gi, si)}"):
            pending.wait(REDUCE)
        host, group = self.host_grads[gi], self.groups[gi]
        if host is not None:  # see [Note: gradients to the host]: the step's offload time
            seg = group.segments[si]
            with span(lambda: "zero/offload gradients to host"), self.comm.breakdown.waiting(OFFLOAD, "copy"):
                group.segment_shard(host, seg).copy_(group.own_shard_of(self.grad_buffers[gi], seg), non_blocking=True)

    def piece_grad(self, gi: int, piece: Piece) -> torch.Tensor:
        host = self.host_grads[gi]
        if host is not None:
            return FlatGroup.shard_slice(host, piece)
        return self.groups[gi].piece_of(self.grad_buffers[gi], piece)

    def held_tensors(self) -> list[torch.Tensor]:
        return list(self.grad_buffers) + self.host_tensors()

    def zero_grad(self) -> None:
        super().zero_grad()
        self._reduced = False
        for buffer in self.grad_buffers:
            buffer.zero_()
        self._attach_grad_views()


class ShardedGradientReducer(GradientReducer):
    """Stages 2 and 3: a hook copies each gradient into its segment's staging buffer and frees it;
    complete segments are reduced asynchronously into a gradient shard while backward goes on, and
    only that shard outlives the backward pass. ``listener`` (stage 3's sharder) is told when a
    group's gradients are all in and when backward ends; ``host_listener`` (the overlapped step's)
    when a segment's gradient is in its host shard (see engine/optim/step/overlap.py). With ``local``
    (``local_accumulation``) a deferred backward adds its gradients into full-size local buffers and
    reduces nothing; the next backward, or ``reduce()``, reduces them (see [Note: local accumulation]
    in engine/grads/accumulation.py)."""

    def __init__(self, groups: Sequence[FlatGroup], comm: Collectives, position: Mapping[torch.nn.Parameter, int],
                 host_dtypes: Optional[Sequence[torch.dtype]] = None, listener=None, host_listener=None,
                 local: Optional[LocalAccumulation] = None, hybrid: Optional[HybridGroups] = None,
                 replica_all_reduce: str = "every_backward") -> None:
        super().__init__(groups, comm, position, host_dtypes, hybrid)
        self.local = local  # local_accumulation: see [Note: local accumulation] in engine/grads/accumulation.py
        # replica_all_reduce="boundary": see [Note: hybrid sharding] in engine/comm/topology.py (local accumulation
        # defers the all-reduce with everything else)
        self.replica_sum = (DeferredReplicaSum() if hybrid is not None and replica_all_reduce == "boundary"
                            and local is None else None)
        self.deferral = local if local is not None else self.replica_sum  # what no_sync() enters
        self.listener = listener
        self.host_listener = host_listener
        self._rank_in_order = {key: n for n, key in enumerate(self.order)}
        self.grad_shards = [h if h is not None else torch.zeros(g.layout.shard_numel, dtype=g.dtype, device=g.device)
                            for g, h in zip(self.groups, self.host_grads)]
        self._shard_filled = False  # False after zero_grad: the next reduction writes, not adds
        self._inflight: deque = deque()  # (key, pending, staging, output, target, add)
        self._reset_backward_state()

    def _reset_backward_state(self) -> None:
        self._staging: dict[tuple[int, int], torch.Tensor] = {}
        self._staged: dict[tuple[int, int], set[int]] = {}  # parameters copied in, per segment
        self._late: set[tuple[int, int]] = set()
        self._segments_in = [0] * len(self.groups)  # segments whose every gradient arrived, per group
        self._next = 0  # position in self.order of the next segment to launch
        self._callback_queued = False

    def _on_grad(self, gi: int, i: int, param: torch.nn.Parameter) -> None:
        self.received[gi][i] = True
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            self._callback_queued = True
            self._pool.begin_pass()
            if self.deferral is not None:
                self.deferral.begin_backward()
        grad, param.grad = param.grad, None
        group = self.groups[gi]
        key = (gi, group.layout.param_segments[i])
        seg = group.segments[key[1]]
        if self.local is not None and self.local.takes(launched=self._rank_in_order[key] < self._next):
            self.local.add(gi, i, grad)  # see [Note: local accumulation]
            self._staged.setdefault(key, set()).add(i)
        else:
            self._stage(gi, i, key, grad)
        if self._rank_in_order[key] < self._next:  # see [Note: late gradients]
            self._late.add(key)
        elif len(self._staged[key]) == len(seg.params):
            self._segments_in[gi] += 1
            if self.listener is not None and self._segments_in[gi] == len(group.segments):
                self.listener.gradients_handed_over(group)
            if self.local is None or not self.local.deferring:
                self._launch_ready()

    def _stage(self, gi: int, i: int, key: tuple[int, int], grad: torch.Tensor) -> None:
        """Copy a gradient into its segment's staging buffer, divided by the world size."""
        group = self.groups[gi]
        seg = group.segments[key[1]]
        staging = self._staging.get(key)
        if staging is None:
            staging = self._staging[key] = self._take_staging(group, seg.numel)
            self._staged.setdefault(key, set())
        offset = group.layout.param_offsets[i] - seg.start
        dst = staging[offset : offset + grad.numel()]
        flat, n = grad.reshape(-1), self.average_over  # average as DDP does: divide, then sum
        if i in self._staged[key]:  # a second gradient for it in this backward: a/n + b/n, equal to
            dst.add_(flat / n)  # (a + b)/n for n a power of 2
        else:
            torch.div(flat, n, out=dst)  # the copy into staging, divided in the same pass (exact for n = 1)
            self._staged[key].add(i)

    def _on_backward_end(self) -> None:
        try:
            if self.local is not None and self.local.deferring:  # nothing to reduce: see [Note: local accumulation]
                self.local.deferring = False
                self._pool.end_pass()
                self._reset_backward_state()
                if self.listener is not None:
                    self.listener.backward_finished()
                return
            self._launch_all()
            if self.listener is not None:
                self.listener.backward_finished()
        finally:
            self.comm.breakdown.leave(BACKWARD)  # its last reductions waited for: see [Note: the step breakdown]

    def _launch_all(self) -> None:
        """Launch every segment not launched yet, then the late ones, and wait for them all."""
        while self._next < len(self.order):
            self._launch(self.order[self._next], accumulate=False)
            self._next += 1
        for key in sorted(self._late, key=self._rank_in_order.__getitem__):
            self._launch(key, accumulate=True)
        self._finish(len(self._inflight))
        self._pool.end_pass()
        self._shard_filled = True
        self._reset_backward_state()
        if self.local is not None:
            self.local.reduced()

    def reduce(self) -> None:
        if self.local is not None and self.local.pending:  # accumulated, and no boundary backward came
            self._pool.begin_pass()
            self._launch_all()
        if self.replica_sum is not None and self.replica_sum.unsynced:  # the same for the replicas' sum
            for gi, si in sorted(self.replica_sum.unsynced, key=self._rank_in_order.__getitem__):
                group = self.groups[gi]
                target = group.segment_shard(self.grad_shards[gi], group.segments[si])
                if target.device != group.device:
                    wait_for_copies(group.device)
                shard = target.to(group.device)  # target itself where the shard is on the device
                self.replicas.all_reduce(shard, what=lambda: f"all-reduce across the shard groups of the "
                                                             f"{self._describe(gi, si)}, deferred to the step",
                                         part=REDUCE)
                if shard is not target:
                    target.copy_(shard)
                if self.host_listener is not None:  # what it stepped from this segment is superseded
                    self.host_listener.segment_ready(gi, si, self.received[gi])
            self.replica_sum.unsynced.clear()

    def _replicas_plan(self, key: tuple[int, int], accumulate: bool,
                       target: torch.Tensor) -> tuple[Optional[torch.Tensor], bool]:
        """For a segment launched now: (the shard to add into its result before the replicas'
        all-reduce, whether to all-reduce it at all); see [Note: hybrid sharding] in engine/comm/topology.py."""
        deferred = self.replica_sum
        if deferred is None:
            return None, True
        if deferred.deferring:
            deferred.unsynced.add(key)
            return None, False
        if key in deferred.unsynced and not accumulate:  # a late gradient's launch follows the first one
            deferred.unsynced.discard(key)
            return target, True
        return None, True

    def _launch_ready(self) -> None:
        while self._next < len(self.order):
            key = self.order[self._next]
            seg = self.groups[key[0]].segments[key[1]]
            if len(self._staged.get(key, ())) < len(seg.params):
                return
            self._launch(key, accumulate=False)
            self._next += 1

    def _launch(self, key: tuple[int, int], accumulate: bool) -> None:
        gi, si = key
        group = self.groups[gi]
        seg = group.segments[si]
        buffer = self._staging.pop(key, None)
        staged = self._staged.pop(key, set())
        if buffer is None:  # no gradient reached this segment on this rank, or all went to the local buffer
            buffer = self._take_staging(group, seg.numel)
        staging = buffer[: seg.numel]
        if not accumulate and self.local is not None and self.local.take_segment(gi, seg, staging,
                                                                                  self.average_over):
            staged = set(seg.params)  # the whole segment comes from the local buffer
        # A reused buffer holds earlier values: zero what no gradient overwrote (alignment gaps
        # between parameters land in padding that no piece reads).
        for i, off, n in zip(seg.params, seg.offsets, seg.numels):
            if i not in staged and n:
                staging[off : off + n].zero_()
        end = seg.offsets[-1] + seg.numels[-1]
        staging[end:].zero_()  # the gradients in it are already divided by the world size (_on_grad)
        target = group.segment_shard(self.grad_shards[gi], seg)
        fold, sum_replicas = self._replicas_plan(key, accumulate, target)
        add = (self._shard_filled or accumulate) and fold is None  # a folded shard is replaced, not added to
        if self.host_grads[gi] is not None or fold is not None:  # see [Note: gradients to the host]
            output = torch.empty(seg.shard_numel, dtype=group.dtype, device=group.device)
        else:
            output = torch.empty_like(target) if add else target
        what = functools.partial(self._describe, gi, si)
        with span(lambda: f"zero/reduce-scatter {self._segment_name(gi, si)}"):  # see [Note: profiler ranges]
            pending = self._reduce_scatter(gi, output, staging, what, fold, sum_replicas)
        self._inflight.append((key, pending, buffer, output, target, add))
        self._finish(len(self._inflight) - MAX_INFLIGHT)

    def _finish(self, count: int) -> None:
        """Complete the ``count`` oldest reductions in flight and recycle their staging buffers."""
        for _ in range(max(0, count)):
            (gi, si), pending, buffer, output, target, add = self._inflight.popleft()
            with span(lambda: f"zero/wait reduce-scatter {self._segment_name(gi, si)}"):
                pending.wait(REDUCE)
            if add:  # accumulating over micro-batches, or a late gradient
                if target.device != output.device:
                    wait_for_copies(output.device)  # an earlier non-blocking copy into target may be in flight
                target.add_(output.to(target.device, target.dtype))
            elif output is not target:  # a device result for a host shard: the step's offload time
                with span(lambda: "zero/offload gradients to host"), self.comm.breakdown.waiting(OFFLOAD, "copy"):
                    target.copy_(output, non_blocking=True)
            if self.host_listener is not None:
                self.host_listener.segment_ready(gi, si, self.received[gi])
            self._pool.give(buffer)

    def _take_staging(self, group: FlatGroup, numel: int) -> torch.Tensor:
        return self._pool.take(numel, group.dtype, group.device)

    def piece_grad(self, gi: int, piece: Piece) -> torch.Tensor:
        return FlatGroup.shard_slice(self.grad_shards[gi], piece)  # the host shard itself when offloaded

    def held_tensors(self) -> list[torch.Tensor]:
        return list(self.grad_shards) + (self.local.held_tensors() if self.local is not None else [])

    def zero_grad(self) -> None:
        super().zero_grad()
        if self.local is not None:
            self.local.drop()
        self._shard_filled = False
        if self.replica_sum is not None:
            self.replica_sum.unsynced.clear()
        for group in self.groups:
            for p in group.params:
                p.grad = None


def make_reducer(groups: Sequence[FlatGroup], stage: int, comm: Collectives,
                 position: Mapping[torch.nn.Parameter, int], listener=None,
                 host_dtypes: Optional[Sequence[torch.dtype]] = None, host_listener=None,
                 local: Optional[LocalAccumulation] = None, hybrid: Optional[HybridGroups] = None,
                 replica_all_reduce: str = "every_backward") -> GradientReducer:
    """Stage 1's reducer (full gradients, reduced before the step) or stages 2-3's (sharded, during
    backward; at stage 3 unit by unit, telling ``listener`` the sharder; ``host_listener``: see
    ShardedGradientReducer)."""
    if stage == 1:
        assert host_listener is None, "stage 1 reduces gradients only at the step"
        return FullGradientReducer(groups, comm, position, host_dtypes, hybrid)
    return ShardedGradientReducer(groups, comm, position, host_dtypes, listener, host_listener, local, hybrid,
                                  replica_all_reduce)
