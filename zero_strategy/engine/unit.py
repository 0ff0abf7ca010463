"""A stage-3 unit: flat groups gathered and released together, with a named state.

The unit owns its lifecycle (``gather``, ``wait``, ``release``, ``hold``); the sharder
(parameters.py) decides *when*, from the modules' hooks, and keeps the order and prefetch.

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
from typing import Callable, Optional

from torch import nn

from .collectives import Collectives, Pending, wait_all
from .flat import FlatGroup, ShardedGroup
from .quantize import QuantSpec


class UnitState(enum.Enum):
    """Where a unit's parameters are, and so what it holds in memory."""

    RELEASED = "released"
    """Only this rank's shards (1/N of the unit); the parameters are empty tensors."""
    GATHERING = "gathering"
    """All-gathers in flight into the full buffers (the whole unit is allocated); not readable yet."""
    GATHERED = "gathered"
    """The whole unit, in the full buffers its parameters are views of."""


class Unit:
    """The parameters gathered around its ``modules``' forward and backward (see [Note: units])."""

    def __init__(self, index: int, name: str, groups: list[FlatGroup], modules: tuple[nn.Module, ...]) -> None:
        self.index = index
        self.name = name
        self.groups = groups
        for g in self._sharded():
            g.unit_name = name
        self.modules = modules  # whose forwards gather it; () for the root unit
        self.state = UnitState.RELEASED
        self.users = 0  # forwards of its modules in progress
        self.holds = 0  # reasons to keep it gathered past its forward: see hold()
        self._pending: list[Pending] = []

    @property
    def has_frozen(self) -> bool:
        """Whether some of its parameters are frozen now (see [Note: when units are gathered])."""
        return any(not p.requires_grad for g in self.groups for p in g.params)

    @property
    def gathered(self) -> bool:
        """Whether the full buffers exist (all-gathers may still be in flight)."""
        return self.state is not UnitState.RELEASED

    @property
    def stale(self) -> bool:
        """Gathered, but a shard was written since: see [Note: one record of a unit's gather]."""
        return self.state is not UnitState.RELEASED and any(g.stale for g in self._sharded())

    @property
    def needs_gather(self) -> bool:
        return self.state is UnitState.RELEASED or self.stale

    def gather(self, comm: Collectives, what: Callable[[], str], quantize: Optional[QuantSpec] = None,
               keep_secondary: Optional[Collectives] = None) -> None:
        """Start the all-gathers of a released or stale unit (nothing otherwise); ``wait()`` before
        reading. ``quantize`` and ``keep_secondary``: see [Note: quantized gathers] and [Note:
        secondary partition] in flat.py."""
        if not self.needs_gather:
            return
        wait_all(self._pending)  # a stale unit's earlier gather: it writes the buffer until it completes
        for g in self._sharded():
            self._pending += g.gather(comm, what, quantize, keep_secondary)
        self.state = UnitState.GATHERING

    def gather_secondary(self, comm: Collectives, what: Callable[[], str]) -> None:
        """Like ``gather``, from the secondary parts kept by the forward gather, over their group."""
        if self.state is not UnitState.RELEASED:
            return
        for g in self._sharded():
            self._pending += g.gather_secondary(comm, what)
        self.state = UnitState.GATHERING

    @property
    def has_secondary(self) -> bool:
        """Whether every group kept its secondary part (see [Note: secondary partition] in flat.py)."""
        return bool(self.groups) and all(g.has_secondary for g in self._sharded())

    def drop_secondary(self) -> None:
        for g in self._sharded():
            g.drop_secondary()

    def _sharded(self) -> list[ShardedGroup]:
        assert all(isinstance(g, ShardedGroup) for g in self.groups), "a unit holds sharded groups only"
        return self.groups  # type: ignore[return-value]

    def wait(self) -> None:
        if self.state is UnitState.GATHERING:
            wait_all(self._pending)
            self.state = UnitState.GATHERED

    def release(self) -> bool:
        """Free the full buffers unless a forward is using the unit or something holds it; True if freed."""
        if self.state is UnitState.RELEASED or self.users or self.holds:
            return False
        wait_all(self._pending)  # a prefetch nobody used: its buffers are written until it completes
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
