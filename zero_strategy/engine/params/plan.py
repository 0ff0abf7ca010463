"""Stage 3: which parameters are gathered together (units) and which stay whole. No process group.

[Note: units]
A *unit* is the set of parameters gathered with one all-gather per flat group around the forward
(and backward) of its modules. Its modules are the modules of a class the user names
(``shard_modules=["Block"]``: each instance is a unit), or, without names, the ones the size walk
below picks. A parameter held by modules of two units (tied embeddings) goes to the *root unit*,
with every parameter no unit claims; the root is gathered for the whole step. Small parameters
(fewer than ``persist_numel`` elements) are *resident*: whole on every rank, as at stage 2.

[Note: default units]
Without ``shard_modules``, units are cut from the module tree by size, top down: the children of a
module are taken in order, and consecutive children whose shardable parameters fit in the *target*
together form one unit; a child bigger than the target is split the same way among its own
children, and a leaf bigger than the target is a unit alone. The target is one bucket
(``bucket_cap_mb`` in elements of the parameters' dtype: big enough that an all-gather is
efficient, the size DDP reduces at once) and at most an eighth of the model's shardable elements,
so the largest unit is a small part of the model whatever its shape; ``unit_params`` sets it
instead. Containers that are never called (``ModuleList``, ``ModuleDict``) are walked through and
never become units: their forward hooks would never run, so nothing would gather them. Parameters a
module holds directly while its children are split (a positional table beside the blocks, say)
fall to the root unit.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from torch import nn

log = logging.getLogger(__name__)

ModuleTarget = Union[str, type]

MAX_UNIT_FRACTION = 8
"""A default unit holds at most 1/8 of the model's shardable elements (see [Note: default units])."""


def module_matches(module: nn.Module, targets: Sequence[ModuleTarget]) -> bool:
    """Whether ``module``'s class is named in ``targets`` (a class name matches the class's exact
    ``__name__``; a class matches its subclasses too)."""
    return any(type(module).__name__ == t if isinstance(t, str) else isinstance(module, t) for t in targets)


def target_name(target: ModuleTarget) -> str:
    return target if isinstance(target, str) else target.__name__


def is_called(module: nn.Module) -> bool:
    """False for containers without a forward of their own (ModuleList, ModuleDict, ...)."""
    return type(module).forward is not nn.Module.forward


@dataclass(frozen=True)
class PlannedUnit:
    name: str
    modules: tuple[nn.Module, ...]  # whose forwards gather it
    params: tuple[nn.Parameter, ...]


@dataclass(frozen=True)
class UnitPlan:
    units: tuple[PlannedUnit, ...]
    root: tuple[nn.Parameter, ...]  # gathered for the whole step
    resident: tuple[nn.Parameter, ...]  # whole on every rank, never gathered
    target: Optional[int]  # the size target of the default walk (None: shard_modules chose)


def plan_units(module: nn.Module, shard_modules: Sequence[ModuleTarget] = (), persist_numel: int = 100_000,
               bucket_numel: int = 6_553_600, unit_params: Optional[int] = None) -> UnitPlan:
    """Units of ``module`` (see [Note: units] and [Note: default units]).

    ``shard_modules`` names the unit classes; when it matches no module, or names a container that
    is never called, this raises, listing the classes the model has. ``bucket_numel`` and
    ``unit_params`` shape the default walk.
    """
    order = list(dict.fromkeys(module.parameters()))  # model order, each parameter once
    resident = tuple(p for p in order if p.numel() < persist_numel)
    shardable = {p for p in order if p.numel() >= persist_numel}
    target = None
    if shard_modules:
        groups = _named_units(module, shard_modules)
    else:
        total = sum(p.numel() for p in shardable)
        target = unit_params if unit_params is not None else min(bucket_numel, -(-total // MAX_UNIT_FRACTION))
        groups = _walk(module, "", max(1, target), shardable)

    unit_of_module: dict[nn.Module, int] = {}
    for index, members in enumerate(groups):  # outer units come first: an inner (nested) one overrides
        for _, member in members:
            for sub in member.modules():
                unit_of_module[sub] = index
    owners: dict[nn.Parameter, set[int]] = {}  # parameter -> units whose modules hold it (-1: none)
    for mod in module.modules():
        for p in mod.parameters(recurse=False):
            if p in shardable:
                owners.setdefault(p, set()).add(unit_of_module.get(mod, -1))
    members_of: dict[int, list[nn.Parameter]] = {i: [] for i in range(len(groups))}
    root = []
    for p in order:
        if p not in shardable:
            continue
        units = owners[p]
        if len(units) == 1 and -1 not in units:
            members_of[next(iter(units))].append(p)
        else:  # tied across units, or held outside every unit
            root.append(p)
    units = tuple(PlannedUnit(_unit_name(members), tuple(m for _, m in members), tuple(members_of[i]))
                  for i, members in enumerate(groups) if members_of[i])
    return UnitPlan(units, tuple(root), resident, target)


def _named_units(module: nn.Module, shard_modules: Sequence[ModuleTarget]) -> list[list[tuple[str, nn.Module]]]:
    """Each module of a named class is a unit; inner matches are units of their own (innermost wins)."""
    named = [(n, m) for n, m in module.named_modules() if n and module_matches(m, shard_modules)]
    matched = {target_name(t) for t in shard_modules if any(module_matches(m, (t,)) for _, m in named)}
    if not matched:
        classes = Counter(type(m).__name__ for _, m in module.named_modules() if any(True for _ in m.parameters()))
        listed = ", ".join(f"{c} ({n})" for c, n in classes.most_common())
        raise ValueError(
            f"shard_modules={[target_name(t) for t in shard_modules]} matches no module of {type(module).__name__}, so "
            f"stage 3 would shard no parameter by module. The model's classes that hold parameters (with counts) are: "
            f"{listed}. Name the class of its repeated blocks (e.g. the transformer layer), or leave shard_modules "
            "empty to let stage 3 choose units by size.")
    unmatched = [target_name(t) for t in shard_modules if target_name(t) not in matched]
    if unmatched:
        log.info("shard_modules: %s matched, %s not in this model", sorted(matched), unmatched)
    for name, m in named:
        if not is_called(m):
            raise ValueError(
                f"shard_modules matched {name!r}, a {type(m).__name__}, which is a container that is never called (it "
                "has no forward of its own), so nothing would gather its parameters. Name the class of its elements "
                "instead.")
    return [[(n, m)] for n, m in named]


def _size(module: nn.Module, shardable: set[nn.Parameter]) -> int:
    return sum(p.numel() for p in dict.fromkeys(module.parameters()) if p in shardable)


def _walk(module: nn.Module, prefix: str, target: int, shardable: set[nn.Parameter]) -> list[list[tuple[str, nn.Module]]]:
    """Units among ``module``'s children (see [Note: default units])."""
    units: list[list[tuple[str, nn.Module]]] = []
    run: list[tuple[str, nn.Module]] = []
    used = 0
    for child_name, child in module.named_children():
        name = f"{prefix}{child_name}"
        size = _size(child, shardable)
        if size == 0:
            continue
        splittable = any(_size(c, shardable) for c in child.children())
        if not is_called(child) or (size > target and splittable):
            if run:
                units.append(run)
            run, used = [], 0
            units += _walk(child, name + ".", target, shardable)
            continue
        if run and used + size > target:
            units.append(run)
            run, used = [], 0
        run.append((name, child))
        used += size
    if run:
        units.append(run)
    return units


def _unit_name(members: list[tuple[str, nn.Module]]) -> str:
    if len(members) == 1:
        return members[0][0]
    return f"{members[0][0]}..{members[-1][0]}"
