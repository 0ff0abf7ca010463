"""ZeroFabricStrategy: Lightning Fabric's front end on the same engine as the Trainer's ZeroStrategy.

    fabric = L.Fabric(strategy="zero_stage_3", accelerator="cpu", devices=2, precision="bf16-mixed")
    fabric.launch()
    with fabric.init_module(empty_init=True):   # stage 3: on meta, materialised unit by unit in setup
        model = GPT(config)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-4))

Everything but Fabric's hooks comes from zero_strategy/frontend (see [Note: front ends]): the
ordered setup, the precision (``WorkingPrecision``), clipping and the checkpoint format, so a
checkpoint written here resumes under the Trainer and the other way round.

[Note: Fabric calls that change meaning or are refused]
- ``no_backward_sync``: stage 1 reduces the gradients only at ``optimizer.step()``, so inside the
  context nothing is exchanged, as with DDP. Stages 2-3 reduce each micro-batch's gradients into
  the rank's shard as backward produces them (as DeepSpeed does; holding whole gradients over the
  micro-batches would undo what stage 2 saves), so the context cannot skip that exchange: the
  results are the same, and a warning says so once. With ``local_accumulation=True`` stages 2-3
  trade that memory for the exchange: inside the context gradients add into a full-size local
  buffer, and the first backward outside reduces them once (see [Note: local accumulation]). At
  every stage a forward inside it makes the next forward broadcast no buffers, as DDP's ``no_sync``
  (see [Note: buffers kept in step] in engine/params/buffer_sync.py).
- ``clip_gradients`` clips over every rank's shard (a collective: every rank calls it). An fp16
  overflow, after which ``step()`` skips the step, returns an inf norm; ``error_if_nonfinite``
  applies when there is no loss scaler to skip it.
- ``autocast()`` (``forward_context``): floating-point tensors made inside default to the working
  dtype; ``"bf16-mixed"`` means bf16 weights with fp32 masters here (see [Note: precision]), so the
  model computes in bf16 with or without it. Outputs go back to fp32, as DeepSpeed's plugin does.
- ``init_module(empty_init=True)``: at stage 3 the model's construction is recorded on meta and
  replayed unit by unit in setup, each rank keeping its shards (the same values as an eager build:
  see [Note: recorded construction] in engine/params/deferred_init.py), and ``from_pretrained`` inside it
  streams its files into the shards (see [Note: pretrained weights into shards] in pretrained.py);
  at stages 1-2 the initialisation is skipped, for a checkpoint to be loaded next. What the script
  does to the model before ``fabric.setup`` (its own initialisation) is recorded and replayed too,
  or refused (see [Note: changes before setup] in engine/params/edits.py).
  ``fabric.load_raw(path, model)`` of safetensors weights (a file, or a Hugging Face directory)
  reads each rank's slices the same way; of a ``torch.save`` file, memory-mapped, as does
  ``model.load_state_dict`` of whole tensors (see [Note: loading a full state dict] in
  engine/params/whole_state.py).
- refused, with the call and what to do instead: a ``CheckpointIO`` plugin (checkpoints are written
  by the strategy), ``fabric.save(..., filter=...)`` of a sharded checkpoint, a checkpoint of two
  models, and a DeepSpeed config's loop settings (accumulation, clipping, optimizer, schedule).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import TBroadcast, _BackwardSyncControl, _Sharded
from lightning.fabric.utilities.distributed import ReduceOp, _sync_ddp_if_available
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer

from .config import ZeroConfig
from .engine import Collectives, ZeroOptimizer
from .names import register_names
from .engine.grads.accumulation import deferred_reduction, defers
from .frontend import (EngineModel, add_optimizers, clip_grad_norm, clip_grad_value,
                       load_full_model, move_module, read_state_dict_file, setup_engine)
from .frontend.in_step import no_sync
from .frontend.named_state import load_named_state, save_named_state, save_named_state_full
from .frontend.options import ProcessLayout, barrier, broadcast_object, read_options, takes_options
from .frontend.precision import WorkingPrecisionPlugin, generic_precision_name
from .frontend.pretrained import save_pretrained
from .frontend.setup import reporter
from .memory import memory_stats
from .checkpoint.pretrained_files import is_pretrained_path
from .pretrained import load_pretrained, sharded_init
from .step_report import Reporter, StepSummary, summarize, units_of
from .world import join_world, set_world_ranks

log = logging.getLogger(__name__)

__all__ = ["ZeroFabricPrecision", "ZeroFabricStrategy"]


class ZeroFabricPrecision(WorkingPrecisionPlugin, Precision):
    """Fabric's precision plugin for ZeRO: Fabric's hooks around the shared ``WorkingPrecision``
    (see [Note: precision]), with DeepSpeed's fp16 loss-scaling knobs (as ZeroPrecision takes them)."""

    def tensor_init_context(self) -> AbstractContextManager:
        return self.working.default_dtype()

    def module_init_context(self) -> AbstractContextManager:
        return self.working.default_dtype()

    def forward_context(self) -> AbstractContextManager:
        """See [Note: Fabric calls that change meaning or are refused]: ``fabric.autocast()``."""
        return nullcontext() if self.working.dtype is torch.float32 else self.working.default_dtype()

    def convert_output(self, data: Any) -> Any:
        if self.working.dtype is torch.float32:
            return data
        default = torch.get_default_dtype()  # fp32 outside the forward context, as DeepSpeed's plugin casts back
        return apply_to_collection(data, Tensor, lambda t: t.to(default) if t.is_floating_point() else t)

    def backward(self, tensor: Tensor, model: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        self.working.scale_loss(tensor).backward(*args, **kwargs)


def to_fabric_precision(plugin: Optional[Precision]) -> Optional[ZeroFabricPrecision]:
    """Replace the generic plugin Fabric picked for ``precision=...``; reject what the engine cannot do."""
    if plugin is None or isinstance(plugin, ZeroFabricPrecision):
        return plugin
    return ZeroFabricPrecision(generic_precision_name(
        plugin, "ZeroFabricStrategy", "Pass Fabric(precision=...) one of those (for fp16 on a CPU, "
        "plugins=[ZeroFabricPrecision('16-mixed')]: Fabric turns '16-mixed' into 'bf16-mixed' there)."))


class _ZeroBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync``: see [Note: Fabric calls that change meaning or are refused]."""

    def __init__(self, strategy: "ZeroFabricStrategy") -> None:
        self.strategy = strategy
        self.warned = False

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        engine = self.strategy._engine_of(module, "fabric.no_backward_sync(model)")
        if defers(engine.optimizers):  # see [Note: local accumulation] in engine/grads/accumulation.py
            return _both(deferred_reduction(engine.optimizers), no_sync(engine.buffer_sync))
        if self.strategy.config.stage >= 2 and not self.warned:
            self.warned = True
            rank_zero_warn(f"fabric.no_backward_sync at ZeRO stage {self.strategy.config.stage}: each micro-batch's "
                           "gradients are still reduced into this rank's shard as backward produces them (keeping "
                           "whole gradients until the step would undo what stage 2 saves). Accumulation gives the "
                           "same result; only stage 1 exchanges nothing until optimizer.step(), and stages 2-3 with "
                           "local_accumulation=True (at the cost of a full-size gradient buffer).")
        return no_sync(engine.buffer_sync)  # DDP's no_sync: the next forward broadcasts no buffers


@contextmanager
def _both(first: AbstractContextManager, second: AbstractContextManager) -> Iterator[None]:
    with first, second:
        yield


class ZeroFabricStrategy(ProcessLayout, ParallelStrategy, _Sharded):
    """ZeRO data parallelism for Lightning Fabric: optimizer state (stage 1), gradients (stage 2) and
    parameters (stage 3) sharded over ranks, on CPU (gloo) or CUDA (NCCL).

    Takes ZeroStrategy's options. ``Fabric(strategy="zero_stage_2")`` after ``import zero_strategy``
    is ``Fabric(strategy=ZeroFabricStrategy(stage=2))``.
    """

    @takes_options
    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        precision: Optional[Precision] = None,
        **given: Any,  # every ZeroConfig field and FRONT_END_OPTIONS: see [Note: the front ends' signatures]
    ) -> None:
        options = read_options(given)
        if options.deepspeed is not None:
            _refuse_loop_settings(options.deepspeed)
            if precision is None and options.precision_from_config is not None:
                name, kwargs = options.precision_from_config
                precision = ZeroFabricPrecision(name, **kwargs)
        self.config: ZeroConfig = options.config
        self.options = options
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision=precision)
        self._num_nodes = 1
        self._process_group_backend: Optional[str] = given["process_group_backend"]
        self._comm: Optional[Collectives] = None
        self._engines: list[EngineModel] = []  # one per module set up
        self._reporter: Optional[Reporter] = None  # the step breakdown's, once a module is set up
        self._backward_sync_control = _ZeroBackwardSyncControl(self)

    # ---- the layout of processes -----------------------------------------------------------

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    def precision(self) -> ZeroFabricPrecision:
        return self._precision if self._precision is not None else ZeroFabricPrecision()  # type: ignore[return-value]

    @precision.setter
    def precision(self, precision: Optional[Precision]) -> None:
        self._precision = to_fabric_precision(precision)

    @property
    def checkpoint_io(self) -> CheckpointIO:
        return super().checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        raise ValueError(f"ZeroFabricStrategy does not take a CheckpointIO plugin ({type(io).__name__}): it writes its "
                         "checkpoints itself (a sharded directory, or one file with state_dict_type='full'). Drop the "
                         "plugin from Fabric(plugins=...).")

    # ---- processes and the process group ---------------------------------------------------

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.options.start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self.options.start_method)

    def setup_environment(self) -> None:
        super().setup_environment()
        self._process_group_backend, self._comm = join_world(
            self, self._process_group_backend, self.options.timeout, "Fabric",
            "Fabric(devices=..., num_nodes=...) asks for (fabric.launch(), torchrun or srun)",
            lambda: getattr(self._launcher, "procs", []))

    def _set_world_ranks(self) -> None:
        set_world_ranks(self)  # see world.py

    @property
    def comm(self) -> Collectives:
        """The engine's collectives over the whole world (see engine/comm/collectives.py)."""
        if self._comm is None:
            raise RuntimeError("ZeroFabricStrategy has no process group yet: call fabric.launch() (or run under the "
                               "Fabric CLI, torchrun or srun) before setting up models.")
        return self._comm

    # ---- building and setting up models ----------------------------------------------------

    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """Stage 3 with ``empty_init=True``: on the meta device, materialised unit by unit in setup, so the
        model never exists whole on a rank (see [Note: init-time sharding] in engine/params/materialize.py)."""
        if self.config.stage == 3 and empty_init:
            stack = ExitStack()
            stack.enter_context(sharded_init())  # recorded on meta; from_pretrained streams (pretrained.py)
            stack.enter_context(self.precision.module_init_context())
            return stack
        return super().module_init_context(empty_init)

    def module_sharded_context(self) -> AbstractContextManager:
        return sharded_init() if self.config.stage == 3 else nullcontext()

    def module_to_device(self, module: nn.Module) -> None:
        move_module(module, self.root_device)  # meta tensors stay: see [Note: the order of setup]

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer],
                                    scheduler: Optional[Any] = None) -> tuple[nn.Module, list[Optimizer], Any]:
        """The model and its optimizers on the engine (see [Note: the order of setup]); the optimizers come
        back as ZeroOptimizers sharing the given ones' param groups, so a scheduler built on those works."""
        engine = self._setup(module, optimizers)
        return module, list(engine.optimizers), scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        return self._setup(module, ()).module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """An optimizer of a model set up before (``fabric.setup_module``): see [Note: the order of setup]."""
        mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
        engine = next((e for e in self._engines if any(id(p) in mine for p in e.module.parameters())), None)
        if engine is None:
            raise ValueError(f"fabric.setup_optimizers({type(optimizer).__name__}): its parameters belong to no model "
                             "set up by this strategy; call model = fabric.setup_module(model) first and build the "
                             "optimizer over model.parameters(), or set both up with fabric.setup(model, optimizer).")
        add_optimizers(engine, [optimizer], together="set them up with the model, fabric.setup(model, opt1, opt2)")
        return engine.optimizers[-1]

    def _setup(self, module: nn.Module, optimizers: Sequence[Optimizer]) -> EngineModel:
        if any(e.module is module for e in self._engines):
            raise ValueError(f"fabric.setup: this {type(module).__name__} is set up already; set each model up once.")
        engine = setup_engine(module, self.config, self.precision.working, self.comm, self.root_device, optimizers)
        self._engines.append(engine)
        if self._reporter is None and self.config.step_breakdown:
            self._reporter = reporter(engine)
        return engine

    def _find_engine(self, module: nn.Module) -> Optional[EngineModel]:
        """The engine of ``module``: what ``fabric.setup`` returned (the wrapper) or the module inside it."""
        candidates = [module, getattr(module, "_forward_module", None), getattr(module, "_original_module", None)]
        return next((e for e in self._engines if any(e.module is m for m in candidates)), None)

    def _engine_of(self, module: nn.Module, call: str) -> EngineModel:
        engine = self._find_engine(module)
        if engine is None:
            raise TypeError(f"{call}: the {type(module).__name__} was not set up by this strategy; pass the model that "
                            "fabric.setup(...) returned.")
        return engine

    # ---- clipping --------------------------------------------------------------------------

    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> Tensor:
        """The norm over every rank's shard, clipped to ``max_norm``: see [Note: Fabric calls that change
        meaning or are refused]. A collective."""
        zero = _zero_optimizer(optimizer, "fabric.clip_gradients(model, optimizer, max_norm=...)")
        norm = clip_grad_norm(zero, float(max_norm), float(norm_type))
        if norm is None:  # an fp16 overflow: step() skips this step
            return torch.tensor(float("inf"))
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"fabric.clip_gradients: the total norm of order {float(norm_type)} of the gradients "
                               f"is non-finite ({norm.item()}), so clipping them is meaningless; look for NaN or inf "
                               "in the loss, or pass error_if_nonfinite=False to go on.")
        return norm

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: Union[float, int]) -> None:
        clip_grad_value(_zero_optimizer(optimizer, "fabric.clip_gradients(model, optimizer, clip_val=...)"), clip_val)

    # ---- collectives -----------------------------------------------------------------------

    def all_reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
                   reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Union[Tensor, Any]:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        barrier(self.root_device)

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return broadcast_object(obj, src)

    # ---- state dicts and checkpoints (see [Note: named state]) ------------------------------

    def full_state_dict(self, module: nn.Module) -> dict[str, Tensor]:
        """``module``'s whole state dict on every rank (at stage 3 gathered unit by unit: a collective)."""
        return self._engine_of(module, "full_state_dict(model)").full_state_dict()

    def save_pretrained(self, module: nn.Module, save_directory: Any, **options: Any) -> Any:
        """Write ``module`` (set up by this strategy) in the Hugging Face layout from rank 0, one tensor
        gathered at a time; options as ``zero_strategy.frontend.pretrained.save_pretrained``. A
        collective: call ``fabric.strategy.save_pretrained(model, dir)`` on every rank."""
        return save_pretrained(self._engine_of(module, "save_pretrained(model, dir)"), save_directory, **options)

    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        engine = self._find_engine(module)
        return engine.full_state_dict() if engine is not None else module.state_dict()

    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        engine = self._find_engine(module)
        if engine is None:
            return super().load_module_state_dict(module, state_dict, strict=strict)
        load_full_model(engine, state_dict, strict)

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Any]] = None) -> None:
        """A sharded checkpoint directory, every rank writing its pieces (``state_dict_type="full"``: one
        file from rank 0); the model, its optimizers and every other entry of ``state`` (what a safe load
        refuses, such as a DataLoader, beside the rest: see [Note: pickled objects]). A collective."""
        if storage_options is not None:
            raise TypeError(f"fabric.save(..., storage_options={storage_options!r}): ZeroFabricStrategy writes its "
                            "checkpoints itself, without a CheckpointIO plugin; drop the argument.")
        path = Path(self.broadcast(str(path)))
        if self.options.state_dict_type == "full":
            return save_named_state_full(path, state, self._engines, "fabric.save", filter)
        if filter:
            raise ValueError("fabric.save(..., filter=...) cannot filter a sharded checkpoint, which must hold every "
                             "parameter to load at another world size; save with "
                             "ZeroFabricStrategy(state_dict_type='full'), or filter the loaded state dict instead.")
        save_named_state(path, state, self._engines, "fabric.save")

    def load_checkpoint(self, path: Any, state: Optional[Union[nn.Module, Optimizer, dict[str, Any]]] = None,
                        strict: bool = True, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Restore ``state`` from a checkpoint this package wrote (here, by the Trainer, or by ``initialize``),
        a DeepSpeed one, or a regular file, at any world size and stage; returns what ``state`` did not ask
        for. Objects only pickle loads come back with ``weights_only=False`` alone. A collective."""
        path = Path(self.broadcast(str(path)))
        if isinstance(state, nn.Module):  # fabric.load_raw(path, model): a file of the model's state dict
            return self._load_raw_module(path, state, strict, weights_only)
        if isinstance(state, Optimizer):
            raise NotImplementedError("fabric.load_raw(path, optimizer): a ZeRO optimizer loads with its model, "
                                      "fabric.load(path, {'model': model, 'optimizer': optimizer}).")
        if not state:
            if path.is_file():  # the whole file, as Fabric's other strategies give it
                return super().load_checkpoint(path, state, strict,
                                               weights_only=True if weights_only is None else weights_only)
            raise ValueError(f"fabric.load({str(path)!r}) needs the state to restore: pass it, e.g. "
                             "fabric.load(path, {'model': model, 'optimizer': optimizer}), with the objects "
                             "fabric.setup(...) returned.")
        return load_named_state(path, state, self._engines, "fabric.load", strict, self.options.verify_checkpoints,
                                weights_only)

    def _load_raw_module(self, path: Path, module: nn.Module, strict: bool,
                         weights_only: Optional[bool]) -> dict[str, Any]:
        if is_pretrained_path(path):  # safetensors weights: each rank reads its own slices (pretrained.py)
            load_pretrained(module, path, strict=strict)
            return {}
        if not path.is_file():
            return load_named_state(path, {"model": module}, self._engines, "fabric.load_raw", strict,
                                    self.options.verify_checkpoints, weights_only)
        state_dict = read_state_dict_file(path, weights_only)  # memory-mapped: each rank reads its slices
        self.load_module_state_dict(module, state_dict, strict)
        return {}

    # ---- where the step's time goes: see [Note: the step breakdown] in engine/diagnose/breakdown.py --

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, **kwargs)
        if self._reporter is not None:  # see [Note: advice from the breakdown] in step_report.py
            for text in self._reporter.new_advice():
                if self.is_global_zero:
                    log.warning("zero_strategy: %s", text)
        return out

    def step_metrics(self) -> dict[str, float]:
        """The means of the training steps ended since the last call, by part (``zero/<part>_ms``), with
        throughput and MFU, for ``fabric.log_dict(fabric.strategy.step_metrics(), step=...)``; this rank's."""
        return self._reporter.window() if self._reporter is not None else {}

    def step_breakdown(self) -> StepSummary:
        """This rank's mean training step so far, by part, with throughput, FLOPs, MFU and advice;
        ``print(fabric.strategy.step_breakdown().table())`` shows it. Empty with ``step_breakdown=False``."""
        engine = self._engines[0] if self._engines else None
        return summarize(self.comm.breakdown, engine.config if engine is not None else self.config,
                         self.comm.world_size, self._reporter.peak if self._reporter is not None else None,
                         units_of(engine.sharder if engine is not None else None), self.comm.comm_stats())

    # ---- memory and the end ----------------------------------------------------------------

    def memory_stats(self, module: nn.Module) -> dict[str, int]:
        """This rank's bytes in params, grads, optimizer_states and master_params (and total) for a model set up."""
        engine = self._engine_of(module, "memory_stats(model)")
        return memory_stats(engine.module, engine.optimizers)

    def wait_for_saves(self) -> None:
        """With ``async_save``: wait until the checkpoint being written in the background is committed,
        and raise what it failed with. ``fabric.save`` and the end of the run wait by themselves."""
        for engine in self._engines:
            engine.finish_saves()

    def teardown(self) -> None:
        for engine in self._engines:
            engine.remove_hooks()
        super().teardown()
        self.wait_for_saves()  # the end waits for a save in the background, and raises what it failed with

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``zero_stage_1`` ... ``zero_stage_3_offload`` (``zero_strategy.STRATEGY_NAMES``) in Fabric's
        registry; safe to call more than once. ``import zero_strategy`` does it already."""
        register_names(strategy_registry, cls, cls.__name__)


def _zero_optimizer(optimizer: Any, call: str) -> ZeroOptimizer:
    if not isinstance(optimizer, ZeroOptimizer):
        raise TypeError(f"{call}: the optimizer is a {type(optimizer).__name__} that ZeroFabricStrategy did not set "
                        "up; pass the one fabric.setup(...) returned.")
    return optimizer


def _refuse_loop_settings(settings: Any) -> None:
    """A DeepSpeed config's loop settings: in a Fabric loop they are code you write."""
    refused = []
    if (settings.gradient_accumulation_steps or 1) > 1:
        refused.append(f"gradient_accumulation_steps={settings.gradient_accumulation_steps} (accumulate in the loop: "
                       "fabric.no_backward_sync(model, enabled=...) around forward and backward, and optimizer.step() "
                       "every that many batches)")
    if settings.gradient_clipping:
        refused.append(f"gradient_clipping={settings.gradient_clipping} (call fabric.clip_gradients(model, optimizer, "
                       f"max_norm={settings.gradient_clipping}) before optimizer.step())")
    if settings.optimizer is not None or settings.scheduler is not None:
        refused.append("the \"optimizer\"/\"scheduler\" sections (build them and pass them to fabric.setup)")
    if refused:
        raise ValueError("ZeroFabricStrategy(config=...) takes the engine's settings and the precision from a "
                         "DeepSpeed config; the loop's are code in a Fabric loop. Remove from the config: "
                         + "; ".join(refused) + ".")
    log.info("ZeroFabricStrategy(config=...): the config's batch sizes are not applied (your DataLoader sets them), "
             "and nothing is clipped unless you call fabric.clip_gradients. %s", settings.log_summary())
