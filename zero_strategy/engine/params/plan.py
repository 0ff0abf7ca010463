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
fall to the root unit. A *leaf* is never split (see [Note: leaf modules]).

[Note: leaf modules]
A leaf is a module whose whole subtree is one unit, gathered at its pre-forward: what the modules
inside it call, how often and in which order, may then depend on the data and differ between ranks,
since nothing inside it gathers. Every rank must gather the same units in the same order (see
[Note: order guard] in engine/comm/order_guard.py), and a mixture-of-experts layer whose forward
runs each expert only on the tokens routed to it calls different experts on different ranks; so
its experts must not be units of their own. The default walk treats a leaf as any child that is
not split: a unit alone when bigger than the target, else grouped with its siblings; its
parameters belong to that unit (tied ones still go to the root). Leaves come from:
- ``leaf_modules`` (class names, or classes and their subclasses) and the modules flagged
  ``_z3_leaf = True`` (DeepSpeed's ``set_z3_leaf_modules``, in zero_strategy/utils/z3_leaf_module.py).
  With ``shard_modules`` too, a named module inside a leaf is no unit of its own and a leaf outside
  every named module is a unit;
- routed experts, recognised without any option (default walk only): a called module holding a
  ModuleList or ModuleDict of at least two called modules of one class (the experts), and, in its
  subtree outside that container, a parameter with a dimension equal to their number (the router:
  Mixtral's, Qwen-MoE's or Switch's ``gate``/``router`` Linear, DeepSeek's ``MoEGate`` weight). A
  candidate holding more than half of the model's shardable elements is not taken (a model whose
  classifier has as many classes as it has layers looks the same, and one unit for the whole model
  would gather it all): the learned leaves below cover that case. GPT-2's and BERT's plans do not
  change (tests/test_unit_plan.py);
- learned at run time, for what no rule sees (adaptive depth, a branch taken on some ranks, experts
  without a router): see [Note: learned leaves] in engine/params/leaves.py.
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
    leaves: tuple[tuple[str, str], ...] = ()  # (module name, why it is a leaf): see [Note: leaf modules]


def is_flagged_leaf(module: nn.Module) -> bool:
    """Whether ``module`` carries DeepSpeed's leaf flag (``set_z3_leaf_modules``)."""
    return getattr(module, "_z3_leaf", False) is True


def routed_experts(module: nn.Module) -> Optional[str]:
    """Why ``module`` looks like a layer of routed experts (see [Note: leaf modules]), or None."""
    if not is_called(module):
        return None
    for name, child in module.named_children():
        if not isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            continue
        experts = list(child.children())
        if len(experts) < 2 or len({type(e) for e in experts}) != 1 or not is_called(experts[0]):
            continue
        if not any(True for e in experts for _ in e.parameters()):
            continue
        inside = {id(p) for p in child.parameters()}
        for p_name, p in module.named_parameters():
            if id(p) not in inside and len(experts) in p.shape:
                return (f"{len(experts)} {type(experts[0]).__name__} in {name!r} beside the router weight "
                        f"{p_name!r} {tuple(p.shape)}")
    return None


def plan_units(module: nn.Module, shard_modules: Sequence[ModuleTarget] = (), persist_numel: int = 100_000,
               bucket_numel: int = 6_553_600, unit_params: Optional[int] = None,
               leaf_modules: Sequence[ModuleTarget] = ()) -> UnitPlan:
    """Units of ``module`` (see [Note: units], [Note: default units] and [Note: leaf modules]).

    ``shard_modules`` names the unit classes, ``leaf_modules`` the classes never split; a name of
    either that matches a container that is never called raises, and so does ``shard_modules``
    matching no module (``leaf_modules`` then logs a warning), listing the classes the model has.
    ``bucket_numel`` and ``unit_params`` shape the default walk.
    """
    order = list(dict.fromkeys(module.parameters()))  # model order, each parameter once
    resident = tuple(p for p in order if p.numel() < persist_numel)
    shardable = {p for p in order if p.numel() >= persist_numel}
    total = sum(p.numel() for p in shardable)
    leaves = _leaves(module, leaf_modules, shardable, total, routed=not shard_modules)
    target = None
    if module in leaves:  # the whole model is one leaf: every parameter in the root unit
        groups: list[list[tuple[str, nn.Module]]] = []
    elif shard_modules:
        groups = _named_units(module, shard_modules, leaves)
    else:
        target = unit_params if unit_params is not None else min(bucket_numel, -(-total // MAX_UNIT_FRACTION))
        groups = _walk(module, "", max(1, target), shardable, leaves)

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
    names = {m: n or "(the model)" for n, m in module.named_modules()}
    return UnitPlan(units, tuple(root), resident, target, tuple((names[m], why) for m, why in leaves.items()))


def _matching(module: nn.Module, targets: Sequence[ModuleTarget], option: str) -> list[tuple[str, nn.Module]]:
    """The modules of ``module`` of a class ``targets`` names (``option``'s), checked: an error when one is
    a container that is never called or (shard_modules) when none matches, a log line for the names that
    match nothing."""
    named = [(n, m) for n, m in module.named_modules() if n and module_matches(m, targets)]
    matched = {target_name(t) for t in targets if any(module_matches(m, (t,)) for _, m in named)}
    if not matched:
        classes = Counter(type(m).__name__ for _, m in module.named_modules() if any(True for _ in m.parameters()))
        listed = ", ".join(f"{c} ({n})" for c, n in classes.most_common())
        if option == "leaf_modules":  # a safety net that may name classes of other models (DeepSpeed's list)
            log.warning("leaf_modules=%s matches no module of %s: no module is a leaf by name. Its classes that hold "
                        "parameters (with counts) are: %s.", [target_name(t) for t in targets],
                        type(module).__name__, listed)
            return []
        raise ValueError(
            f"shard_modules={[target_name(t) for t in targets]} matches no module of {type(module).__name__}, so "
            f"stage 3 would shard no parameter by module. The model's classes that hold parameters (with counts) are: "
            f"{listed}. Name the class of its repeated blocks (e.g. the transformer layer), or leave shard_modules "
            "empty to let stage 3 choose units by size.")
    unmatched = [target_name(t) for t in targets if target_name(t) not in matched]
    if unmatched:
        log.info("%s: %s matched, %s not in this model", option, sorted(matched), unmatched)
    for name, m in named:
        if not is_called(m):
            raise ValueError(
                f"{option} matched {name!r}, a {type(m).__name__}, which is a container that is never called (it "
                "has no forward of its own), so nothing would gather its parameters. Name the class of its elements "
                "instead.")
    return named


def _leaves(module: nn.Module, leaf_modules: Sequence[ModuleTarget], shardable: set[nn.Parameter], total: int,
            routed: bool) -> dict[nn.Module, str]:
    """The outermost leaf modules, in model order, with why each is one (see [Note: leaf modules])."""
    if module_matches(module, leaf_modules) or is_flagged_leaf(module):
        return {module: f"the model itself ({type(module).__name__}) is a leaf"}
    named = dict(_matching(module, leaf_modules, "leaf_modules")) if leaf_modules else {}
    found: dict[nn.Module, str] = {}
    inside: set[int] = set()  # ids of the modules within a leaf found so far
    for name, m in module.named_modules():
        if id(m) in inside or not name:
            continue
        why = None
        if name in named:
            why = f"leaf_modules names {type(m).__name__}"
        elif is_flagged_leaf(m):
            if not is_called(m):
                raise ValueError(f"{name!r}, a {type(m).__name__}, is flagged as a leaf (set_z3_leaf_modules) but is "
                                 "a container that is never called, so nothing would gather its parameters. Flag "
                                 "the class of its elements instead.")
            why = "flagged by set_z3_leaf_modules"
        elif routed:
            why = routed_experts(m)
            if why is not None and 2 * _size(m, shardable) > total:
                log.info("stage 3: %r (%s) looks like routed experts (%s) but holds over half the model: not "
                         "made a leaf", name, type(m).__name__, why)
                why = None
        if why is not None:
            found[m] = why
            inside.update(id(sub) for sub in m.modules())
    return found


def _named_units(module: nn.Module, shard_modules: Sequence[ModuleTarget],
                 leaves: dict[nn.Module, str]) -> list[list[tuple[str, nn.Module]]]:
    """Each module of a named class is a unit; inner matches are units of their own (innermost wins);
    a leaf absorbs the named modules inside it and is a unit where no named module holds it."""
    named = _matching(module, shard_modules, "shard_modules")
    within_leaf = {id(sub) for leaf in leaves for sub in leaf.modules() if sub is not leaf}
    units = {id(m) for n, m in named if id(m) not in within_leaf}
    within_named = {id(sub) for n, m in named if id(m) in units for sub in m.modules()}
    units |= {id(leaf) for leaf in leaves if id(leaf) not in within_named}
    return [[(n, m)] for n, m in module.named_modules() if id(m) in units]


def _size(module: nn.Module, shardable: set[nn.Parameter]) -> int:
    return sum(p.numel() for p in dict.fromkeys(module.parameters()) if p in shardable)


def _walk(module: nn.Module, prefix: str, target: int, shardable: set[nn.Parameter],
          leaves: dict[nn.Module, str]) -> list[list[tuple[str, nn.Module]]]:
    """Units among ``module``'s children (see [Note: default units] and [Note: leaf modules])."""
    units: list[list[tuple[str, nn.Module]]] = []
    run: list[tuple[str, nn.Module]] = []
    used = 0
    for child_name, child in module.named_children():
        name = f"{prefix}{child_name}"
        size = _size(child, shardable)
        if size == 0:
            continue
        splittable = child not in leaves and any(_size(c, shardable) for c in child.children())
        if not is_called(child) or (size > target and splittable):
            if run:
                units.append(run)
            run, used = [], 0
            units += _walk(child, name + ".", target, shardable, leaves)
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
