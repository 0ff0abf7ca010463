"""A stage-3 unit: flat groups gathered and released together, with a named state.

The unit owns its lifecycle, as FSDP2's parameter groups do: what its modules' hooks do
(``pre_forward``, ``post_forward``, ``pre_backward``, and ``post_backward`` when the gradient
reducer has a group's gradients), with an explicit ``training_state``, and the gathers and
releases themselves (``gather``, ``wait``, ``release``, ``hold``). Its schedule, the sharder
(flat_parameters.py), keeps what spans units: their order and prefetch, the root unit, the order guard
and the passes (see [Note: when units are gathered] there).

[Note: one record of a unit's gather]
Whether a unit's parameters are whole is its ``state``; its groups' full buffers are allocated by
its ``gather`` and freed by its ``release`` only, so the two records cannot disagree. Code that
writes the shards of gathered groups (the optimizer's step, a checkpoint load) says so with
``ShardedGroup.shard_written``: the buffer is then *stale*, and the unit's next ``gather`` gathers
it again in place, over the same buffer its parameters already view. The step, a collective
point, has the sharder do that at once (``shards_written``), so a unit held across it
(``gathered_parameters``) holds the stepped weights; a checkpoint load is no collective, so a unit
held across one shows the loaded weights from its next gather on (the next forward, or the end of
a ``gathered_parameters`` block with a modifier). (Freeing a group's buffer behind its unit's back
left the unit GATHERED over empty parameters.)
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..buffers.flat import FlatGroup, ShardedGroup
from ..comm.collectives import Collectives, Pending, wait_all
from ..comm.order_guard import BACKWARD, RECOMPUTE
from ..comm.quantize import QuantSpec
from ..diagnose.breakdown import GATHER, in_backward
from ..diagnose.header import Header
from ..diagnose.ranges import span


class UnitState(enum.Enum):
    """Where a unit's parameters are, and so what it holds in memory."""

    RELEASED = "released"
    """Only this rank's shards (1/N of the unit); the parameters are empty tensors."""
    GATHERING = "gathering"
    """All-gathers in flight into the full buffers (the whole unit is allocated); not readable yet."""
    GATHERED = "gathered"
    """The whole unit, in the full buffers its parameters are views of."""


class TrainingState(enum.Enum):
    """Where a unit is in the training step (its memory is ``UnitState``'s)."""

    IDLE = "idle"
    """Outside its modules' forward and its backward."""
    FORWARD = "forward"
    """A forward of its modules is running."""
    PRE_BACKWARD = "pre_backward"
    """Backward reached its outputs and gathered it for its gradients."""
    POST_BACKWARD = "post_backward"
    """The gradient reducer has all its trainable gradients of this backward."""


class Unit:
    """The parameters gathered around its ``modules``' forward and backward (see [Note: units]);
    ``schedule`` is the sharder that orders the units (set once it has built them)."""

    def __init__(self, index: int, name: str, groups: list[FlatGroup], modules: tuple[nn.Module, ...]) -> None:
        self.index = index
        self.name = name
        self.groups = groups
        for g in self._sharded():
            g.unit_name = name
        self.modules = modules  # whose forwards gather it; () for the root unit
        self.schedule: Any = None
        self.state = UnitState.RELEASED
        self.training_state = TrainingState.IDLE
        self.users = 0  # forwards of its modules in progress
        self.holds = 0  # reasons to keep it gathered past its forward: see hold()
        self._pending: list[Pending] = []
        self._entered: list[nn.Module] = []  # modules whose pre-hook completed and post-hook has not run
        self._handed_over: set[int] = set()  # ids of its groups whose gradients the reducer has, this backward
        self.replaced_by: Optional["Unit"] = None  # the unit of a leaf learned around it (engine/params/leaves.py)

    @property
    def is_root(self) -> bool:
        return not self.modules

    # ---- the hooks' part: see [Note: when units are gathered] in engine/params/flat_parameters.py -------------

    def enter(self, module: nn.Module) -> None:
        """A module's forward began and its pre-hook completed."""
        self.users += 1
        self._entered.append(module)

    def leave(self, module: nn.Module) -> bool:
        """A module's forward ended (its post-hook runs even when it raised: always_call): whether
        its pre-hook had completed, so that there is something to undo."""
        if not self._entered or self._entered[-1] is not module:
            return False  # its pre-hook raised (a failed gather, the order guard)
        self._entered.pop()
        self.users -= 1
        return True

    def pre_forward(self, module: nn.Module, args: Any) -> None:
        if in_backward():  # a recomputation
            self.schedule.gather(self, RECOMPUTE)
        else:
            self.schedule.entering(self)
            self.training_state = TrainingState.FORWARD
        if self.replaced_by is not None:  # a leaf learned around it, held gathered: see [Note: learned leaves]
            return
        self.schedule.saved_weights.push()  # see [Note: saved weights] in engine/params/saved_weights.py
        self.enter(module)

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self.leave(module):
            return
        self.schedule.saved_weights.pop()
        if in_backward():
            return  # a recomputation: its gradients' hand-over releases it
        if not self.users:
            self.training_state = TrainingState.IDLE
        if torch.is_grad_enabled():
            self.hook_backward(output)
        if module is self.modules[-1]:
            self.release()

    def hook_backward(self, output: Any) -> None:
        """Gather again when backward reaches ``output`` (see ``pre_backward``)."""
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self.pre_backward, mode="any")

    def pre_backward(self, grad: Any) -> None:
        if self.replaced_by is not None:  # a hook of this pass's forward: the leaf's unit serves it
            self.replaced_by.pre_backward(grad)
            return
        self.schedule.gather(self, BACKWARD)
        self.training_state = TrainingState.PRE_BACKWARD
        self.schedule.backward_reached(self)

    def post_backward(self, group: FlatGroup) -> None:
        """Backward has produced all of ``group``'s gradients: the unit goes once all its groups did
        (not the root, nor a unit with frozen weights: see [Note: when units are gathered])."""
        self._handed_over.add(id(group))
        if all(id(g) in self._handed_over for g in self.groups):
            self.training_state = TrainingState.POST_BACKWARD
            if not self.is_root and not self.has_frozen:
                self.release()
                self.drop_secondary()  # backward is done with it

    def backward_ended(self) -> None:
        self._handed_over.clear()

    def end_pass(self) -> None:
        """The pass (forward and backward) is over: nothing of it stays gathered."""
        self.release()
        self.drop_secondary()
        self.training_state = TrainingState.IDLE

    @property
    def has_frozen(self) -> bool:
        """Whether some of its parameters are frozen now (see [Note: when units are gathered])."""
        return any(not p.requires_grad for g in self.groups for p in g.params)

    @property
    def has_full_buffers(self) -> bool:
        """Whether the full buffers exist: gathered, or still gathering (all-gathers in flight)."""
        return self.state is not UnitState.RELEASED

    @property
    def stale(self) -> bool:
        """Gathered, but a shard was written since: see [Note: one record of a unit's gather]."""
        return self.state is not UnitState.RELEASED and any(g.stale for g in self._sharded())

    @property
    def needs_gather(self) -> bool:
        return self.state is UnitState.RELEASED or self.stale

    def gather(self, comm: Collectives, what: Callable[[], str], quantize: Optional[QuantSpec] = None,
               keep_secondary: Optional[Collectives] = None, header: Optional[Header] = None) -> None:
        """Start the all-gathers of a released or stale unit (nothing otherwise); ``wait()`` before
        reading. ``quantize`` and ``keep_secondary``: see [Note: quantized gathers] and [Note:
        secondary partition] in engine/buffers/flat.py; ``header``: see [Note: the collective header]."""
        if not self.needs_gather:
            return
        wait_all(self._pending, GATHER)  # a stale unit's earlier gather: it writes the buffer until it completes
        with span(lambda: f"zero/gather {self.name}"):  # see [Note: profiler ranges]
            for g in self._sharded():
                self._pending += g.gather(comm, what, quantize, keep_secondary, header)
        self.state = UnitState.GATHERING

    def gather_secondary(self, comm: Collectives, what: Callable[[], str], header: Optional[Header] = None) -> None:
        """Like ``gather``, from the secondary parts kept by the forward gather, over their group."""
        if self.state is not UnitState.RELEASED:
            return
        with span(lambda: f"zero/gather {self.name} from its secondary partition"):
            for g in self._sharded():
                self._pending += g.gather_secondary(comm, what, header)
        self.state = UnitState.GATHERING

    @property
    def has_secondary(self) -> bool:
        """Whether every group kept its secondary part (see [Note: secondary partition] in engine/buffers/flat.py)."""
        return bool(self.groups) and all(g.has_secondary for g in self._sharded())

    def drop_secondary(self) -> None:
        for g in self._sharded():
            g.drop_secondary()

    def _sharded(self) -> list[ShardedGroup]:
        assert all(isinstance(g, ShardedGroup) for g in self.groups), "a unit holds sharded groups only"
        return self.groups  # type: ignore[return-value]

    def wait(self) -> None:
        if self.state is UnitState.GATHERING:
            with span(lambda: f"zero/wait gather {self.name}"):
                wait_all(self._pending, GATHER)  # the step's gathers (engine/diagnose/breakdown.py)
            self.state = UnitState.GATHERED

    def release(self) -> bool:
        """Free the full buffers unless a forward is using the unit or something holds it; True if freed."""
        if self.state is UnitState.RELEASED or self.users or self.holds:
            return False
        wait_all(self._pending, GATHER)  # a prefetch nobody used: its buffers are written until it completes
        for g in self.groups:
            g.release()
        self.state = UnitState.RELEASED
        return True

    def hold(self) -> None:
        """Keep the unit gathered until a matching ``unhold`` (the root for a training step,
        ``gathered_parameters`` for its block); holds nest."""
        self.holds += 1

    def unhold(self) -> None:
        assert self.holds > 0, f"unit {self.name!r} is not held"
        self.holds -= 1
        self.release()
