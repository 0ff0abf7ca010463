"""Stage 3: parameters live as shards; a unit is gathered just before it runs and released after.

Which parameters form which unit is planned in plan.py (see [Note: units] and
[Note: default units]); a unit's lifecycle, its modules' hooks included, is in unit.py. This file
keeps what spans units: the order the model runs them in, prefetch, the root unit, the passes and
the order guard, and the flat groups themselves (see [Note: one owner of the flat groups]).

[Note: when units are gathered]
- forward: a unit's module gathers it in a pre-forward hook. The unit is released after the forward
  of its last module, or when another unit starts (a unit of several modules called out of order),
  or when the pass ends. With grad enabled, a hook on the module's outputs gathers it again when
  backward reaches them.
- backward: the unit is released once all its trainable parameters have handed over their
  gradients (the gradient reducer says so), or when backward ends. A unit with frozen parameters
  (a frozen base weight beside trainable adapters) is not: backward may still need a frozen weight
  for the gradient of the unit's input after the trainable gradients are in. It is released when
  backward reaches the unit that ran before it in forward (the gradient of that unit's outputs,
  this unit's inputs, is complete by then) unless that unit contains it (their outputs may be the
  same tensors), or when backward ends.
- recomputation: a unit's forward run *during* backward (non-reentrant activation checkpointing
  recomputes a checkpointed module that contains units) gathers it but neither releases it nor
  counts as forward order: the unit's own backward comes next, and its gradients' hand-over
  releases it. Released there, its parameters would be empty when its gradients accumulate.
- root: gathered by the top module's pre-forward hook (and by ``hold_root`` around a training
  step) and held until backward ends, since its parameters may be used anywhere in the step.
- prefetch: each unit remembers which unit ran after it (and before it) last time; entering a unit
  starts the next one's all-gather. A wrong guess only costs memory until that unit runs or the
  pass ends. Every rank must run the same units in the same order (as with any ZeRO-3), so the
  guesses, and the collectives they issue, agree across ranks; the order guard checks it (see
  [Note: order guard] in engine/comm/order_guard.py).

[Note: reductions beside gathers]
Ranks pair their collectives on a process group in the order they issue them, so the gradient
reductions that backward launches and the gathers it issues must interleave alike on every rank.
The reductions' own order never depends on the data ([Note: launch order] in
engine/grads/reducer.py), but *when* a segment is launched does: once all its gradients are in. A
leaf (see [Note: leaf modules] in plan.py) runs some of its modules on some ranks only (an expert
no token of this rank chose), so a segment of its unit is complete mid-backward on one rank and
only when backward ends on another, while both gather the units before it in between: one rank's
reduce-scatter meets another's all-gather. So wherever leaves may be (the plan has some, or the
default plan may learn some: engine/params/leaves.py), the reductions go over a process group of
their own with the same ranks (``Collectives.twin``; with hybrid sharding, twins of the shard
groups), and each group keeps one order: the gathers', the same on every rank, and the reductions'.
Plans named with ``shard_modules`` and no leaf keep one group. One more process group per process
(NCCL makes its communicator on first use).

[Note: gathers outside passes]
``gathered_parameters`` and the full state dicts gather units outside any pass, and every rank must
enter them together. A rank that enters alone (``if rank == 0: model.state_dict()``) issues
all-gathers that meet the others' training gathers: of the same size, the headers tell (see
[Note: order guard]); of another size, gloo ends both processes with its own message ("Received data
size doesn't match expected size"), before any check of ours can run. So on gloo each such entry
begins with a barrier, a collective of another kind than anything a pass issues, which ranks in step
all pass. A rank that entered alone waits in it while the others wait in their gathers, and after
``unit_order_wait`` both stop with the UnitOrderError of [Note: collectives that differ] in
engine/diagnose/divergence.py, naming the entry and the gather. It costs one barrier per entry, none per pass. NCCL
waits are not watched, so there it is skipped.

[Note: compiled modules]
The unit hooks are plain Python (unit states, collectives, the order guard) that dynamo cannot
trace, so they are ``torch._dynamo.disable``d: under ``torch.compile`` each one is a graph break,
run eagerly, at every unit's gather (pre-forward, and the pre-backward hook) and release
(post-forward); the modules' own forwards between them are compiled (a transformer block's forward
is one graph, reused for every block). Tracing a hook instead would bake a released parameter's
empty shape into the graph. Each break starts a new frame for dynamo, so a model whose blocks go
through a shared Python wrapper (transformers' deprecation decorator on GPT-2's forwards) recompiles
that wrapper per call site and hits ``torch._dynamo.config.recompile_limit`` (8): past it, the rest
runs eagerly. benchmarks/compile_breaks.py counts the ops a forward runs compiled: GPT-2 small at
stage 3, 344 of 565 at the default limit, 560 with the limit at 64 (raise it for deep models).

[Note: one owner of the flat groups]
FlatParameters (the sharder) builds every flat group of a model, at every stage (all resident at stages 1 and
2); a ZeroOptimizer only maps the pieces of the groups holding its parameters (``groups_of``) to its
param groups, and checkpoints, memory accounting and gathered_parameters read the same groups, finding
their owner from a parameter or a module with ``owner_of`` / ``owners_of``. A plain loop's
ZeroOptimizer without a sharder builds one over its own parameters (stages 1-2).

See [Note: init-time sharding] in engine/params/materialize.py for a model built on the meta device.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from typing import Iterable, Iterator, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from ...config import ZeroConfig
from ..buffers.flat import FlatGroup, ResidentGroup, ShardedGroup
from ..buffers.malloc import set_mmap_threshold
from ..buffers.pool import BufferPool
from ..comm.collectives import Collectives
from ..comm.order_guard import (BACKWARD, FORWARD, LEARNED, OUTSIDE, PHASES, PREFETCH_BACKWARD, PREFETCH_FORWARD,
                                RECOMPUTE, OrderGuard)
from ..comm.topology import hybrid_groups
from ..diagnose.watchdog import out_of_step
from .attached import attach_check, attach_hook, detach_check, detach_hook
from .edits import seal
from .leaves import LeafLearner
from .materialize import is_deferred, materialize_meta
from .plan import UnitPlan, is_called, plan_units
from .saved_weights import SavedWeights
from .unit import Unit, UnitState, in_backward
from .whole_state import load_full_state_dict, take_over_loading


log = logging.getLogger(__name__)

_OWNERS: "WeakIdKeyDictionary" = WeakIdKeyDictionary()
"""Each parameter's FlatParameters, weakly (see ``owner_of``): kept here, not on the parameter, which
then pickles and copies as the user's (see [Note: a module's copies hold what the user sees])."""


def split_groups(params: Sequence[nn.Parameter], owner_of: dict[nn.Parameter, int],
                 reduce_dtype_of: Optional[dict[nn.Parameter, torch.dtype]] = None) -> list[list[nn.Parameter]]:
    """Flat groups of a unit: by dtype, device, requires_grad, which optimizer steps them (each
    optimizer's gradient reducer then hooks only its own parameters), and the dtype their gradients are
    reduced in (see [Note: low-precision reductions] in engine/grads/reducer.py)."""
    runs: dict[tuple, list] = {}
    reduce_dtype_of = reduce_dtype_of or {}
    for p in params:
        runs.setdefault((p.dtype, p.device, p.requires_grad, owner_of.get(p, -1), reduce_dtype_of.get(p)),
                        []).append(p)
    return list(runs.values())


def low_precision_params(owners: dict[nn.Parameter, list[nn.Module]], config: ZeroConfig) -> dict[nn.Parameter,
                                                                                                 torch.dtype]:
    """The parameters whose gradients are reduced in ``config.low_precision_reduce_dtype``: those wider than
    it owned by a module of exactly a class of ``low_precision_reduce_modules`` (as DeepSpeed matches its
    lower_precision_safe_modules: ``module.__class__ in classes``)."""
    targets, dtype = config.low_precision_reduce_modules, config.low_precision_reduce_dtype
    if not targets:
        return {}
    if dtype is None:
        raise ValueError(f"low_precision_reduce_modules={list(targets)!r} without low_precision_reduce_dtype: give the "
                         "dtype to reduce their gradients in (torch.bfloat16 or torch.float16), or no modules.")

    def exact(module: nn.Module) -> bool:
        return any(type(module).__name__ == t if isinstance(t, str) else type(module) is t for t in targets)

    return {p: dtype for p, modules in owners.items()
            if p.requires_grad and p.dtype.itemsize > dtype.itemsize and any(exact(m) for m in modules)}


def _eager(hook):
    """``hook`` run by Python even inside ``torch.compile``: see [Note: compiled modules]."""
    return torch._dynamo.disable(hook, recursive=True)


def shard_module(module: nn.Module, config: ZeroConfig, comm: Optional[Collectives] = None,
                 device: Optional[torch.device] = None,
                 optimizers: Sequence[torch.optim.Optimizer] = ()) -> "FlatParameters":
    """Shard ``module``'s parameters as ``config`` (a ZeroConfig with stage=3) says.

    Rank 0's values are broadcast unit by unit before sharding. Parameters on the meta device are
    materialised on ``device`` one unit at a time (see [Note: init-time sharding]). Pass the
    ``optimizers`` that will step the module when there are several, created before sharding.
    """
    return FlatParameters(module, config, comm or Collectives(collective_timeout=config.collective_timeout),
                            device, optimizers)


class FlatParameters:
    """A model's parameters as flat groups, and the one owner of those groups, at every stage (see
    [Note: one owner of the flat groups]); "the sharder" in the code, though it shards only at stage 3.

    At stages 1 and 2 every trainable parameter goes into a resident group, whole on every rank,
    cut into bucket-sized segments; frozen ones stay as they are. At stage 3 the parameters are
    sharded into units, gathered around their modules' use (see [Note: units]); ``module`` must
    then be a module, while at stages 1 and 2 it may be a list of parameters (a plain loop's
    optimizer's). ``optimizers`` (built before, when there are several) split the groups so each
    optimizer steps and reduces its own.

    ``config.offload_params`` keeps every sharded group's shard in host memory (pinned on CUDA): a
    unit's gather copies it to the device just before the all-gather, and the full buffer is the only
    device copy, dropped on release. ``config.offload_optimizer`` puts the trainable groups' master
    shards in host memory (see [Note: offloaded groups] in engine/buffers/flat.py).
    """

    def __init__(self, module: Union[nn.Module, Iterable[nn.Parameter]], config: ZeroConfig, comm: Collectives,
                 device: Optional[torch.device] = None, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        self.module = module if isinstance(module, nn.Module) else None
        if self.module is not None:  # a plain loop's model built on meta: see [Note: changes before setup] in
            seal(self.module)        # engine/params/edits.py
        self.config = config
        self.world_comm = comm  # every rank; self.comm is the shard group: see [Note: hybrid sharding] in
                                # engine/comm/topology.py
        # see [Note: collectives that differ] in engine/diagnose/divergence.py (subgroups made from now on take it too)
        comm.mismatch_wait_s = config.unit_order_wait if config.check_unit_order else math.inf
        self.hybrid = hybrid_groups(comm, config.shard_group_size)
        self.comm = comm = self.hybrid.shard if self.hybrid is not None else comm
        self._device = device
        self._optimizer_of = {p: i for i, opt in enumerate(optimizers) for g in opt.param_groups for p in g["params"]}
        params = list(dict.fromkeys(module.parameters() if self.module is not None else module))
        self.position = {p: i for i, p in enumerate(params)}  # the model's order: see [Note: launch order]
        if not any(p.requires_grad for p in params):
            what = type(module).__name__ if self.module is not None else "the optimizer's parameter list"
            raise ValueError(f"{what} has no trainable parameter (every requires_grad is False), so there is nothing "
                             "to train; unfreeze some parameters (requires_grad_(True)).")
        if (device or params[0].device).type == "cpu":  # before sharding frees the whole parameters
            set_mmap_threshold(config.cpu_mmap_threshold_mb)  # see [Note: glibc's mmap threshold] in
                                                              # engine/buffers/malloc.py
        self.pool = BufferPool()  # the full buffers of gathered units: see [Note: reused buffers] in
                                  # engine/buffers/pool.py
        self.saved_weights = SavedWeights(self.pool)  # see [Note: saved weights] in engine/params/saved_weights.py
        self._owners: dict[nn.Parameter, list[nn.Module]] = {}
        for mod in (self.module.modules() if self.module is not None else ()):
            for p in mod.parameters(recurse=False):
                self._owners.setdefault(p, []).append(mod)
        if config.low_precision_reduce_modules and self.module is None:
            raise ValueError(f"low_precision_reduce_modules={list(config.low_precision_reduce_modules)!r} names module "
                             "classes: build the flat groups over the module (shard_module(model, config)), not a list "
                             "of parameters.")
        self._reduce_dtype_of = low_precision_params(self._owners, config)  # see [Note: low-precision reductions]
        if config.stage == 3:
            if self.module is None:
                raise ValueError("ZeRO stage 3 gathers parameters around their modules' forward: give shard_module "
                                 "the module, not a list of parameters.")
            self.plan: UnitPlan = plan_units(self.module, config.shard_modules, config.param_persistence_threshold,
                                             config.bucket_numel(params[0].element_size()), config.unit_params,
                                             leaf_modules=config.leaf_modules)
            self._agree_on_plan()
        else:  # stages 1-2: the trainable parameters, whole on every rank
            self.plan = UnitPlan((), (), tuple(p for p in params if p.requires_grad), None)
        self.units = [Unit(i, u.name, self._flatten(list(u.params), resident=False), u.modules)
                      for i, u in enumerate(self.plan.units)]
        self.root = Unit(len(self.units), "<root>", self._flatten(list(self.plan.root), resident=False), ())
        self.resident = self._flatten(list(self.plan.resident), resident=True)
        meta = [n for n, b in self.module.named_buffers() if b.is_meta] if self.module is not None else []
        if meta:
            raise ValueError(f"buffers {meta[:5]} are still on the meta device after sharding: build modules that "
                             "hold buffers but no parameters in __init__, not in configure_model.")
        self._groups = [g for u in self.all_units for g in u.groups] + self.resident  # the order stays: see learn_leaf
        self._every_unit = list(self.all_units)  # the units merged into learned leaves too
        self._unit_of_group = {id(g): u for u in self.all_units for g in u.groups}
        self.unit_of = {p: u for u in self.all_units for g in u.groups for p in g.params}
        self.full_numel = {p: n for g in self.groups for p, n in zip(g.params, g.layout.numels)}
        guard_device = self._device or (self.groups[0].device if self.groups else torch.device("cpu"))
        comm.breakdown.enable(config.step_breakdown, guard_device)  # see [Note: the step breakdown]
        self.guard = OrderGuard(comm, [u.name for u in self.all_units], guard_device, config.unit_order_wait)
        self.guard.enabled &= config.check_unit_order and config.stage == 3
        self.guard.advise = self._leaf_advice
        self._next_of: dict[Unit, Unit] = {}  # the unit that ran after it last time
        self._prev_of: dict[Unit, Unit] = {}
        self._last: Optional[Unit] = None  # the unit entered last in this forward pass
        self._nesting: dict[tuple[int, int], bool] = {}  # see _nested
        self._root_held_for_step = False
        self._in_pass = False  # between _begin_pass and _end_pass
        self._backward_ended = False  # in this pass: a step follows, which checks the gathers
                                      # (engine/comm/order_guard.py)
        for unit in self.all_units:
            unit.schedule = self
        self.weight_quantization = config.weight_quantization  # see [Note: quantized gathers] in engine/buffers/flat.py
        size = config.secondary_partition_size if config.stage == 3 else None  # see [Note: secondary partition]
        self.secondary = comm.within_node(size, "secondary_partition_size") if size is not None else None
        if config.gradient_quantization is not None:
            comm.hierarchy  # its process groups, now, at the same point on every rank
        self._handles: list[tuple[nn.Module, RemovableHandle]] = []  # attached: see engine/params/attached.py
        self._unit_handles: dict[int, list[tuple[nn.Module, RemovableHandle]]] = {}  # unit index -> its hooks
        self._checked: list[nn.Module] = []  # modules a copy of which must find their parameters whole
        if config.stage == 3:
            assert self.module is not None
            for unit in self.units:
                self._hook_unit(unit)
            root = self.module
            self._hook(root, root.register_forward_pre_hook(_eager(self._pre_forward_root)))
            self._hook(root, root.register_forward_hook(_eager(self._post_forward_root), always_call=True))
            self._checked = list(dict.fromkeys(m for p in self.unit_of for m in self._owners.get(p, ())))
            for mod in self._checked:
                attach_check(mod, self, self._check_whole)
        if self.module is not None and config.step_breakdown:  # its forward: the step's forward phase (see
            # [Note: the step breakdown] in engine/diagnose/breakdown.py)
            for handle in comm.breakdown.watch(self.module):
                self._hook(self.module, handle)
        for g in self.groups:
            for p in g.params:
                # read by owner_of(), at every stage (nothing on the parameter: it pickles as it is); a weak
                # reference, since a value holding its key strongly (self holds p) would keep both for ever
                _OWNERS[p] = weakref.ref(self)
        if self.module is not None:  # module.load_state_dict of whole tensors: see
            # [Note: loading a full state dict] in engine/params/whole_state.py
            for module, handle in take_over_loading(self.module, self.groups):
                self._hook(module, handle)
        # leaves learned in the first passes: see [Note: learned leaves] in engine/params/leaves.py
        self.learner = LeafLearner(self) if (config.stage == 3 and not config.shard_modules and self.units
                                             and self.guard.enabled) else None
        self._held_for_pass: list[Unit] = []  # merged units held until the pass ends (see learn_leaf)
        self.reduce_comm = comm  # the gradient reductions' group: see [Note: reductions beside gathers]
        if config.stage == 3 and comm.world_size > 1 and (self.plan.leaves or self.learner is not None):
            self.reduce_comm = (self.world_comm.split(self.hybrid.mesh.shard_groups(), "gradient reductions")
                                if self.hybrid is not None else comm.twin("gradient reductions"))
        if config.stage == 3 and self.plan.leaves and comm.rank == 0:
            log.info("stage 3: leaves (each one unit with its whole subtree): %s",
                     "; ".join(f"{name!r}: {why}" for name, why in self.plan.leaves))
        comm.begin_step()  # the first step's bytes start here: set-up broadcasts are not a step's

    def comm_stats(self, times: bool = False) -> dict[str, float]:
        """Bytes this rank sent in its last training step (see [Note: bytes sent] in engine/comm/volume.py):
        all_gather, reduce_scatter, all_reduce, broadcast, total, intra_node, inter_node; ``times``: and the
        seconds waited for them (see ``Collectives.comm_stats``)."""
        return self.comm.comm_stats(times)

    def groups_of(self, optimizer: torch.optim.Optimizer) -> list[FlatGroup]:
        """The trainable flat groups holding ``optimizer``'s parameters (which it steps and reduces)."""
        mine = {p for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
        groups = [g for g in self.groups if g.params[0].requires_grad and any(p in mine for p in g.params)]
        held = {p for g in groups for p in g.params}
        missing = [tuple(p.shape) for p in mine if p not in held]
        if missing:
            raise ValueError(f"{len(missing)} optimizer parameters (shapes {missing[:3]}...) are not parameters the "
                             "sharder holds: optimize only the sharded module's own parameters, and build the "
                             "optimizer before shard_module(module, config, optimizers=[...]).")
        others = [p for g in groups for p in g.params if p not in mine]
        if others:
            raise ValueError(f"{len(others)} parameters share flat groups with this optimizer's but belong to another: "
                             "pass every optimizer to shard_module(module, config, optimizers=[...]) so that each "
                             "gets groups of its own.")
        return groups

    def _agree_on_plan(self) -> None:
        """Every rank must cut the same units, or their all-gathers would not pair up; and build the same
        ones on the meta device, since a unit built there is filled from its recorded sources while a
        real one is broadcast from rank 0 (the collectives would pair up wrongly, filling the shards
        with another unit's bytes)."""
        def fingerprint(name: str, params: Sequence[nn.Parameter]) -> tuple[str, int, int, int]:
            return (name, sum(p.numel() for p in params), sum(p.is_meta for p in params),
                    sum(p.is_meta and is_deferred(p) for p in params))

        mine = [fingerprint(u.name, u.params) for u in self.plan.units]
        mine += [fingerprint("(the root)", self.plan.root), fingerprint("(whole on every rank)", self.plan.resident)]
        plans = self.comm.all_gather_object(mine)
        for rank, theirs in enumerate(plans):
            if [u[:2] for u in theirs] != [u[:2] for u in mine]:
                diff = next(((a[:2], b[:2]) for a, b in zip(mine, theirs) if a[:2] != b[:2]), (len(mine), len(theirs)))
                raise ValueError(
                    f"ZeRO stage 3: rank {rank} planned other units than rank {self.comm.rank} (first difference: "
                    f"{diff[1]} there, {diff[0]} here): the ranks built different models. Build the same model on "
                    "every rank (same code, config and dtype).")
            if theirs != mine:
                here, there = next((a, b) for a, b in zip(mine, theirs) if a != b)
                raise ValueError(
                    f"ZeRO stage 3: unit {here[0]!r} has {there[2]} parameters on the meta device ({there[3]} with "
                    f"values to come from a file or a recorded construction) on rank {rank} and {here[2]} ({here[3]}) "
                    f"on rank {self.comm.rank}: the ranks built the model in different ways (one inside the "
                    "strategy's init context, configure_model or sharded_init, the other outside it, or loaded "
                    "eagerly). Build it the same way on every rank.")

    def _flatten(self, params: list[nn.Parameter], resident: bool) -> list[FlatGroup]:
        """Flat groups of ``params``, materialised first if they are meta (one unit at a time)."""
        materialize_meta(params, self._owners, self._device or torch.device("cpu"))
        n, r, config = self.comm.world_size, self.comm.rank, self.config
        groups: list[FlatGroup] = []
        for ps in split_groups(params, self._optimizer_of, self._reduce_dtype_of):
            trainable = ps[0].requires_grad
            # stage 3 builds units from rank 0's values (and materialises meta ones); stages 1-2 take the
            # parameters as they are (equal on every rank, as for DDP). A group whose every parameter gets
            # its values later (a file or a recorded construction: fill_deferred) needs no broadcast; the
            # ranks agree on which those are (_agree_on_plan)
            from_rank0 = config.stage == 3 and not all(is_deferred(p) for p in ps)
            common = dict(broadcast_from=self.world_comm if from_rank0 else None,
                          master_dtype=config.master_dtype if trainable else None,
                          offload_master=config.offload_optimizer and trainable,
                          block_align=config.layout_block if trainable else 1)
            bucket = config.bucket_numel(ps[0].element_size())
            if resident and config.stage == 3:  # small parameters: one segment
                groups.append(ResidentGroup(ps, n, r, **common))
            elif resident:
                groups.append(ResidentGroup(ps, n, r, bucket_numel=bucket, **common))
            else:  # cut into buckets too, so a big unit (the root) is reduced in pieces
                groups.append(ShardedGroup(ps, n, r, bucket_numel=bucket, offload_shard=config.offload_params,
                                           pool=self.pool, **common))
            if trainable:
                groups[-1].reduce_quantization = config.gradient_quantization
                groups[-1].reduce_dtype = self._reduce_dtype_of.get(ps[0])
        return groups

    @property
    def all_units(self) -> list[Unit]:
        return [*self.units, self.root]

    @property
    def groups(self) -> list[FlatGroup]:
        """Every flat group: sharded ones of the units (in the plan's order, whatever leaves were learned
        since), then the resident ones."""
        return self._groups

    def _hook_unit(self, unit: Unit) -> None:
        """The forward hooks of ``unit``'s modules (see [Note: when units are gathered])."""
        handles = self._unit_handles.setdefault(unit.index, [])
        for mod in unit.modules:
            for handle in (mod.register_forward_pre_hook(_eager(unit.pre_forward)),
                           mod.register_forward_hook(_eager(unit.post_forward),
                                                     always_call=True)):  # pops the saved-tensor hooks
                self._hook(mod, handle)
                handles.append((mod, handle))

    # ---- learned leaves: see [Note: learned leaves] in engine/params/leaves.py ----------------

    def _leaf_advice(self, indices: Sequence[int]) -> str:
        """For the guard's message: the module inside which units ``indices`` lie, to name in leaf_modules."""
        units = [u for u in self.all_units if u.index in set(indices) and u.modules]
        if not units or self.module is None:
            return ""
        inside = None  # the modules holding every unit's modules, outermost first
        for u in units:
            for m in u.modules:
                holders = [h for h in self.module.modules() if is_called(h) and any(s is m for s in h.modules())]
                inside = holders if inside is None else [h for h in inside if any(h is k for k in holders)]
        leaf = inside[-1] if inside else self.module
        name = next(n for n, m in self.module.named_modules() if m is leaf) or "the model itself"
        return (f" Here that is {name!r}: leaf_modules=[{type(leaf).__name__!r}] makes each {type(leaf).__name__} "
                "one unit, its whole subtree gathered at its forward.")

    def units_inside(self, module: nn.Module) -> list[Unit]:
        """The units whose modules all lie inside ``module`` (not the root unit)."""
        within = {id(m) for m in module.modules()}
        return [u for u in self.units if all(id(m) in within for m in u.modules) and u.modules != (module,)]

    def unit_by_index(self, index: int) -> Optional[Unit]:
        """The unit of that index now (a unit merged into a leaf since: the leaf's), None for none."""
        unit = next((u for u in self._every_unit if u.index == index), None)
        while unit is not None and unit.replaced_by is not None:
            unit = unit.replaced_by
        return unit

    def learn_leaf(self, leaf: nn.Module, why: str, hold: bool = True) -> Unit:
        """Make ``leaf`` and its class-mates leaves, each one merged unit over the flat groups of the
        units inside it; returns ``leaf``'s, gathered next (see [Note: learned leaves]). ``hold``: each
        is held from its first gather to the pass's end (a leaf learned inside a pass)."""
        names = {m: n for n, m in self.module.named_modules()}
        mates = [leaf] if leaf is self.module else [
            m for m in self.module.modules() if type(m) is type(leaf) and self.units_inside(m)]
        merged_of_leaf = None
        made = []
        for mate in mates:
            members = self.units_inside(mate)
            if not members:
                continue
            merged = self._merge(mate, names[mate] or "(the model)", members)
            made.append((merged, len(members)))
            if hold:  # until the pass ends, on every rank alike: see [Note: learned leaves] in engine/params/leaves.py
                merged.hold()
                self._held_for_pass.append(merged)
            if mate is leaf:
                merged_of_leaf = merged
        assert merged_of_leaf is not None
        if self.comm.rank == 0:
            log.warning("ZeRO stage 3: %s (%s) is a leaf from now on (%s); %s. Each is one unit with its whole "
                        "subtree, gathered at its forward. To plan it so from the start, pass leaf_modules=[%r].",
                        merged_of_leaf.name, type(leaf).__name__, why,
                        "so are its class-mates " + ", ".join(repr(m.name) for m, _ in made if m is not merged_of_leaf)
                        if len(made) > 1 else "it has no class-mate", type(leaf).__name__)
        return merged_of_leaf

    def _merge(self, module: nn.Module, name: str, members: list[Unit]) -> Unit:
        """One unit over ``members``' flat groups, with ``module``'s hooks, in their place."""
        for u in members:
            if not u.release() and u.state is not UnitState.RELEASED:
                raise out_of_step(
                    f"ZeRO stage 3: the ranks part inside {name!r} ({type(module).__name__}), where unit {u.name!r} is "
                    f"in use ({u.users} forwards running, {u.holds} holds: a leaf learned in this pass, or "
                    "gathered_parameters), so no leaf can be learned there now. Name the class in "
                    f"leaf_modules=[{type(module).__name__!r}] (or the class inside it whose calls differ between "
                    "ranks) to plan it as a leaf from the start.", self.comm.scope)
        merged = Unit(len(self.guard.names), name, [g for u in members for g in u.groups], (module,))
        merged.schedule = self
        self._every_unit.append(merged)
        self.guard.names.append(name)
        gone = {id(u) for u in members}
        for u in members:
            u.replaced_by = merged
            for mod, handle in self._unit_handles.pop(u.index, []):
                detach_hook(mod, handle)
                self._handles.remove((mod, handle))
        first = next(i for i, u in enumerate(self.units) if id(u) in gone)
        self.units = [u for u in self.units[:first] if id(u) not in gone] + [merged] + [
            u for u in self.units[first:] if id(u) not in gone]
        self._hook_unit(merged)
        for g in merged.groups:
            self._unit_of_group[id(g)] = merged
            for p in g.params:
                self.unit_of[p] = merged

        def current(u: Optional[Unit]) -> Optional[Unit]:
            return merged if u is not None and id(u) in gone else u

        self._next_of = {current(a): current(b) for a, b in self._next_of.items() if current(a) is not current(b)}
        self._prev_of = {current(a): current(b) for a, b in self._prev_of.items() if current(a) is not current(b)}
        self._last = current(self._last)
        self._nesting.clear()
        return merged

    # ---- gather and release ----------------------------------------------------------------

    def gather(self, unit: Unit, phase: int = OUTSIDE, wait: bool = True, context: Optional[Unit] = None) -> Unit:
        """Gather ``unit``, its all-gathers carrying the order guard's tag (see [Note: order guard]);
        ``context`` is the unit whose hook asks, for the guard's message. Returns the unit gathered:
        another where the ranks asked for different units and a leaf was learned (see [Note: learned
        leaves] in engine/params/leaves.py).

        [Note: which gather]
        Outside forward and backward (state dicts, gathered_parameters) a gather is exact, over all
        ranks. In forward it is quantized with ``quantized_weights``, and with a secondary partition
        it keeps this rank's secondary part when a backward will follow (grad enabled; not for the
        root, held through backward anyway). In backward (and recomputation in it) a unit that kept
        its secondary parts is gathered from them, within its secondary group; any other the way
        forward gathers it (and without keeping anything).
        """
        while context is not None and context.replaced_by is not None:  # a unit in a leaf learned since
            context = context.replaced_by
        if unit.needs_gather and phase != OUTSIDE and self.learner is not None and self.learner.checking:
            merged = self.learner.announce(unit, phase, context)
            if merged is not unit:  # a leaf learned: every rank gathers it, alike, whatever each asked for
                self.gather(merged, LEARNED, True)
                while unit.replaced_by is not None:  # in the leaf, or in a class-mate of it
                    unit = unit.replaced_by
                if unit is merged or phase in (PREFETCH_FORWARD, PREFETCH_BACKWARD):
                    return merged
                return self.gather(unit, phase, wait, context)  # past the leaf: what it asked for, again
        if unit.needs_gather:
            header = self.guard.header(unit.index, phase, context.index if context is not None else -1)
            backward = phase in (BACKWARD, PREFETCH_BACKWARD, RECOMPUTE)
            if backward and self.secondary is not None and unit.has_secondary:
                unit.gather_secondary(self.secondary, lambda: f"all-gather of stage-3 unit {unit.name!r} from its "
                                      f"secondary partition ({PHASES[phase]}, pass {self.guard.passes})", header)
            else:
                keep = self.secondary if (phase in (FORWARD, PREFETCH_FORWARD) and unit is not self.root
                                          and torch.is_grad_enabled() and not unit.has_secondary) else None
                unit.gather(self.comm, lambda: f"all-gather of stage-3 unit {unit.name!r} ({PHASES[phase]}, "
                                               f"pass {self.guard.passes})",
                            None if phase == OUTSIDE else self.weight_quantization, keep, header)
        if wait:
            unit.wait()
        return unit

    def shards_written(self, groups: Iterable[FlatGroup]) -> None:
        """``groups``' shards were written by a step (a collective point): their gathered copies are
        stale, and the units holding them gather again now, exactly (see [Note: one record of a unit's gather] in
        engine/params/unit.py)."""
        written = {id(g) for g in groups}
        for g in self.groups:
            if id(g) in written:
                g.shard_written()
        for unit in self.all_units:
            if unit.stale:
                self.gather(unit)

    def hold_root(self) -> None:
        """Gather the root unit and keep it until backward ends (or ``release_root``): a training,
        validation, test or predict step begins."""
        self._begin_pass()
        if not self._root_held_for_step:
            self.root.hold()
            self._root_held_for_step = True
        self.gather(self.root, FORWARD)

    def release_root(self) -> None:
        if self._root_held_for_step:
            self._root_held_for_step = False
            self.root.unhold()
        if self.root.users == 0:
            self._end_pass()

    # ---- the hooks: the root's here, the units' in unit.py -----------------------------------

    def _pre_forward_root(self, module: nn.Module, args) -> None:
        if self.root.users == 0 and not in_backward():
            self._begin_pass()
        self.gather(self.root, RECOMPUTE if in_backward() else FORWARD)
        self.root.enter(module)

    def _post_forward_root(self, module: nn.Module, args, output) -> None:
        if not self.root.leave(module) or in_backward() or self.root.users:
            return
        if torch.is_grad_enabled():
            self.root.hook_backward(output)
            if not self._root_held_for_step:  # see [Note: when units are gathered]
                self.root.hold()
                self._root_held_for_step = True
        else:  # an evaluation pass ended: nothing stays gathered for a backward
            self._end_pass()

    def entering(self, unit: Unit) -> None:
        """A forward of ``unit`` begins (not a recomputation): the order, its gather and the next one's."""
        previous = self._last
        if previous is not None and previous is not unit:
            self._next_of[previous] = unit
            self._prev_of[unit] = previous
            previous.release()  # done with, unless a forward of its own is still running (nesting)
        self._last = unit
        if self.learner is not None and self.learner.checking:
            self.learner.entries.append(unit.index)
        gathered = self.gather(unit, FORWARD, context=previous)
        if gathered is not unit:  # a leaf was learned: see [Note: learned leaves] in engine/params/leaves.py
            self._last = gathered
            return
        self._prefetch(self._next_of.get(unit), PREFETCH_FORWARD, unit)

    def backward_reached(self, unit: Unit) -> None:
        """Backward gathered ``unit``: the unit after it in forward may go (frozen parameters: see [Note:
        when units are gathered]), and the one before it is prefetched."""
        if unit is self.root:
            return
        after = self._next_of.get(unit)
        if after is not None and after.has_frozen and not self._nested(after, unit) and after.release():
            after.drop_secondary()
        self._prefetch(self._prev_of.get(unit), PREFETCH_BACKWARD, unit)

    def _nested(self, inner: Unit, outer: Unit) -> bool:
        """Whether one of ``inner``'s modules lies inside one of ``outer``'s (whose outputs may then
        be ``inner``'s own, their gradient reaching both units at once)."""
        key = (inner.index, outer.index)
        if key not in self._nesting:
            within = {id(m) for top in outer.modules for m in top.modules()}
            self._nesting[key] = any(id(m) in within for m in inner.modules)
        return self._nesting[key]

    def _prefetch(self, unit: Optional[Unit], phase: int, context: Unit) -> None:
        if self.config.prefetch and unit is not None and unit.state is UnitState.RELEASED:
            self.gather(unit, phase, wait=False, context=context)

    def _begin_pass(self) -> None:
        """A forward pass (and its backward) begins: the root's forward, or a step around it."""
        if not self._in_pass:
            self._in_pass = True
            self._backward_ended = False
            self.guard.begin_pass()
            self.pool.begin_pass()
            if self.learner is not None and self.learner.checking:
                self.learner.begin_pass()

    def _end_pass(self) -> None:
        self._in_pass = False
        self._last = None
        while self._held_for_pass:  # see learn_leaf
            self._held_for_pass.pop().unhold()
        for unit in self.all_units:
            unit.end_pass()
        self.pool.end_pass()
        self.guard.end_pass(step_follows=self._backward_ended)
        if self.learner is not None and self.learner.checking:
            self.learner.end_pass(self._backward_ended)

    # ---- called by the gradient reducer ----------------------------------------------------

    def gradients_handed_over(self, group: FlatGroup) -> None:
        """Backward has produced all of ``group``'s gradients: its unit's post-backward."""
        unit = self._unit_of_group.get(id(group))
        if unit is not None:
            unit.post_backward(group)

    def backward_finished(self) -> None:
        for unit in self.all_units:
            unit.backward_ended()
        self._backward_ended = True  # a step follows: see [Note: headers left out on gloo]
        self.release_root()  # ends the pass

    def held_tensors(self) -> list[torch.Tensor]:
        """Parameter storage held now: every shard, and the full buffers of gathered or resident groups."""
        return [t for g in self.groups for t in g.held_tensors()]

    def workspace_tensors(self) -> list[torch.Tensor]:
        """Full buffers kept free for the next gathers (see [Note: reused buffers] in engine/buffers/pool.py)."""
        return self.pool.free_buffers()

    def host_tensors(self) -> list[torch.Tensor]:
        """The parameter storage in host memory: the shards of ``offload_params``."""
        return [g.shard for g in self.groups if isinstance(g, ShardedGroup) and g.offload_shard]

    # ---- whole state dicts, one unit at a time ---------------------------------------------

    def _names(self) -> tuple[dict[str, torch.Tensor], dict[nn.Parameter, list[str]]]:
        entries = self.module.state_dict(keep_vars=True)
        names: dict[nn.Parameter, list[str]] = {}
        for key, value in entries.items():
            if isinstance(value, nn.Parameter):
                names.setdefault(value, []).append(key)  # tied weights have several names
        return entries, names

    def meet_outside(self, what: str) -> None:
        """Every rank enters ``what`` (gathered_parameters, a state dict) together, or stops with
        UnitOrderError: see [Note: gathers outside passes]."""
        if self.config.stage == 3 and self.comm.watchdog.watched and self.comm.world_size > 1:
            self.comm.barrier(lambda: f"barrier that begins {what} (every rank must enter it)")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state dict with every parameter whole, as CPU copies. A collective."""
        self.meet_outside("a full state dict")
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
            unit.release()
        copy_out(self.resident)
        for key, value in entries.items():
            if key not in out:  # buffers
                out[key] = value.detach().to("cpu", copy=True)
        return {key: out[key] for key in entries}

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load whole tensors into the shards (each rank keeps its slices; no collective): see [Note:
        loading a full state dict] in engine/params/whole_state.py."""
        load_full_state_dict(self.module, self.groups, state_dict, strict)

    def _hook(self, module: nn.Module, handle: RemovableHandle) -> None:
        self._handles.append((module, attach_hook(module, handle)))

    def _check_whole(self, module: nn.Module) -> None:
        """A copy of ``module`` holds its parameters as they are now: never released shards (see [Note: a
        module's copies hold what the user sees] in engine/params/attached.py)."""
        released = [n for n, p in module.named_parameters(recurse=False)
                    if p in self.unit_of and p.numel() != self.full_numel[p]]
        if released:
            raise RuntimeError(
                f"copying a {type(module).__name__} (pickle, copy.deepcopy, or saving an object that holds it) at "
                f"ZeRO stage 3 outside its forward: its parameters {released[:3]} are this rank's shards, empty, and "
                "the copy would be a module of empty tensors. Copy it inside `with zero_strategy."
                "gathered_parameters(module):`, entered on every rank (a collective), where its parameters are "
                "whole (checkpoints do that for the modules their state holds).")

    def remove_hooks(self) -> None:
        if self.learner is not None:
            self.learner.stop()
        for module, handle in self._handles:
            detach_hook(module, handle)
        self._handles.clear()
        if self.module is not None:
            self.comm.breakdown.unwatch(self.module)
        for module in self._checked:
            detach_check(module, self)
        self._checked = []




def owner_of(param_or_module: Union[nn.Parameter, nn.Module]) -> Optional[FlatParameters]:
    """The FlatParameters whose flat groups hold a parameter, or the one holding a module's parameters
    (None when none holds them; an error when several do): the one lookup of a parameter's owner."""
    if isinstance(param_or_module, nn.Module):
        owners = owners_of(param_or_module)
        if len(owners) > 1:
            raise ValueError(f"{type(param_or_module).__name__}'s parameters are held by {len(owners)} flat-group "
                             "owners (one per optimizer of a plain loop); ask for them all with owners_of(module).")
        return owners[0] if owners else None
    owner = _OWNERS.get(param_or_module)
    return owner() if owner is not None else None


def owners_of(params: Union[nn.Module, Iterable[nn.Parameter]]) -> list[FlatParameters]:
    """The distinct FlatParameters holding ``params`` (a module's parameters), in the parameters' order."""
    params = params.parameters() if isinstance(params, nn.Module) else params
    return list(dict.fromkeys(s for s in map(owner_of, params) if s is not None))


@contextlib.contextmanager
def gathered_parameters(params: Union[nn.Module, Iterable[nn.Parameter]],
                        modifier_rank: Optional[int] = None) -> Iterator[None]:
    """Full parameters inside the block, on every rank (a collective: every rank must enter it).

    With ``modifier_rank``, that rank's values when the block ends become everyone's (edits on
    other ranks are dropped); without it, edits are discarded. Works at any stage: parameters
    that are whole already (stages 1 and 2, resident ones) are only broadcast when modified.
    """
    params = list(params.parameters() if isinstance(params, nn.Module) else params)
    sharders = owners_of(params)
    wanted = set(params)
    units = [(s, u) for s in sharders for u in s.all_units if any(p in wanted for g in u.groups for p in g.params)]
    for s in dict.fromkeys(s for s, _ in units):
        s.meet_outside("gathered_parameters")
    for s, u in units:
        u.hold()  # forwards inside the block must not release it
        s.gather(u)
    try:
        yield
    finally:
        if modifier_rank is not None:
            _adopt_values_of(modifier_rank, params, units)
            for g in (g for sharder in sharders for g in sharder.resident if any(p in wanted for p in g.params)):
                g.masters_from_weights()  # the broadcast values, into the fp32 masters too
        for _, u in units:
            u.unhold()


def _adopt_values_of(rank: int, params: list[nn.Parameter], units: list[tuple[FlatParameters, Unit]]) -> None:
    """Rank ``rank``'s values of ``params`` on every rank, kept in the shards of the gathered ``units``."""
    what = f"broadcast of gathered_parameters' edits from rank {rank}"
    with torch.no_grad():
        for sharder, u in units:
            sharder.gather(u)  # a load inside the block left it stale: the loaded values are the ones to keep
            for g in u.groups:
                assert g.buffer is not None
                sharder.world_comm.broadcast(g.buffer, src=rank, what=lambda: what)
                g.commit_gathered()
        in_units = {p for _, u in units for g in u.groups for p in g.params}
        comm = units[0][0].world_comm if units else Collectives()
        for p in params:
            if p not in in_units:
                comm.broadcast(p.data, src=rank, what=lambda: what)
