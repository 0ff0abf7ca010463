"""Stage 3: leaves learned at run time, where ranks ask for different units (see [Note: learned leaves]).

[Note: learned leaves]
The plan's leaves ([Note: leaf modules] in engine/params/plan.py) cover routed experts it can see.
Other modules call their units a data-dependent number of times (a block applied k times, k per
rank), or on some ranks only (a branch), or choose experts with no router to see; then the ranks'
gathers part. Found afterwards, that cannot be repaired: the order guard's tags ride inside the
gathers ([Note: the collective header] in engine/diagnose/header.py), so they are read once the
data has moved; gloo ends the process when two ranks' all-gathers differ in size (a 4-byte
difference is enough: "Received data size doesn't match expected size"); NCCL's are compared at the
end of the pass; a gloo gather of 1 MiB or more sends no tag at all. So during the first passes,
*checking passes*, every gather in a pass is *announced* before its all-gathers are issued: one
all-gather of the four words of its tag ([Note: order guard] in engine/comm/order_guard.py), read at
once. Tags that agree: the gather goes on as always. Tags that differ (every rank sees the same
rows): every rank sends the modules it is inside (a forward pre-hook on each module holding units,
and the root, keeps the stack and each module's calls in the pass, in checking passes only) and its
phase, with one ``all_gather_object``, and every rank takes the same decision:
- the leaf L is the innermost module that a rank's forward is inside, in its c-th call, where every
  rank has begun exactly c calls of it: each rank is in that call, or past it (it called fewer units
  in it and went on to the modules after it, or to backward: the last expert of a layer that one
  rank's tokens chose and another's did not). L is a unit from now on: one *merged* unit over the flat groups of
  the units inside it (no new layout: the groups, their shards, the optimizer's pieces and the
  checkpoints stay as they were), with L's forward hooks, in place of those units (their hooks
  detached; their records of order and prefetch moved to it). Every other module of L's class
  (its *class-mates*: the other layers of a mixture-of-experts model) becomes a leaf too, so that
  they do not part later. L is the model for a shared block applied k times by the model itself:
  everything is then one unit, gathered around the model's forward and backward;
- the merged unit is gathered now on every rank (the units in it released first, so that all
  ranks gather the same groups), whatever each rank asked for; a rank that asked for a unit outside
  it (a rank past L) then asks for that unit again (a prefetch is dropped), which the others ask for
  when they leave L, with nothing more to gather inside it. L's forward is already running and its
  hooks came too late for this call: nothing would release it after the call or gather it for
  backward. A class-mate may be running too on a rank past L (which then asks for its merged unit
  as above, where the others gather it at its forward, with its new hooks), or have run already
  (the hooks on its units' outputs ask for its merged unit in backward). So in this pass every
  merged unit is *held* from its first gather until the pass ends (after backward), on every rank
  alike: one pass (the learning one) with those units whole, which later passes do not have. A
  second leaf that would take in one held so is an UnitOrderError naming ``leaf_modules``;
- no such L (a rank outside the model's forward, different entry counts, or every rank in
  backward): the UnitOrderError of [Note: order guard], naming ``leaf_modules``.
Ranks may also gather alike while they call different modules: a unit of several small experts is
gathered on every rank that calls any of them, but entered once on one rank and twice on another;
a later pass whose tokens choose other experts (generation, one token at a time) would then part.
So each rank also keeps the units it entered in the pass, in order, and at the end of a checking
pass the ranks compare them (a digest, in the all-reduce below). Where they differ (and no leaf was
learned in the pass), every rank sends its entries and its modules' calls (``all_gather_object``),
and each unit entered differently makes a leaf of the innermost called module around it that every
rank called as often (with its class-mates); learned there, where nothing is gathered, nothing is
held. Checking stops after ``STABLE_PASSES`` passes in a row in which every rank gathered and
entered the same units as in its previous pass of the same kind (training or evaluation), and
learned nothing: one all-reduce at the end of each checking pass says so. An ordinary model pays the
announcements of its first three passes (one 16-byte all-gather and its wait per gather), then
nothing. A divergence that first shows after checking stopped is the guard's UnitOrderError, or
gloo's abort, as before: name the module in ``leaf_modules``. Learning needs the default plan
(``shard_modules`` names the units: the guard raises instead) and the order guard
(``check_unit_order``).
"""

from __future__ import annotations

import array
import hashlib
import logging
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..comm.order_guard import BACKWARD, FORWARD, PHASES, PREFETCH_BACKWARD, PREFETCH_FORWARD, RECOMPUTE
from ..diagnose.header import WORDS, encode
from .attached import attach_hook, detach_hook
from .plan import is_called
from .unit import in_backward

if TYPE_CHECKING:
    from .unit import Unit

log = logging.getLogger(__name__)

def _eager(hook):
    """Run by Python even inside ``torch.compile`` (see [Note: compiled modules] in flat_parameters.py)."""
    return torch._dynamo.disable(hook, recursive=True)


STABLE_PASSES = 2
"""Checking passes in a row that change nothing before checking stops (see [Note: learned leaves])."""

_FORWARD_PHASES = (FORWARD, PREFETCH_FORWARD)
_BACKWARD_PHASES = (BACKWARD, PREFETCH_BACKWARD, RECOMPUTE)


class LeafLearner:
    """The checking passes of one sharder: announcements, and the leaves learned from them."""

    def __init__(self, sharder: Any) -> None:
        # ``sharder``: the FlatParameters that builds this learner (engine/params/flat_parameters.py, which
        # imports this module: not imported back, so the package has no import circle)
        self.sharder = sharder
        self.root = sharder.module
        self.modules = list(self.root.modules())  # the same order on every rank: a module's number
        self.number = {id(m): i for i, m in enumerate(self.modules)}
        self.checking = True
        self.learned: list[str] = []  # the leaves' names, for messages and tests
        self._stable = 0
        self._previous: dict[bool, int] = {}  # a pass's kind (a backward ended) -> its gathers' digest
        self._sequence: list[tuple[int, ...]] = []  # (unit and phase, context) announced this pass
        self.announced: set[int] = set()  # the units announced this pass
        self._learned_now = False
        self.entries: list[int] = []  # the units whose forward this rank began in this pass, in order
        self._stack: list[nn.Module] = []  # the modules this rank's forward is inside
        self._calls: dict[int, int] = {}  # module number -> its forwards begun in this pass
        self._handles: list[Any] = []
        within_units = {id(m) for u in sharder.units for top in u.modules for m in top.modules()}
        holders = [m for m in self.modules if m is self.root or (  # called modules holding units, not in one
            is_called(m) and id(m) not in within_units and any(id(s) in within_units for s in m.modules()))]
        self._holders = {self.number[id(m)] for m in holders}
        self.parent = {id(c): m for m in self.modules for c in m.children()}
        for m in holders:  # the modules a divergence can lie in (hooks the engine's: engine/params/attached.py)
            for handle in (m.register_forward_pre_hook(_eager(self._entered)),
                           m.register_forward_hook(_eager(self._left), always_call=True)):
                self._handles.append((m, attach_hook(m, handle)))

    # ---- the stack of modules this rank is inside (checking passes only) -------------------------

    def _entered(self, module: nn.Module, args: Any) -> None:
        if not in_backward():
            self._stack.append(module)
            n = self.number[id(module)]
            self._calls[n] = self._calls.get(n, 0) + 1

    def _left(self, module: nn.Module, args: Any, output: Any) -> None:
        if not in_backward() and self._stack and self._stack[-1] is module:
            self._stack.pop()

    def begin_pass(self) -> None:
        self._sequence.clear()
        self.entries.clear()
        self.announced.clear()
        self._calls.clear()
        self._stack.clear()
        self._learned_now = False

    # ---- announcements ---------------------------------------------------------------------------

    def announce(self, unit: "Unit", phase: int, context: Optional["Unit"]) -> "Unit":
        """Every rank's tag of the gather of ``unit`` it is about to issue; the unit to gather instead
        where they differ and a leaf resolves it (see [Note: learned leaves]). Raises where none does."""
        guard, comm = self.sharder.guard, self.sharder.comm
        words = encode(guard.passes, guard.seq + 1, unit.index, phase, context.index if context is not None else -1)
        sent = torch.tensor(words, dtype=torch.int32, device=guard.device)
        rows = sent.new_empty(comm.world_size * WORDS)
        comm.all_gather(rows, sent, lambda: f"all-gather announcing the gather of stage-3 unit {unit.name!r} "
                                            f"({PHASES[phase]}, pass {guard.passes})").wait()
        tags = rows.view(-1, WORDS).cpu()
        if bool((tags == tags[0]).all()):
            self._sequence.append(tuple(words[2:]))  # unit and phase, context: not the pass or the count
            self.announced.add(unit.index)
            return unit
        return self._resolve(unit, phase, tags)

    def _where(self, phase: int) -> tuple[int, list[int], dict[int, int]]:
        """This rank's phase, the modules its forward is inside (numbers), and each module's calls in the pass."""
        return phase, [self.number[id(m)] for m in self._stack], dict(self._calls)

    def _resolve(self, unit: "Unit", phase: int, tags: torch.Tensor) -> "Unit":
        comm, guard = self.sharder.comm, self.sharder.guard
        everyone = comm.all_gather_object(self._where(phase))
        leaf = self._choose(everyone)
        ranks = [comm.global_rank(r) for r in range(comm.world_size)]
        if leaf is None:
            guard._raise_differing(dict(zip(ranks, map(tuple, tags.tolist()))))
        asked = "; ".join(f"rank {r}: {guard.doing(tuple(t))}" for r, t in zip(ranks, tags.tolist()))
        merged = self.sharder.learn_leaf(leaf, f"the ranks asked for different units in it ({asked})")
        self.learned.append(merged.name)
        self._learned_now = True
        return merged

    def _choose(self, everyone: list[tuple[int, list[int], dict[int, int]]]) -> Optional[nn.Module]:
        """The leaf every rank takes, from every rank's ``_where`` (see [Note: learned leaves]); None: none.

        The innermost module that a rank's forward is inside, in its c-th call, where every rank has
        begun exactly c calls of it: each rank is in that call, or past it (it went on to the modules
        after it, or to backward, calling fewer units in it)."""
        if all(phase in _BACKWARD_PHASES for phase, _, _ in everyone):
            return None  # a divergence in backward only: its forward gave no module to make a leaf
        found = []  # (depth, number) of the modules that qualify
        for phase, stack, calls in everyone:
            if phase not in _FORWARD_PHASES:
                continue
            for depth, number in enumerate(stack):
                count = calls.get(number, 0)
                if all(theirs.get(number, 0) == count for _, _, theirs in everyone):
                    found.append((depth, number))
        for depth, number in sorted(set(found), reverse=True):  # the innermost first, the same on every rank
            leaf = self.modules[number]
            if self.sharder.units_inside(leaf):
                return leaf
        return None

    # ---- the end of a checking pass ----------------------------------------------------------------

    def end_pass(self, backward_ended: bool) -> None:
        """Compare what the ranks did in this pass (one all-reduce): the units they entered, in order, which
        may differ where their gathers did not (units of several experts, some of which ran on one rank
        only); where so, learn leaves now (``_learn_from_entries``). Stop checking once nothing changed for
        ``STABLE_PASSES`` passes."""
        digest = _digest(self._sequence + [(-1, -1)] + [(u, 0) for u in self.entries])
        changed = self._learned_now or self._previous.get(backward_ended) != digest
        self._previous[backward_ended] = digest
        words = torch.tensor([int(changed), int(self._learned_now), digest, -digest], dtype=torch.int64,
                             device=self.sharder.guard.device)
        self.sharder.comm.all_reduce(words, dist.ReduceOp.MAX,
                                     what=lambda: "all-reduce of what the ranks did in a stage-3 checking pass")
        changed, learned, high, low = words.tolist()
        if high != -low and not learned:  # the ranks entered different units, or in another order (not in a
            self._learn_from_entries()    # pass that learned a leaf: entries into it and its units differ then)
            changed = True
        self._stable = 0 if changed else self._stable + 1
        if self._stable >= STABLE_PASSES:
            self.stop()

    def _learn_from_entries(self) -> None:
        """The ranks' gathers agreed but the units they entered did not: each unit entered differently
        gets as its leaf the innermost module around it that every rank called as often (see [Note:
        learned leaves]); learned at the pass's end, where nothing is gathered, so nothing is held."""
        everyone = self.sharder.comm.all_gather_object((list(self.entries), dict(self._calls)))
        counts = [{u: entries.count(u) for u in set(entries)} for entries, _ in everyone]
        units = {u for c in counts for u in c}
        differ = {u for u in units if len({c.get(u, 0) for c in counts}) > 1}
        if not differ:  # the same units as often, in another order: from the first place they differ
            sequences = [entries for entries, _ in everyone]
            at = next(i for i in range(max(map(len, sequences)))
                      if len({tuple(s[i:i + 1]) for s in sequences}) > 1)
            differ = {s[at] for s in sequences if at < len(s)}
        def same_calls(module: nn.Module) -> bool:
            n = self.number[id(module)]
            return n in self._holders and len({calls.get(n, 0) for _, calls in everyone}) == 1

        leaves = []
        for index in sorted(differ):
            unit = self.sharder.unit_by_index(index)
            if unit is None or unit.index != index or not unit.modules:
                continue  # in a leaf learned in this pass already, or the root
            module = self.parent.get(id(unit.modules[0]))
            while module is not None and not same_calls(module):
                module = self.parent.get(id(module))
            if module is not None and module not in leaves:
                leaves.append(module)
        leaves.sort(key=lambda m: self.number[id(m)])  # the outer first: an inner one is inside it then
        for leaf in leaves:
            if self.sharder.units_inside(leaf):
                names = ", ".join(repr(self.sharder.guard.names[i]) for i in sorted(differ))
                merged = self.sharder.learn_leaf(leaf, f"the ranks entered the units {names} in it differently in "
                                                       f"pass {self.sharder.guard.passes}", hold=False)
                self.learned.append(merged.name)

    def stop(self) -> None:
        self.checking = False
        for module, handle in self._handles:
            detach_hook(module, handle)
        self._handles.clear()
        self._stack.clear()



def _digest(items: list[tuple[int, ...]]) -> int:
    """A positive int63 of ``items`` (the same on every rank for the same items: no salted hash)."""
    raw = array.array("q", (v for item in items for v in item)).tobytes()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1
