"""The few collectives the engine issues, over one process group and the subgroups made from it.

Everything the engine sends goes through one ``Collectives`` object (and the subgroups it makes,
which share its counter and node layout), so every byte is counted (see [Note: bytes sent] in
engine/comm/volume.py, and ``comm_stats()``), tests can substitute a subclass that records calls, and a
world of size 1 needs no process group at all.

[Note: reduce-scatter on gloo]
gloo implements reduce-scatter as a full all-reduce of a private copy of the input followed by a
copy out of the rank's chunk, which sends twice the bytes a reduce-scatter needs. On gloo the
engine runs it as one all-to-all instead (rank j receives every rank's chunk j, into a receive
buffer the caller may pass as ``scratch``) and sums what arrived in rank order: the bytes of a
reduce-scatter, no private copy, and 0.3-0.8x the time of an in-place all-reduce on one host (2 and
4 ranks, 1-32 MiB: ``bench_gloo_collectives.py``, benchmarks/RESULTS.md). Over 2 ranks the sum is
the all-reduce's to the bit (a + b = b + a); over more, it adds in rank order, once, where a ring
rounds at every hop.

[Note: all-gather on gloo]
gloo's all-gather into one tensor gathers into a private flat tensor of the output's size and then
copies it out: two allocations of the output's size per call, which fragment glibc's heap (stage 3
of the 67M-parameter benchmark MLP stays at 0.98x DDP's peak resident memory with them, 0.72-0.78x
without). One broadcast from each rank straight into its chunk of the output, issued together,
sends the same bytes (each chunk reaches the n-1 others), allocates nothing, and on one host takes
0.3-0.9x the time (``bench_gloo_collectives.py``, 2 and 4 ranks, 1-128 MiB; the gain grows with
the size). But when a rank computes with several threads and the host is oversubscribed,
OpenMP's spinning worker threads starve the broadcasts' gloo threads (and not gloo's all-gather):
3x slower with 2 ranks x 2 threads on 2 cores, 10x with four such jobs; with
OMP_WAIT_POLICY=PASSIVE, or one thread per rank, the broadcasts are as fast as ever
(benchmarks/RESULTS.md, 2026-12-02). So an all-gather of at least ``BROADCAST_GATHER_BYTES`` runs
as broadcasts on gloo only when torch computes on one thread on every rank of the group
(``torch.get_num_threads() == 1``: what Lightning and torchrun set for several ranks on a CPU host
with a core each), counted as the all-gather it is; otherwise, and below that size (where one
collective's latency counts more than its bytes), it is gloo's own. The ranks agree on it with one
all-reduce on the group's first such all-gather, and keep the answer: ranks that decided alone,
with other thread counts, would run different collectives and hang. That all-reduce (4 bytes,
once) is set-up, not a step's traffic, so ``comm_stats()`` does not count it.

[Note: quantized reduce-scatter]
``quantized_reduce_scatter`` (``quantized_gradients``) sends block-quantized chunks (see [Note:
packed rows] in quantize.py) and sums what arrives after dequantizing it, in fp32, so each rank's
contribution is rounded once and the rounding errors do not compound along a ring. Over one node,
or without a node layout, it is one all-to-all: rank j receives every rank's quantized chunk j. Over
several nodes of several ranks it takes two hops, so that little crosses nodes: first an
all-to-all among the ranks of a node, which leaves local rank l with its node's partial sums of the
shards of ranks l, K + l, 2K + l, ... (K ranks per node); then, requantized, an all-to-all among the
ranks with local index l, one per node, which completes each shard. Rounding happens twice
(once per hop), not once per rank. The second hop starts when the first is waited for.
"""

from __future__ import annotations

import functools
import weakref
from collections import deque
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..diagnose.breakdown import COMM_OTHER, StepBreakdown
from ..diagnose.divergence import HISTORY, compare_posted
from ..diagnose.header import HEADER_BYTES, Header
from ..diagnose.watchdog import Watchdog
from .quantize import QuantSpec, dequantize_sum, quantize_rows
from .volume import KINDS, CommCounter, NodeLayout, sent_bytes

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


Describe = Callable[[], str]
"""Names a collective for the watchdog's and the failures' messages: called only when needed."""


_TWINS: dict[tuple, Any] = {}
"""(process group, purpose) -> the process group ``Collectives.twin`` made for it, kept for the process."""

BROADCAST_GATHER_BYTES = 1 << 20
"""gloo all-gathers of at least this many output bytes may run as broadcasts: see [Note: all-gather on gloo]."""


def _unnamed() -> str:
    return "collective"


class Pending:
    """A collective in flight. ``wait()`` blocks until it is done, then runs what completes it.

    ``timer`` (its engine's) times the wait as the part of the step ``wait(part)`` names, and files it
    under the collective's ``kind`` too (see [Note: the step breakdown] in engine/diagnose/breakdown.py).
    """

    def __init__(self, work: Optional[dist.Work] = None, then: Optional[Callable[[], object]] = None,
                 watchdog: Optional[Watchdog] = None, what: Describe = _unnamed,
                 waiting: Optional[Callable[[float], None]] = None, timer: Optional[StepBreakdown] = None,
                 kind: Optional[str] = None) -> None:
        self._work = work
        self._then = then
        self._watchdog = watchdog
        self._what = what
        self._waiting = waiting  # see Watchdog.wait
        self._timer = timer
        self.kind = kind  # a key of comm_stats(): all_gather, reduce_scatter, ...

    def wait(self, part: str = COMM_OTHER) -> None:
        """Block until done; the time it blocked counts as ``part`` of the step (one of the waits of
        [Note: the step breakdown]; a wait inside another counts as the outer one's)."""
        timer = self._timer
        if timer is None or not timer.enabled or (self._work is None and self._then is None):
            self._complete()
            return
        start = timer.wait_began()
        try:
            self._complete()
        finally:
            timer.wait_ended(start, part, self.kind)

    def _complete(self) -> None:
        if self._work is not None:
            work, self._work = self._work, None
            if self._watchdog is not None:
                self._watchdog.wait(work, self._what, self._waiting)
            else:
                work.wait()
        if self._then is not None:
            then, self._then = self._then, None
            then()


def after(pending: Pending, then: Callable[[], object]) -> Pending:
    """A Pending that waits for ``pending``, then runs ``then`` (dequantizing what arrived, say)."""
    def finish() -> None:
        pending.wait()
        then()
    return Pending(then=finish, timer=pending._timer, kind=pending.kind)


def _copy_unless_same(output: torch.Tensor, input: torch.Tensor) -> None:
    if output.data_ptr() != input.data_ptr():
        output.copy_(input)


class Collectives:
    """Asynchronous reduce-scatter and all-gather plus small synchronous helpers on one group.

    ``collective_timeout`` (seconds, None: no limit) arms the watchdog of every wait: see
    [Note: hang watchdog] in engine/diagnose/watchdog.py. ``what`` arguments name a collective in its messages.
    ``ranks_per_node`` is the node layout (see [Note: intra-node and inter-node bytes] in
    engine/comm/volume.py; None: ``$LOCAL_WORLD_SIZE``, else one node). ``comm_stats()`` gives the bytes
    this rank sent in the last step, closed by ``end_step()``.
    """

    made = 0  # objects made in this process (see [Note: collectives that differ])

    def __init__(self, group: Optional[dist.ProcessGroup] = None, collective_timeout: Optional[float] = None,
                 ranks_per_node: Optional[int] = None, *, _parent: Optional["Collectives"] = None) -> None:
        self.group = group
        initialized = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if initialized else 1
        self.rank = dist.get_rank(group) if initialized else 0
        self.backend = str(dist.get_backend(group)) if initialized else "none"
        self.collective_timeout = collective_timeout
        Collectives.made += 1  # see [Note: collectives that differ]
        self.key = f"collective/{Collectives.made}/{self.global_rank(0) if initialized else 0}+{self.world_size}"
        self.scope = _parent.scope if _parent is not None else self.key  # one engine's groups: see out_of_step
        self.watchdog = Watchdog(collective_timeout, dist.get_rank() if initialized else 0, self.backend, self.scope)
        self.issued = 0  # collectives issued through this object
        self.mismatch_wait_s = _parent.mismatch_wait_s if _parent is not None else 5.0  # a subgroup's: its parent's
        self.history: deque[tuple[int, str, tuple]] = deque(maxlen=HISTORY)  # see [Note: collectives that differ]
        if _parent is None:
            self.nodes = NodeLayout(dist.get_world_size() if initialized else 1, ranks_per_node)
            self.counter = CommCounter()
            self.breakdown = StepBreakdown()  # see [Note: the step breakdown]; enabled by the engine
            self._subgroups: dict[tuple, "Collectives"] = {}
            self.guards: list[weakref.ref] = []  # the order guards over these groups: see explain, _named
            self._scope: list[Collectives] = [self]  # this object and its subgroups
        else:  # a subgroup counts into its parent's counter, on the same nodes
            self.nodes, self.counter, self._subgroups = _parent.nodes, _parent.counter, _parent._subgroups
            self.breakdown = _parent.breakdown
            self.guards, self._scope = _parent.guards, _parent._scope
            self._scope.append(self)
        self.global_ranks = [self.global_rank(r) for r in range(self.world_size)]
        self.inter_node = self.nodes.spans_nodes(self.global_ranks)
        self._by_broadcasts: Optional[bool] = None  # see _gathers_by_broadcasts

    def _pending(self, work: Optional[dist.Work], then: Optional[Callable[[], object]], what: Describe,
                 kind: str, header: Optional[Header] = None) -> Pending:
        """``work`` as a Pending; ``kind`` (its collective's), the count of collectives issued here
        and the order guard's ``header`` (of a gather) tell it apart from another rank's (see [Note:
        collectives that differ])."""
        self.issued += 1
        waiting = header.waiting if header is not None else None
        if self.watchdog.watched:
            seq, inner, next_read = self.issued, waiting, [self.mismatch_wait_s]
            self.history.append((seq, kind, header.words if header is not None else ()))

            def waiting(waited: float) -> None:
                if inner is not None:
                    inner(waited)
                if waited >= next_read[0]:  # then ever more seldom: a long legitimate wait (a rank writing
                    next_read[0] = waited + max(1.0, waited / 4)  # a checkpoint) must not flood the store
                    self._compare_posted(seq, what)
        return Pending(work, then, self.watchdog, what, waiting, self.breakdown, kind.replace("-", "_"))

    def _compare_posted(self, seq: int, what: Describe) -> None:
        """This rank has waited long for its ``seq``-th collective here: compare with the others' posts
        (see [Note: collectives that differ] in engine/diagnose/divergence.py)."""
        compare_posted(self._scope, self, seq, what(), self._named, lambda: self.explain(lengths_too=False))

    def _live_guards(self) -> list:
        return [guard for guard in (ref() for ref in self.guards) if guard is not None]

    def _named(self, kind: str, tag: tuple[int, ...]) -> str:
        """A collective of a history, for a message: its kind, and for a gather what its order guard's
        tag says it was for (the scope's first guard names it)."""
        guards = self._live_guards()
        article = "an" if kind[0] in "aeiou" else "a"
        if not tag or not guards:
            return f"{article} {kind}"
        return f"{article} {kind} for {guards[0].doing(tag)}"

    def explain(self, lengths_too: bool = True) -> None:
        """The ranks are out of step: let what knows more say it first (an order guard whose gathers
        went without their headers raises the UnitOrderError of the first that differed: see [Note:
        headers left out on gloo] in order_guard.py; without ``lengths_too`` only where two ranks'
        gathers differ, not where one rank's end); returns if none does."""
        for guard in self._live_guards():
            guard.explain_left_out(lengths_too)

    def _count(self, kind: str, algorithm: str, nbytes: int) -> None:
        self.counter.add(kind, sent_bytes(algorithm, nbytes, self.world_size), self.inter_node)

    # ---- accounting: see [Note: bytes sent] in engine/comm/volume.py ---------------------------------

    def comm_stats(self, times: bool = False) -> dict[str, float]:
        """Bytes this rank sent in the last step (closed by ``end_step``), by collective kind and by
        link: all_gather, reduce_scatter, all_reduce, broadcast, all_to_all, total, intra_node, inter_node.
        ``times``: also the seconds the rank waited for them, not hidden by computation (``<kind>_s``
        and ``total_s``; see [Note: the step breakdown]; zeros with ``step_breakdown=False``)."""
        stats: dict[str, float] = dict(self.counter.last())
        if times:
            self.breakdown.flush()
            last = self.breakdown.last()
            waited = last.waited if last is not None else {}
            for kind in KINDS:
                stats[f"{kind}_s"] = waited.get(kind, 0.0)
            stats["total_s"] = sum(waited.values())
        return stats

    def begin_step(self) -> None:
        """Forget what was counted since the last ``end_step`` (set-up, an evaluation loop): its bytes,
        and its time (the next step's starts now)."""
        self.counter.begin_step()
        self.breakdown.reset()

    def end_step(self) -> None:
        """A training step (its optimizer step) ended: its bytes become ``comm_stats()``, its time a
        record of the step breakdown."""
        self.counter.end_step()
        self.breakdown.end_step()

    # ---- subgroups ---------------------------------------------------------------------------

    def split(self, partition: Sequence[Sequence[int]], purpose: str = "") -> "Collectives":
        """This rank's group among ``partition`` (lists of ranks of this group that cover it), as a
        Collectives counting into this one's counter. Each partition's process groups are created
        once, on first use, which every rank must reach at the same point (creating a group is a
        collective of the whole world); a ``purpose`` gets process groups of its own for the same
        partition (see ``twin``)."""
        parts = tuple(tuple(sorted(ranks)) for ranks in partition)
        key = (purpose, *parts)
        if sorted(r for ranks in parts for r in ranks) != list(range(self.world_size)):
            raise ValueError(f"partition {[list(k) for k in parts]} must hold each of the {self.world_size} ranks once")
        if self.world_size == 1:
            return self
        if len(parts) == 1 and purpose and self.world_size == dist.get_world_size():  # the whole world again
            return self.twin(purpose)
        if key not in self._subgroups:
            if self.world_size != dist.get_world_size():
                raise ValueError(f"subgroups are made from the whole world ({dist.get_world_size()} ranks); this "
                                 f"group has {self.world_size}: give the engine the default process group.")
            mine = None
            for ranks in parts:  # every rank creates every group, in the same order
                group = dist.new_group([self.global_rank(r) for r in ranks])
                if self.rank in ranks:
                    mine = group
            self._subgroups[key] = Collectives(mine, self.collective_timeout, _parent=self)
        return self._subgroups[key]

    def twin(self, purpose: str) -> "Collectives":
        """This group's ranks over a process group of their own, for collectives whose order among this
        group's may differ between ranks ([Note: reductions beside gathers] in
        engine/params/flat_parameters.py), counting into this one's counter. One per purpose and
        process group in the process, made on first use (by every rank of the world at the same point)."""
        if self.world_size == 1:
            return self
        if self.world_size != dist.get_world_size():
            raise ValueError(f"a twin of a group of {self.world_size} ranks is made with split(partition, purpose) "
                             f"from the whole world ({dist.get_world_size()} ranks).")
        key = (self.group if self.group is not None else dist.group.WORLD, purpose)
        if key not in _TWINS:
            _TWINS[key] = dist.new_group(list(range(self.world_size)))
        return Collectives(_TWINS[key], self.collective_timeout, _parent=self)

    def consecutive(self, size: int) -> "Collectives":
        """This rank's group of ``size`` consecutive ranks (size divides the world size)."""
        if size < 1 or self.world_size % size:
            raise ValueError(f"groups of {size} ranks do not divide the {self.world_size} ranks")
        return self.split([range(start, start + size) for start in range(0, self.world_size, size)])

    def within_node(self, size: int, name: str = "size") -> "Collectives":
        """This rank's group of ``size`` consecutive ranks, which must lie within one node; ``name``
        is the setting that asked, for the errors."""
        world, per_node = self.world_size, self.nodes.ranks_per_node
        if world % size:
            raise ValueError(f"{name}={size} does not divide the world size {world}: every rank needs a group of "
                             f"{size}. Use a divisor of {world} (usually the devices per node).")
        if per_node == 1:
            raise ValueError(f"{name}={size} with one rank per node: a group of {size} ranks would span nodes, so "
                             "its all-gathers would cross them anyway. Drop it, or give the engine the node layout "
                             "(Collectives(ranks_per_node=...), or $LOCAL_WORLD_SIZE).")
        if per_node % size:
            raise ValueError(f"{name}={size} does not divide the {per_node} ranks per node: some groups would span "
                             f"two nodes. Use a divisor of {per_node}.")
        return self.consecutive(size)

    @functools.cached_property
    def hierarchy(self) -> Optional[tuple["Collectives", "Collectives"]]:
        """(this rank's node, the ranks with this rank's local index: one per node), when the world
        has several nodes of several ranks; None otherwise (or for a group smaller than the world).
        Made on first use, which every rank must reach at the same point (see ``split``)."""
        per_node, nodes = self.nodes.ranks_per_node, self.nodes.num_nodes
        if self.world_size != self.nodes.world_size or per_node == 1 or nodes == 1:
            return None
        same_local = self.split([range(local, self.world_size, per_node) for local in range(per_node)])
        return self.consecutive(per_node), same_local

    @property
    def reduce_scatter_needs_scratch(self) -> bool:
        """Whether ``reduce_scatter`` receives into a buffer like its input (see [Note: reduce-scatter on gloo])."""
        return self.backend == "gloo" and self.world_size > 1

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, what: Describe = _unnamed,
                       scratch: Optional[torch.Tensor] = None) -> Pending:
        """Sum ``input`` (world_size equal chunks) over ranks into ``output`` (this rank's chunk).

        ``output`` may be this rank's chunk of ``input`` itself (in place). ``input`` must not change
        until the result is waited for. ``scratch``: a buffer of ``input``'s size and dtype to receive
        into where ``reduce_scatter_needs_scratch`` (else one is allocated), free again once waited.
        """
        n = self.world_size
        if n == 1:
            return Pending(then=lambda: _copy_unless_same(output, input.view(-1)))
        self._count("reduce_scatter", "reduce_scatter", input.numel() * input.element_size())
        if self.backend == "gloo":  # see [Note: reduce-scatter on gloo]
            received = scratch.view(-1) if scratch is not None else torch.empty_like(input).view(-1)
            work = dist.all_to_all_single(received, input.view(-1), group=self.group, async_op=True)
            return self._pending(work, lambda: torch.sum(received.view(n, -1), 0, out=output.view(-1)), what,
                                 "reduce-scatter")
        return self._pending(_reduce_scatter_single(output, input, group=self.group, async_op=True), None, what,
                             "reduce-scatter")

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, what: Describe = _unnamed,
                   header: Optional[Header] = None) -> Pending:
        """Concatenate every rank's ``input`` into ``output``; ``input`` may alias its own chunk.
        ``header``: sent with it, checked once waited (see [Note: the collective header]); on gloo
        left out where it may be (see [Note: headers left out on gloo] in engine/comm/order_guard.py)."""
        if self.world_size == 1:
            return Pending(then=lambda: _copy_unless_same(output, input))
        nbytes = output.numel() * output.element_size()
        if header is not None:
            if header.defer is None or self.backend != "gloo" or nbytes < BROADCAST_GATHER_BYTES:
                return self._all_gather_with_header(output, input, what, header)
            header.leave_out()  # its tag still goes in the history and the posts of a long wait
        self._count("all_gather", "all_gather", nbytes)
        if self._by_broadcasts_at(nbytes):
            return self._gather_by_broadcasts(output, input, what, header)
        return self._pending(_all_gather_single(output, input, group=self.group, async_op=True), None, what,
                             "all-gather", header)

    def _all_gather_with_header(self, output: torch.Tensor, input: torch.Tensor, what: Describe,
                                header: Header) -> Pending:
        """Every rank's ``input`` and header (see [Note: the collective header]): on NCCL one
        coalesced group of two all-gathers; on gloo the header's all-gather and the chunks'
        broadcasts where a gather goes by broadcasts ([Note: all-gather on gloo]), else one
        all-gather of each rank's chunk and header side by side, the chunks copied out once the
        header is checked."""
        n, nbytes = self.world_size, output.numel() * output.element_size()
        self._count("all_gather", "all_gather", nbytes + n * HEADER_BYTES)
        if self._by_broadcasts_at(nbytes):
            received = header.receive_buffer(n, torch.int32, input.device)
            work = _all_gather_single(received.view(-1), header.send_as(torch.int32, input.device),
                                      group=self.group, async_op=True)
            checked = self._pending(work, lambda: header.received(received), what, "all-gather", header)
            gathered = self._gather_by_broadcasts(output, input, what, header)
            return Pending(then=lambda: wait_all([checked, gathered]), timer=self.breakdown, kind="all_gather")
        if self.backend == "gloo":
            chunk = input.numel()
            send = header.send_as(input.dtype, input.device)
            staged = input.new_empty((n, chunk + send.numel()))  # row r: rank r's chunk, then its header
            mine = staged[self.rank]
            mine[:chunk].copy_(input.view(-1))
            mine[chunk:].copy_(send)
            work = _all_gather_single(staged.view(-1), mine, group=self.group, async_op=True)

            def then() -> None:
                header.received(staged[:, chunk:].contiguous())  # before anything reads the chunks
                output.view(n, -1).copy_(staged[:, :chunk])
            return self._pending(work, then, what, "all-gather", header)
        received = header.receive_buffer(n, input.dtype, input.device)
        send = header.send_as(input.dtype, input.device)
        with dist._coalescing_manager(self.group, input.device, async_ops=True) as coalesced:
            _all_gather_single(output, input.view(-1), group=self.group)
            _all_gather_single(received.view(-1), send, group=self.group)
        return self._pending(_Works(coalesced.works), lambda: header.received(received), what, "all-gather",
                             header)

    def _by_broadcasts_at(self, nbytes: int) -> bool:
        """Whether an all-gather of ``nbytes`` output bytes runs as broadcasts ([Note: all-gather on gloo])."""
        return self.backend == "gloo" and nbytes >= BROADCAST_GATHER_BYTES and self._gathers_by_broadcasts()

    def _gathers_by_broadcasts(self) -> bool:
        """Whether every rank of the group computes on one thread: asked of them all together on the
        first large all-gather (ranks that chose differently would run different collectives), then
        kept."""
        if self._by_broadcasts is None:
            alone = torch.tensor([int(torch.get_num_threads() == 1)], dtype=torch.int32)
            # not self.all_reduce: set-up, uncounted (see [Note: all-gather on gloo])
            work = dist.all_reduce(alone, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
            self._pending(work, None, lambda: "all-reduce of whether every rank computes on one thread",
                          "all-reduce").wait()
            self._by_broadcasts = bool(alone.item())
        return self._by_broadcasts

    def _gather_by_broadcasts(self, output: torch.Tensor, input: torch.Tensor, what: Describe,
                              header: Optional[Header] = None) -> Pending:
        chunks = output.view(self.world_size, -1)
        _copy_unless_same(chunks[self.rank], input.view(-1))
        parts = [self._pending(dist.broadcast(chunk, src=self.global_rank(r), group=self.group, async_op=True),
                               None, what, "broadcast", header) for r, chunk in enumerate(chunks)]
        return Pending(then=lambda: wait_all(parts), timer=self.breakdown, kind="all_gather")

    def quantized_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, spec: QuantSpec,
                                 what: Describe = _unnamed, noise: Optional[torch.Generator] = None) -> Pending:
        """``reduce_scatter`` with block-quantized chunks, summed in fp32 (see [Note: quantized
        reduce-scatter]); ``output`` may be this rank's chunk of ``input``. ``noise``: round
        stochastically with its draws (see [Note: stochastic rounding of blocks] in engine/comm/quantize.py)."""
        n = self.world_size
        if n == 1:
            return self.reduce_scatter(output, input, what)
        shard = input.numel() // n
        hierarchy = self.hierarchy
        if hierarchy is None:
            packed = quantize_rows(input.view(n, shard), spec, noise=noise)  # (n, row bytes): chunk j for rank j
            return self._all_to_all_packed(packed, "reduce_scatter", what,
                                           lambda got: output.copy_(dequantize_sum(got, shard, spec)))
        node, same_local = hierarchy
        per_node, nodes = node.world_size, same_local.world_size
        # chunk for local peer l: the shards of ranks l, K + l, 2K + l, ...: (K, nodes * shard)
        rows = input.view(nodes, per_node, shard).transpose(0, 1).reshape(per_node, nodes * shard)

        def second_hop(got: torch.Tensor) -> None:
            partial = dequantize_sum(got, nodes * shard, spec).view(nodes, shard)  # this node's sums
            same_local._all_to_all_packed(quantize_rows(partial, spec, noise=noise), "reduce_scatter", what,
                                          lambda got2: output.copy_(dequantize_sum(got2, shard, spec))).wait()

        return node._all_to_all_packed(quantize_rows(rows, spec, noise=noise), "reduce_scatter", what, second_hop)

    def _all_to_all_packed(self, packed: torch.Tensor, kind: str, what: Describe,
                           then: Callable[[torch.Tensor], object]) -> Pending:
        """Row j of ``packed`` to rank j; ``then(received)`` once every rank's row for this one arrived."""
        received = torch.empty_like(packed)
        self._count(kind, "all_to_all", packed.numel())
        work = dist.all_to_all_single(received, packed, group=self.group, async_op=True)
        return self._pending(work, lambda: then(received), what, "all-to-all")

    def all_to_all(self, received: torch.Tensor, sent: torch.Tensor, received_splits: Sequence[int],
                   sent_splits: Sequence[int], what: Describe = _unnamed) -> None:
        """Synchronous all-to-all of unequal parts: ``sent_splits[j]`` elements of ``sent`` to rank j and
        ``received_splits[j]`` from rank j into ``received``, both in rank order."""
        if self.world_size == 1:
            received.copy_(sent)
            return
        self.counter.add("all_to_all", (sum(sent_splits) - sent_splits[self.rank]) * sent.element_size(),
                         self.inter_node)
        work = dist.all_to_all_single(received, sent, list(received_splits), list(sent_splits), group=self.group,
                                      async_op=True)
        self._pending(work, None, what, "all-to-all").wait()

    def broadcast(self, tensor: torch.Tensor, src: int = 0, what: Describe = _unnamed) -> None:
        """In-place, synchronous broadcast from ``src`` (a rank of this group)."""
        if self.world_size > 1:
            self._count("broadcast", "broadcast", tensor.numel() * tensor.element_size())
            work = dist.broadcast(tensor, src=self.global_rank(src), group=self.group, async_op=True)
            self._pending(work, None, what, "broadcast").wait()

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   what: Describe = _unnamed, part: str = COMM_OTHER) -> None:
        """In-place, synchronous all-reduce of a small tensor; its wait counts as ``part`` of the step."""
        if self.world_size > 1:
            self._count("all_reduce", "all_reduce", tensor.numel() * tensor.element_size())
            self._pending(dist.all_reduce(tensor, op=op, group=self.group, async_op=True), None, what,
                          "all-reduce").wait(part)

    def barrier(self, what: Describe = _unnamed) -> None:
        """Synchronous barrier of the group; uncounted (it carries no data)."""
        if self.world_size > 1:
            self._pending(dist.barrier(group=self.group, async_op=True), None, what, "barrier").wait()

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


class _Works:
    """Several works waited for as one (a coalesced group's)."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self, timeout: Optional[Any] = None) -> bool:
        for work in self.works:
            work.wait() if timeout is None else work.wait(timeout=timeout)
        return True


def wait_all(pending: list[Pending], part: str = COMM_OTHER) -> None:
    """Wait for every collective in ``pending``, in order, and empty the list; the waits count as
    ``part`` of the step (see ``Pending.wait``)."""
    for p in pending:
        p.wait(part)
    pending.clear()
