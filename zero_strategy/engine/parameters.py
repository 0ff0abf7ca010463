"""Stage 3: parameters live as shards; a unit is gathered just before it runs and released after.

[Note: units]
A *unit* is the set of parameters gathered with one all-gather per flat group: the parameters of
each module whose class the user names (``shard_modules=["Block"]``), or, without names, of each
module whose not yet claimed parameters reach ``min_unit_numel``. A parameter held by modules of
two units (tied embeddings) goes to the *root unit*, with every parameter no unit claims. Small
parameters (fewer than ``persist_numel`` elements) are *resident*: whole on every rank, as at
stage 2. Inside a unit, parameters split into flat groups by dtype, device and requires_grad, so
frozen weights are gathered but never reduced.

[Note: when units are gathered]
- forward: a unit's module gathers it in a pre-forward hook and releases it in a forward hook;
  with grad enabled, a hook on the module's outputs gathers it again when backward reaches them.
- backward: the unit is released once all its trainable parameters have handed over their
  gradients (the gradient reducer says so), or when backward ends.
- recomputation: a unit's forward run *during* backward (non-reentrant activation checkpointing
  recomputes a checkpointed module that contains units) gathers it but neither releases it nor
  counts as forward order: the unit's own backward comes next, and its gradients' hand-over
  releases it. Released there, its parameters would be empty when its gradients accumulate.
- root: gathered by the top module's pre-forward hook (and by ``hold_root`` around a training
  step) and kept until backward ends, since its parameters may be used anywhere in the step.
- prefetch: each unit remembers which unit ran after it (and before it) last time; entering a unit
  starts the next one's all-gather. A wrong guess only costs memory until that unit runs or the
  pass ends. Every rank must run the same units in the same order (as with any ZeRO-3), so the
  guesses, and the collectives they issue, agree across ranks.

[Note: init-time sharding]
A model built on the meta device (ZeroStrategy's ``model_sharded_context``, around Lightning's
``configure_model``) never exists whole: units are materialised one at a time, in unit order, by
the modules' own ``reset_parameters()``, broadcast from rank 0, sharded, and released before the
next unit is built. Every rank draws the same random numbers in the same order whatever the world
size, so the same seed gives the same model on 1 or 2 ranks.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .collectives import Collectives, Pending, wait_all
from .flat import FlatGroup


@dataclass(eq=False)
class Unit:
    name: str
    groups: list[FlatGroup]
    module: Optional[nn.Module]  # whose forward gathers it; None for the root unit
    pending: list[Pending] = field(default_factory=list)
    users: int = 0  # forwards in progress that need it
    held: bool = False  # kept gathered until backward ends (the root during a training step)

    @property
    def gathered(self) -> bool:
        return bool(self.groups) and self.groups[0].gathered


def _split(params: Sequence[nn.Parameter], owner_of: dict[nn.Parameter, int]) -> list[list[nn.Parameter]]:
    """Flat groups of a unit: by dtype, device, requires_grad, and which optimizer steps them (each
    optimizer's gradient reducer then hooks only its own parameters)."""
    runs: dict[tuple, list] = {}
    for p in params:
        runs.setdefault((p.dtype, p.device, p.requires_grad, owner_of.get(p, -1)), []).append(p)
    return list(runs.values())


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (recomputation runs forwards there)."""
    return torch._C._current_graph_task_id() != -1


def _matches(module: nn.Module, shard_modules: Sequence[Union[str, type]]) -> bool:
    return any(type(module).__name__ == s if isinstance(s, str) else isinstance(module, s) for s in shard_modules)


def plan_units(module: nn.Module, shard_modules: Sequence[Union[str, type]], min_unit_numel: int,
               persist_numel: int) -> tuple[list[tuple[str, nn.Module, list[nn.Parameter]]], list[nn.Parameter],
                                            list[nn.Parameter]]:
    """(name, module, parameters) per unit, the root unit's parameters, and the resident ones."""
    owners: dict[nn.Parameter, set[str]] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for p in mod.parameters(recurse=False):
            owners.setdefault(p, set()).add(mod_name)
    order = list(dict.fromkeys(p for p in module.parameters()))  # model order, each once

    roots: dict[str, nn.Module] = {}
    if shard_modules:
        roots = {n: m for n, m in module.named_modules() if n and _matches(m, shard_modules)}
    else:  # by size, from the leaves up: a module becomes a unit when it holds enough unclaimed elements
        claimed: set[nn.Parameter] = set()
        for n, m in reversed(list(module.named_modules())):
            if not n:
                continue
            mine = [p for p in dict.fromkeys(m.parameters()) if p not in claimed]
            if sum(p.numel() for p in mine) >= min_unit_numel:
                roots[n] = m
                claimed.update(mine)
        roots = {n: roots[n] for n, _ in module.named_modules() if n in roots}  # back to model order

    def unit_of(mod_name: str) -> Optional[str]:  # the innermost unit module enclosing mod_name
        best = None
        for r in roots:
            if (mod_name == r or mod_name.startswith(r + ".")) and (best is None or len(r) > len(best)):
                best = r
        return best

    resident = [p for p in order if p.numel() < persist_numel]
    members: dict[str, list[nn.Parameter]] = {r: [] for r in roots}
    root_params = []
    for p in order:
        if p.numel() < persist_numel:
            continue
        units = {unit_of(o) for o in owners[p]}
        (members[units.pop()] if len(units) == 1 and None not in units else root_params).append(p)
    units = [(r, roots[r], ps) for r, ps in members.items() if ps]
    return units, root_params, resident


def shard_module(module: nn.Module, config, comm: Optional[Collectives] = None,
                 device: Optional[torch.device] = None,
                 optimizers: Sequence[torch.optim.Optimizer] = ()) -> "ParameterSharder":
    """Shard ``module``'s parameters as ``config`` (a ZeroConfig with stage=3) says.

    Rank 0's values are broadcast unit by unit before sharding. Parameters on the meta device are
    materialised on ``device`` one unit at a time (see [Note: init-time sharding]). Pass the
    ``optimizers`` that will step the module when there are several, created before sharding.
    """
    owner_of = {p: i for i, opt in enumerate(optimizers) for g in opt.param_groups for p in g["params"]}
    return ParameterSharder(module, comm or Collectives(), config.shard_modules, config.unit_min_params,
                            config.param_persistence_threshold, config.prefetch, device, config.master_dtype,
                            owner_of, offload_optimizer=config.offload_optimizer,
                            offload_params=config.offload_params)


def _materialize(params: Sequence[nn.Parameter], owners: Sequence[nn.Module], device: torch.device) -> None:
    """Give meta parameters storage on ``device`` and their modules' own initialisation."""
    for m in owners:
        if not hasattr(m, "reset_parameters"):
            raise ValueError(
                f"{type(m).__name__} was built on the meta device (inside configure_model at stage 3) but has no "
                "reset_parameters() to initialise it; add one, or build this module in __init__ instead.")
        # not Module.to_empty: it replaces meta Parameters by new objects, and the sharder, the
        # optimizer and tied modules all hold these ones; swap_tensors keeps each object
        for p in m.parameters(recurse=False):
            if p.is_meta:
                torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device=device), p.requires_grad))
        for name, b in m.named_buffers(recurse=False):
            if b.is_meta:
                m._buffers[name] = torch.empty_like(b, device=device)
        m.reset_parameters()


class ParameterSharder:
    """Shards ``module``'s parameters over the ranks of ``comm`` and gathers them around their use.

    ``offload_params`` keeps every sharded group's shard in host memory (pinned on CUDA): a unit's
    gather copies it to the device just before the all-gather, and the full buffer is the only
    device copy, dropped on release. ``offload_optimizer`` puts the trainable groups' master
    shards in host memory (see [Note: offloaded groups] in flat.py).
    """

    def __init__(self, module: nn.Module, comm: Collectives, shard_modules: Sequence[Union[str, type]] = (),
                 min_unit_numel: int = 10_000_000, persist_numel: int = 100_000, prefetch: bool = True,
                 device: Optional[torch.device] = None, master_dtype: Optional[torch.dtype] = torch.float32,
                 optimizer_of: Optional[dict[nn.Parameter, int]] = None, offload_optimizer: bool = False,
                 offload_params: bool = False) -> None:
        self.module = module
        self.offload_optimizer = offload_optimizer  # trainable groups keep their master in host memory
        self.offload_params = offload_params  # sharded groups keep their shard in host memory
        self._optimizer_of = optimizer_of or {}
        self.comm = comm
        self.prefetch = prefetch
        self._device = device
        self._master_dtype = master_dtype
        self._owners: dict[nn.Parameter, list[nn.Module]] = {}
        for mod in module.modules():
            for p in mod.parameters(recurse=False):
                self._owners.setdefault(p, []).append(mod)
        planned, root_params, resident = plan_units(module, shard_modules, min_unit_numel, persist_numel)
        self.units = [Unit(name, self._flatten(params, resident=False), mod) for name, mod, params in planned]
        self.root = Unit("<root>", self._flatten(root_params, resident=False), None)
        self.resident = self._flatten(resident, resident=True)
        meta = [n for n, b in module.named_buffers() if b.is_meta]
        if meta:
            raise ValueError(f"buffers {meta[:5]} are still on the meta device after sharding: build modules that "
                             "hold buffers but no parameters in __init__, not in configure_model.")
        self._unit_of_group = {id(g): u for u in self.all_units for g in u.groups}
        self.unit_of = {p: u for u in self.all_units for g in u.groups for p in g.params}
        self.full_numel = {p: n for g in self.groups for p, n in zip(g.params, g.layout.numels)}
        self._next_of: dict[int, Unit] = {}  # unit id -> the unit that ran after it last time
        self._prev_of: dict[int, Unit] = {}
        self._last: Optional[Unit] = None
        self._reduced: set[int] = set()  # ids of groups whose gradients were handed over in this backward
        self._handles = []
        for unit in self.units:
            assert unit.module is not None
            self._handles.append(unit.module.register_forward_pre_hook(functools.partial(self._pre_forward, unit)))
            self._handles.append(unit.module.register_forward_hook(functools.partial(self._post_forward, unit)))
        self._handles.append(module.register_forward_pre_hook(functools.partial(self._pre_forward, self.root)))
        self._handles.append(module.register_forward_hook(functools.partial(self._post_forward, self.root)))
        for unit in self.all_units:
            for g in unit.groups:
                for p in g.params:
                    p._zero_sharder = self  # for gathered_parameters()

    def _flatten(self, params: list[nn.Parameter], resident: bool) -> list[FlatGroup]:
        """Flat groups of ``params``, materialised first if they are meta (one unit at a time)."""
        on_meta = [p for p in params if p.is_meta]
        if on_meta:
            owners = list(dict.fromkeys(m for p in on_meta for m in self._owners[p]))
            _materialize(on_meta, owners, self._device or torch.device("cpu"))
        n, r = self.comm.world_size, self.comm.rank
        return [FlatGroup(ps, n, r, resident=resident, broadcast_from=self.comm,
                          master_dtype=self._master_dtype if ps[0].requires_grad else None,
                          offload_master=self.offload_optimizer and ps[0].requires_grad,
                          offload_shard=self.offload_params and not resident)
                for ps in _split(params, self._optimizer_of)]

    @property
    def all_units(self) -> list[Unit]:
        return [*self.units, self.root]

    @property
    def groups(self) -> list[FlatGroup]:
        """Every flat group: sharded ones of the units, then the resident ones."""
        return [g for u in self.all_units for g in u.groups] + self.resident

    # ---- gather and release ----------------------------------------------------------------

    def gather(self, unit: Unit, wait: bool = True) -> None:
        for g in unit.groups:
            unit.pending += g.gather(self.comm)
        if wait:
            wait_all(unit.pending)

    def release(self, unit: Unit) -> None:
        if unit.gathered and unit.users == 0 and not unit.held:
            wait_all(unit.pending)
            for g in unit.groups:
                g.release()

    def hold_root(self) -> None:
        """Gather the root unit and keep it until backward ends (or ``release_root``)."""
        self.gather(self.root)
        self.root.held = True

    def release_root(self) -> None:
        self.root.held = False
        self.release(self.root)

    # ---- hooks -----------------------------------------------------------------------------

    def _pre_forward(self, unit: Unit, module: nn.Module, args) -> None:
        self.gather(unit)
        unit.users += 1
        if unit is not self.root and not _in_backward():  # see [Note: when units are gathered]
            if self._last is not None and self._last is not unit:
                self._next_of[id(self._last)] = unit
                self._prev_of[id(unit)] = self._last
            self._last = unit
            self._prefetch(self._next_of.get(id(unit)))

    def _post_forward(self, unit: Unit, module: nn.Module, args, output) -> None:
        unit.users -= 1
        if _in_backward():
            return  # a recomputation: see [Note: when units are gathered]
        if torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, functools.partial(self._pre_backward, unit), mode="any")
            if unit is self.root:
                unit.held = True  # see [Note: when units are gathered]
        if unit is self.root and unit.users == 0 and not torch.is_grad_enabled():
            self._last = None  # a pass ended: the next forward starts a new order
        self.release(unit)

    def _pre_backward(self, unit: Unit, grad) -> None:
        self.gather(unit)
        if unit is not self.root:
            self._prefetch(self._prev_of.get(id(unit)))

    def _prefetch(self, unit: Optional[Unit]) -> None:
        if self.prefetch and unit is not None and not unit.gathered:
            self.gather(unit, wait=False)

    # ---- called by the gradient reducer ----------------------------------------------------

    def gradients_handed_over(self, group: FlatGroup) -> None:
        """Backward has produced all of ``group``'s gradients: its unit goes once all its groups did."""
        self._reduced.add(id(group))
        unit = self._unit_of_group.get(id(group))
        if unit is not None and unit is not self.root:
            if all(id(g) in self._reduced for g in unit.groups if g.params[0].requires_grad):
                self.release(unit)

    def backward_finished(self) -> None:
        self._reduced.clear()
        self.root.held = False
        for unit in self.all_units:
            self.release(unit)
        self._last = None

    def held_tensors(self) -> list[torch.Tensor]:
        """Parameter storage held now: every shard, and the full buffers of gathered or resident groups."""
        return [t for g in self.groups for t in (g.shard, g.buffer) if t is not None]

    def host_tensors(self) -> list[torch.Tensor]:
        """The parameter storage in host memory: the shards of ``offload_params``."""
        return [g.shard for g in self.groups if g.offload_shard and g.shard is not None]

    # ---- whole state dicts, one unit at a time ---------------------------------------------

    def _names(self) -> tuple[dict[str, torch.Tensor], dict[nn.Parameter, list[str]]]:
        entries = self.module.state_dict(keep_vars=True)
        names: dict[nn.Parameter, list[str]] = {}
        for key, value in entries.items():
            if isinstance(value, nn.Parameter):
                names.setdefault(value, []).append(key)  # tied weights have several names
        return entries, names

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state dict with every parameter whole, as CPU copies. A collective."""
        entries, names = self._names()
        out: dict[str, torch.Tensor] = {}

        def copy_out(groups: list[FlatGroup]) -> None:
            for g in groups:
                for p in g.params:
                    for key in names.get(p, ()):
                        out[key] = p.detach().to("cpu", copy=True)

        for unit in self.all_units:
            self.gather(unit)
            copy_out(unit.groups)
            self.release(unit)
        copy_out(self.resident)
        for key, value in entries.items():
            if key not in out:  # buffers
                out[key] = value.detach().to("cpu", copy=True)
        return {key: out[key] for key in entries}

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load whole tensors into the shards (each rank keeps its slices). A collective."""
        entries, names = self._names()
        missing = [k for k in entries if k not in state_dict]
        unexpected = [k for k in state_dict if k not in entries]
        if strict and (missing or unexpected):
            raise KeyError(f"the checkpoint does not match the model: missing keys {missing[:10]}, unexpected keys "
                           f"{unexpected[:10]}; pass strict=False to load what matches.")

        def load(key: str, target: torch.Tensor) -> None:
            value = state_dict[key]
            if value.shape != target.shape:
                raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(value.shape)}, the model's has "
                                 f"{tuple(target.shape)}: the checkpoint is for a different model.")
            target.copy_(value)

        def load_params(group: FlatGroup) -> None:
            for p in group.params:
                key = next((k for k in names.get(p, ()) if k in state_dict), None)
                if key is not None:
                    load(key, p.data)

        with torch.no_grad():
            for unit in self.all_units:
                self.gather(unit)
                for g in unit.groups:
                    load_params(g)
                    g.save_own_slices()
                self.release(unit)
            for g in self.resident:
                load_params(g)
                g.master_from_weights()
            for key, value in entries.items():
                if not isinstance(value, nn.Parameter) and key in state_dict:
                    load(key, value)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


@contextlib.contextmanager
def gathered_parameters(params: Union[nn.Module, Iterable[nn.Parameter]],
                        modifier_rank: Optional[int] = None) -> Iterator[None]:
    """Full parameters inside the block, on every rank (a collective: every rank must enter it).

    With ``modifier_rank``, that rank's values when the block ends become everyone's (edits on
    other ranks are dropped); without it, edits are discarded. Works at any stage: parameters
    that are whole already (stages 1 and 2, resident ones) are only broadcast when modified.
    """
    params = list(params.parameters() if isinstance(params, nn.Module) else params)
    sharders = dict.fromkeys(s for s in (getattr(p, "_zero_sharder", None) for p in params) if s is not None)
    wanted = set(params)
    units = [(s, u) for s in sharders for u in s.all_units if any(p in wanted for g in u.groups for p in g.params)]
    held_before = [u.held for _, u in units]
    for s, u in units:
        s.gather(u)
        u.held = True  # forwards inside the block must not release it
    try:
        yield
    finally:
        if modifier_rank is not None:
            _adopt_values_of(modifier_rank, params, [u for _, u in units])
            for g in (g for sharder in sharders for g in sharder.resident if any(p in wanted for p in g.params)):
                g.master_from_weights()  # the broadcast values, into the fp32 masters too
        for (s, u), before in zip(units, held_before):
            u.held = before
            s.release(u)


def _adopt_values_of(rank: int, params: list[nn.Parameter], units: list[Unit]) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    with torch.no_grad():
        for u in units:
            for g in u.groups:
                assert g.buffer is not None
                dist.broadcast(g.buffer, src=rank)
                g.save_own_slices()
        in_units = {p for u in units for g in u.groups for p in g.params}
        for p in params:
            if p not in in_units:
                dist.broadcast(p.data, src=rank)
