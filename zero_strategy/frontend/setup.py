"""What every front end does to a module and its optimizers, in one ordered place.

[Note: the order of setup]
``setup_engine`` applies the engine's features to a module in this order, for the Trainer's
ZeroStrategy, Fabric's ZeroFabricStrategy and ``initialize`` alike:

0. ``seal``: the record of what the script did to a model built on meta ends (see [Note: changes
   before setup] in engine/params/edits.py), so that what setup does to it is not taken for the script's.
1. working dtype (``WorkingPrecision.convert_module``): the flat buffers of step 5 hold the
   working weights, one buffer per dtype, and the fp32 masters are copied from them; converting
   after sharding would detach the parameters from their buffers.
2. device: the flat buffers are allocated where the parameters are. Meta tensors stay on meta:
   stage 3 materialises them unit by unit on the device (see [Note: init-time sharding] in
   engine/params/materialize.py).
3. activation checkpointing: it replaces module instances' ``forward`` (see [Note: checkpointing
   by instance forward]); the sharder's hooks, registered next, then run around the checkpointed
   call, and the units it plans see the modules as they will run.
4. the optimizers, built now when a front end gives a factory (the Trainer's
   ``configure_optimizers``): they see whole parameters with their real shapes (code that groups
   by ``p.dim()`` works), which stage 3 is about to replace by shards.
5. sync or shard: every rank starts from rank 0's weights. Stages 1-2 broadcast the module, then,
   when there are optimizers (an evaluation needs none), ``shard_module`` builds the resident flat
   groups of the trainable parameters; stage 3 broadcasts the buffers and ``shard_module``
   broadcasts and shards the parameters unit by unit. The optimizers are passed, so each gets flat
   groups of its own (see [Note: one owner of the flat groups]).
   Then, at stage 3 over several ranks, Hugging Face models' ``generate`` keeps the ranks in step
   (see [Note: synced generation] in generation.py).
6. activation offload (``offload_activations``): hooks on the module enter it around each forward,
   for every front end (see [Note: activation offload in every front end]); after step 5, so that
   they enclose the stage-3 sharder's. Then, with ``broadcast_buffers`` over several ranks, the
   buffer broadcast before each forward (see [Note: buffers kept in step] in
   engine/params/buffer_sync.py), hooked first on the module's forward unless the front end counts
   forwards itself (the Trainer: its steps, as Lightning's DDP wraps them). With ``step_breakdown``
   the module's forward is the step's forward phase (see [Note: the step breakdown] in
   engine/diagnose/breakdown.py; the sharder hooks it already where it holds the module).
7. each optimizer re-created over this rank's pieces (``ZeroOptimizer``), with the loss scaler.
   ``add_optimizers`` is this step alone, for front ends that get optimizers after the module
   (Fabric's ``setup_module`` then ``setup_optimizers``): at stage 3 they map onto the units' groups
   (which were split by no optimizer, so one optimizer must step each group whole); at stages 1-2
   without the module's groups, each optimizer builds groups of its own parameters, as a plain
   loop's ZeroOptimizer does.

Clipping goes through the engine (``clip_grad_norm``): no parameter holds a whole reduced
gradient at stages 2-3, so the norm is taken over every rank's shard.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from ..activation import apply_activation_checkpointing, offload_activations_in_forward
from ..checkpoint.background import BackgroundSaver
from ..config import ZeroConfig
from ..engine import Collectives, FlatParameters, ZeroOptimizer, shard_module
from ..engine.diagnose.flops import peak_flops
from ..engine.params.attached import attach_hook
from ..engine.params.buffer_sync import BufferBroadcast
from ..engine.params.edits import seal
from ..engine.params.materialize import fill_deferred, materialize_buffers, materialize_whole
from ..generation import sync_generation
from ..step_report import Reporter
from .engine_model import EngineModel
from .precision import WorkingPrecision
from .pretrained import guard_hf_save_pretrained

Optimizers = Union[Sequence[torch.optim.Optimizer], Callable[[], Sequence[torch.optim.Optimizer]]]


def engine_config(config: ZeroConfig, precision: WorkingPrecision) -> ZeroConfig:
    """The settings with master weights as the precision asks, and the autocast dtype as the dtype of
    ``low_precision_reduce_modules``' reductions (see [Note: low-precision reductions])."""
    return dataclasses.replace(config, master_weights=precision.master_weights,
                               low_precision_reduce_dtype=precision.autocast_dtype)


def move_module(module: nn.Module, device: torch.device) -> None:
    """Parameters and buffers to ``device``, in place (the Parameter objects stay); meta tensors stay on
    meta: stage 3 materialises them unit by unit (see [Note: init-time sharding] in engine/params/materialize.py)."""
    module._apply(lambda t: t if t.is_meta else t.to(device))


def sync_module(module: nn.Module, comm: Collectives, stage: int) -> None:
    """Every rank starts from rank 0's values: the parameters and buffers at stages 1-2, the buffers
    only at stage 3 (its parameters are broadcast unit by unit while sharding)."""
    if stage < 3:
        meta = [name for name, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
        if meta:
            raise ValueError(f"{type(module).__name__} has tensors on the meta device ({meta[:3]}...) at ZeRO stage "
                             f"{stage}: only stage 3 materialises a model built on meta (unit by unit, from rank 0's "
                             "values). Build the model with real tensors, or train it at stage=3.")
    tensors = [*module.buffers()] if stage == 3 else [*module.parameters(), *module.buffers()]
    with torch.no_grad():
        for tensor in tensors:
            if not tensor.is_meta:
                comm.broadcast(tensor.data, src=0, what=lambda: "broadcast of the module's initial weights")


def setup_engine(module: nn.Module, config: ZeroConfig, precision: WorkingPrecision, comm: Collectives,
                 device: torch.device, optimizers: Optimizers = (),
                 sharder: Optional[FlatParameters] = None, hook_buffer_sync: bool = True) -> EngineModel:
    """Put ``module`` (and ``optimizers``, or the optimizers a factory builds) on the engine, in the
    order of [Note: the order of setup]. A collective.

    ``sharder``: the one this module got at an earlier setup (stage 3 keeps a module sharded between
    a Trainer's fit and test); its groups take the parameters back instead of sharding again.
    ``hook_buffer_sync`` False: the front end calls ``model.buffer_sync`` around what it counts as a
    forward instead of the module's forward hooks.
    """
    config = engine_config(config, precision)
    seal(module)  # what the script did to a model built on meta ends here: see [Note: changes before setup]
    precision.convert_module(module)  # 1
    move_module(module, device)  # 2
    if config.activation_checkpointing:  # 3
        apply_activation_checkpointing(module, config.activation_checkpointing,
                                       config.activation_checkpointing_interval, offload=config.offload_activations)
    built = list(optimizers() if callable(optimizers) else optimizers)  # 4
    _check_owned(module, built)
    model = EngineModel(module, config, precision, comm, device,
                        saver=BackgroundSaver(module) if config.async_save else None)
    if config.stage == 3 and sharder is not None and sharder.module is module:  # 5
        for g in sharder.resident:  # the whole parameters were given new tensors (module.cpu() and back)
            g.adopt_params()
        model.sharder = sharder
    else:
        if config.stage == 3:
            materialize_buffers(module, device)
        else:  # a model built inside the init context: whole, as stages 1-2 hold it
            materialize_whole(module, device, _rank0_rng(comm, device), _on_any_rank(comm, device))
        sync_module(module, comm, config.stage)
        if config.stage == 3 or built:
            model.sharder = shard_module(module, config, comm, device, built)
        if config.stage == 3:  # pretrained or recorded values into the shards: see [Note: init-time sharding]
            fill_deferred(module, model.sharder.groups, _rank0_rng(comm, device), device, _on_any_rank(comm, device))
            comm.begin_step()  # its collectives are set-up's, not the first step's
            guard_hf_save_pretrained(model)  # transformers' own save_pretrained would write the empty shards
    sync_generation(module, config.stage, comm)
    if config.offload_activations:  # 6
        offload_activations_in_forward(module)
    if config.broadcast_buffers and comm.world_size > 1:
        model.buffer_sync = BufferBroadcast(module, comm)
        if hook_buffer_sync:
            model.buffer_sync.hook()
    comm.breakdown.enable(config.step_breakdown, device)
    if config.step_breakdown:
        model.hooks += [(module, attach_hook(module, handle)) for handle in comm.breakdown.watch(module)]
    return add_optimizers(model, built)  # 7


def reporter(model: EngineModel) -> Reporter:
    """What the front ends read of the step breakdown of ``model``'s engine (see step_report.py): the
    device's peak FLOP/s for the dtype its matrix products run in."""
    dtype = model.precision.autocast_dtype or model.precision.dtype
    return Reporter(model.comm.breakdown, model.config, model.comm.world_size, peak_flops(model.device, dtype),
                    model.sharder)


def _rank0_rng(comm: Collectives, device: torch.device) -> Callable[[torch.Tensor], None]:
    """Broadcast a CPU random state from rank 0, in place (through ``device``: NCCL sends no CPU tensor)."""
    def broadcast(state: torch.Tensor) -> None:
        on_device = state.to(device)
        comm.broadcast(on_device, src=0, what=lambda: "broadcast of rank 0's random state for the model's replay")
        state.copy_(on_device.cpu())
    return broadcast


def _on_any_rank(comm: Collectives, device: torch.device) -> Callable[[bool], bool]:
    """Whether a flag is set on some rank (a collective)."""
    def any_rank(flag: bool) -> bool:
        count = torch.tensor([int(flag)], device=device)
        comm.all_reduce(count, what=lambda: "all-reduce of whether the ranks recorded the model alike")
        return bool(count.item())
    return any_rank


def add_optimizers(model: EngineModel, optimizers: Sequence[torch.optim.Optimizer],
                   together: str = "give every optimizer when the module is set up") -> EngineModel:
    """Re-create ``optimizers`` over this rank's pieces (ZeroOptimizers already are kept) and add them
    to ``model``. With the module's flat groups built (stage 3, or stages 1-2 set up with optimizers)
    each maps onto the groups of its parameters, which must hold no other optimizer's; at stages 1-2
    without them, each builds flat groups of its own parameters (the plain loop's way, see [Note: one
    owner of the flat groups]). ``together`` says how the front end's user passes several optimizers
    at once, for the error when their parameters share groups."""
    _check_owned(model.module, optimizers, model.optimizers)
    for opt in optimizers:
        if isinstance(opt, ZeroOptimizer):
            model.optimizers.append(opt)
            continue
        if model.sharder is not None:
            _check_groups_of_their_own(model.sharder, opt, together)
        model.optimizers.append(ZeroOptimizer(opt, model.config, comm=model.comm, sharder=model.sharder,
                                              scaler=model.precision.scaler))
    return model


def _check_owned(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                 earlier: Sequence[torch.optim.Optimizer] = ()) -> None:
    """Each optimizer steps parameters of ``module``, none of which an earlier optimizer steps."""
    own = {id(p) for p in module.parameters()}
    taken = {id(p) for opt in earlier for g in opt.param_groups for p in g["params"]}
    for opt in optimizers:
        params = [p for g in opt.param_groups for p in g["params"]]
        foreign = [tuple(p.shape) for p in params if id(p) not in own]
        if foreign:
            raise ValueError(f"{type(opt).__name__} holds {len(foreign)} tensors that are not parameters of "
                             f"{type(module).__name__} (shapes {foreign[:3]}); build each optimizer over the model's "
                             "own parameters (model.parameters(), or param groups of them).")
        twice = [tuple(p.shape) for p in params if id(p) in taken]
        if twice:
            raise ValueError(f"{type(opt).__name__} steps {len(twice)} parameters (shapes {twice[:3]}) that another "
                             "optimizer steps too; ZeRO shards each parameter's optimizer state once, so give every "
                             "parameter to one optimizer.")
        taken |= {id(p) for p in params}


def _check_groups_of_their_own(sharder: FlatParameters, opt: torch.optim.Optimizer, together: str) -> None:
    """``opt``'s trainable parameters fill whole flat groups: groups built before it knew of it hold the
    parameters of every optimizer that was not given then, together."""
    mine = {p for g in opt.param_groups for p in g["params"] if p.requires_grad}
    shared = [p for g in sharder.groups if g.params[0].requires_grad and any(p in mine for p in g.params)
              for p in g.params if p not in mine]
    if shared:
        raise ValueError(f"{type(opt).__name__} steps some parameters of flat groups that hold {len(shared)} others "
                         f"(shapes {[tuple(p.shape) for p in shared[:3]]}): the groups were built before this "
                         f"optimizer was known, for every parameter no optimizer then stepped. To give several "
                         f"optimizers groups of their own, {together}.")


# ---- clipping through the engine -------------------------------------------------------------


def clip_grad_norm(optimizer: ZeroOptimizer, max_norm: float, norm_type: float = 2.0) -> Optional[torch.Tensor]:
    """Clip ``optimizer``'s gradients to a global norm (over every rank's shard) of ``max_norm``, and
    return the norm before clipping; None when an fp16 overflow will skip the step (an inf norm
    would poison the gradients, and the step does not use them). A collective."""
    optimizer.reduce_gradients()
    if optimizer.overflowed:
        return None
    return optimizer.clip_grad_norm_(float(max_norm), norm_type)


def clip_grad_value(optimizer: ZeroOptimizer, clip_val: float) -> None:
    """Clamp ``optimizer``'s reduced gradients to [-clip_val, clip_val]."""
    optimizer.clip_grad_value_(float(clip_val))
