"""``initialize``: DeepSpeed's training-loop API, run by this package's ZeRO engine.

    import zero_strategy as deepspeed
    model_engine, optimizer, _, _ = deepspeed.initialize(model=model, config=ds_config,
                                                         model_parameters=model.parameters())
    loss = model_engine(inputs, labels=labels).loss
    model_engine.backward(loss)
    model_engine.step()

[Note: the engine's step, as DeepSpeed's]
``backward(loss)`` divides the loss by ``gradient_accumulation_steps`` and, for fp16, multiplies it
by the loss scale (in fp32), then runs autograd; gradients accumulate in the engine's flat buffers.
``step()`` counts micro-steps and acts only at an accumulation boundary, ``(micro_steps + 1) %
gradient_accumulation_steps == 0``: it reduces the gradients over the ranks, computes the global
gradient norm and clips to ``gradient_clipping`` (1.0 when the config has no such key, as in
DeepSpeed 0.19; 0 turns it off; a config's Muon clips its updates instead, see [Note: DeepSpeed's
Muon configuration] in deepspeed/muon.py), steps the optimizer, steps the LR scheduler and zeroes the
gradients. An fp16 step whose gradients overflowed on any rank is skipped (weights, optimizer state
and the norm stay as they were), the scale moves (see [Note: DeepSpeed's dynamic loss scale]) and the
LR scheduler is not stepped; ``global_steps`` counts it anyway, ``skipped_steps`` too. With
``"zero_optimization": {"local_accumulation": true}`` (stages 2-3; this package's key) a backward off
the boundary reduces nothing and the boundary's reduces the sum once (see [Note: local accumulation]
in engine/grads/accumulation.py).

[Note: stage 0]
A config without ``zero_optimization`` (DeepSpeed's stage 0: plain data parallelism) runs as the
engine at stage 1. The arithmetic is the same (gradients averaged over ranks, one optimizer update
per parameter), and so is the communication DeepSpeed's stage 0 does at a boundary (one reduction of
the full gradients, which stage 1 does as a reduce-scatter plus an all-gather of the updated
weights). It also keeps the fp16/bf16 master weights, loss scaling, clipping over shards and
checkpoints on one code path, and each rank holds 1/N of the optimizer state instead of all of it.
torch DDP would overlap the reduction with backward, but would need a second path for every one of
those. ``zero_optimization_stage()`` still reports 0.
"""

from __future__ import annotations

import logging
import math
import os
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..activation import offload_activations
from ..config import ZeroConfig
from ..engine import Collectives, FlatParameters, ZeroOptimizer
from ..frontend import EngineModel, WorkingPrecision, clip_grad_norm, setup_engine
from ..frontend.setup import reporter
from ..step_report import StepSummary, summarize, units_of
from ..frontend.pretrained import save_pretrained
from ..optimizers import DeepSpeedMuon
from . import engine_checkpoint
from .arguments import local_rank_from_arguments, record_local_rank
from .autocast import autocast_kwargs
from .backward import route_outputs
from .config import DeepSpeedSettings, map_deepspeed_config
from .engine_parts import (build_dataloader, build_optimizer, build_scheduler, check_batch_sizes, engine_device,
                           resolve_config)
from .launch import DEFAULT_PORT, init_distributed, local_rank
from .reporting import EngineReports

__all__ = ["ZeroEngine", "initialize"]

log = logging.getLogger(__name__)


class ZeroEngine(nn.Module):
    """The model, wrapped for ZeRO training with DeepSpeed's engine API (see ``initialize``).

    Calling it runs the model (floating-point inputs cast to the fp16/bf16 working dtype);
    ``backward``, ``step``, ``zero_grad`` and the accessors behave as DeepSpeed's (see [Note: the
    engine's step, as DeepSpeed's]); ``module`` is the model. At stage 3 the model's parameters are
    empty outside its forward: ``zero_strategy.gathered_parameters(engine.module)`` gives them whole.
    """

    def __init__(self, model: EngineModel, settings: DeepSpeedSettings, config: dict, local_rank: int,
                 lr_scheduler: Any) -> None:
        super().__init__()
        self.module = model.module
        self.engine_model = model  # what the shared checkpoint code takes (see zero_strategy/frontend)
        self.optimizer: Optional[ZeroOptimizer] = model.optimizers[0] if model.optimizers else None
        self.lr_scheduler = lr_scheduler
        self.settings, self.config = settings, config
        self.precision: WorkingPrecision = model.precision
        self.zero_config: ZeroConfig = model.config
        self.comm: Collectives = model.comm
        self.sharder: Optional[FlatParameters] = model.sharder
        self._device = model.device
        self.local_rank, self.global_rank, self.world_size = local_rank, self.comm.rank, self.comm.world_size
        self.global_steps = 0  # optimizer steps taken, skipped ones included (DeepSpeed's count)
        self.global_samples = 0
        self.skipped_steps = 0
        self.micro_steps = 0  # step() calls, boundary or not
        self._global_grad_norm: Optional[float] = None
        self._reporter = reporter(model)  # the step breakdown's: see step_breakdown()
        self._step_applied = False
        self._engine_backward_depth = 0  # > 0 while backward() runs: see [Note: one division per path]
        self._scaled_for_backward = False  # scale() made the loss of the coming direct backward
        self._warned_unreachable = False
        if self.optimizer is not None:  # local_accumulation: see [Note: local accumulation] in
                                        # engine/grads/accumulation.py
            me = weakref.ref(self)  # the optimizer must not keep its engine alive
            self.optimizer.defer_reduction_when(lambda: not _at_boundary(me))
        # wall_clock_breakdown, steps_per_print, flops_profiler: see [Note: DeepSpeed's reports]
        self.reports = EngineReports(self, settings.reporting) if settings.reporting.any else None

    # ---- what tutorials ask of the engine ------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._device

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.precision.dtype is not torch.float32 and self.precision.autocast_dtype is None:
            inputs, kwargs = self.precision.convert_input((inputs, kwargs))  # as fp16.auto_cast does; under
            # torch_autocast each op's dtype is autocast's, as in DeepSpeed (which casts no input then)
        if self.reports is not None:
            self.reports.began("forward")
        with offload_activations(enabled=self.zero_config.offload_activations and torch.is_grad_enabled()), \
                self.precision.autocast(self._device.type):  # torch_autocast: see [Note: torch_autocast]
            outputs = self.module(*inputs, **kwargs)
        if self.reports is not None:
            self.reports.ended("forward")
        return route_outputs(outputs, self) if self.optimizer is not None else outputs

    def backward(self, loss: Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> Tensor:
        """Backward of ``loss`` divided by ``gradient_accumulation_steps`` (unless ``scale_wrt_gas`` is
        False) and, for fp16, multiplied by the loss scale; returns the divided, unscaled loss."""
        self._need_optimizer("backward")
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(f"backward(loss): loss must be a tensor of one element, got {shape}; reduce it first "
                             "(e.g. loss.mean()).")
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            loss = loss / self.gradient_accumulation_steps()
        self._engine_backward_depth += 1
        if self.reports is not None:
            self.reports.began("backward")
        try:
            self.precision.scale_loss(loss).backward(retain_graph=retain_graph)
        finally:
            self._engine_backward_depth -= 1
        if self.reports is not None:
            self.reports.ended("backward")
        return loss

    def scale(self, loss: Tensor) -> Tensor:
        """``loss`` times the fp16 loss scale (unchanged in fp32 and bf16), for a direct
        ``scale(loss).backward()``; the division by ``gradient_accumulation_steps`` happens in that
        backward (see [Note: one division per path] in deepspeed/backward.py)."""
        self._need_optimizer("scale")
        if not isinstance(loss, Tensor) or loss.numel() != 1 or loss.grad_fn is None:
            raise ValueError(f"scale(loss): loss must be a one-element tensor computed from the engine's output, got "
                             f"{tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__}; for another "
                             "tensor use out.backward(grad).")
        self._scaled_for_backward = True
        return self.precision.scale_loss(loss)

    def _backward_ended(self) -> None:
        self._scaled_for_backward = False

    def step(self, lr_kwargs: Optional[dict] = None) -> None:
        """At an accumulation boundary: reduce, clip, step the optimizer and the LR scheduler, zero the
        gradients; between boundaries nothing but the count (see [Note: the engine's step, as DeepSpeed's])."""
        optimizer = self._need_optimizer("step")
        if self.reports is not None:
            self.reports.began("step")
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            clip = self.gradient_clipping()
            if isinstance(optimizer.optim, DeepSpeedMuon) and optimizer.optim.gradient_clipping > 0:
                clip = 0.0  # it clips its updates (as DeepSpeed's Muon at stages 1-3); the gradients' norm is logged
            norm = clip_grad_norm(optimizer, clip if clip > 0 else math.inf)  # None: an fp16 overflow, skipped
            if norm is not None:
                self._global_grad_norm = float(norm)
            optimizer.step()
            self._step_applied = not optimizer.overflowed
            if optimizer.overflowed:
                self.skipped_steps += 1
            elif self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
            optimizer.zero_grad()
        if self.reports is not None:  # printed before the counts move, as DeepSpeed numbers its steps
            self.reports.ended("step")
            self.reports.step_ended(boundary)
        if boundary:  # see [Note: advice from the breakdown] in step_report.py
            for text in self._reporter.new_advice():
                if self.global_rank == 0:
                    log.warning("zero_strategy: %s", text)
        if boundary:
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
        self.micro_steps += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none)
        else:
            self.module.zero_grad(set_to_none)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the coming ``step()`` steps the optimizer."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def was_step_applied(self) -> bool:
        """Whether the last boundary's optimizer step ran (False after an fp16 overflow)."""
        return self._step_applied

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self._need_optimizer("get_lr").param_groups]

    def get_global_grad_norm(self) -> Optional[float]:
        """The gradient norm over all ranks at the last boundary, before clipping (None before the
        first, and unchanged by a step skipped for an fp16 overflow)."""
        return self._global_grad_norm

    def comm_stats(self, times: bool = False) -> dict[str, float]:
        """Bytes this rank sent in its last step (since the previous boundary's step), by collective kind
        and by link, and with ``times`` the seconds waited for them: see ZeroStrategy.comm_stats() and
        [Note: bytes sent] in engine/comm/volume.py."""
        return self.comm.comm_stats(times)

    def step_breakdown(self) -> StepSummary:
        """This rank's mean optimizer step so far, by part, with throughput, FLOPs, MFU and advice (see
        [Note: the step breakdown] in engine/diagnose/breakdown.py); ``.table()`` prints it."""
        return summarize(self.comm.breakdown, self.zero_config, self.world_size, self._reporter.peak,
                         units_of(self.sharder), self.comm.comm_stats())

    def gradient_clipping(self) -> float:
        """The norm gradients are clipped to at each step (0.0: none; 1.0 when the config is silent)."""
        return self.settings.clipping()

    def train_batch_size(self) -> int:
        return self.settings.train_batch_size  # type: ignore[return-value]  # resolved by initialize

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.settings.train_micro_batch_size_per_gpu  # type: ignore[return-value]

    def gradient_accumulation_steps(self) -> int:
        return self.settings.gradient_accumulation_steps  # type: ignore[return-value]

    def fp16_enabled(self) -> bool:
        return self.precision.precision == "16-mixed"

    def bfloat16_enabled(self) -> bool:
        return self.precision.precision == "bf16-mixed"

    def torch_autocast_enabled(self) -> bool:
        return self.precision.autocast_dtype is not None

    def torch_autocast_dtype(self) -> Optional[torch.dtype]:
        return self.precision.autocast_dtype

    def zero_optimization_stage(self) -> int:
        """The config's stage (0 runs as stage 1: see [Note: stage 0])."""
        return int(self.settings.strategy["stage"])

    def _need_optimizer(self, call: str) -> ZeroOptimizer:
        if self.optimizer is None:
            raise RuntimeError(f"{call}(): this engine has no optimizer (initialize got no optimizer= and the config "
                               "has no \"optimizer\" section), so it can only evaluate; pass one to initialize().")
        return self.optimizer

    # ---- checkpoints (engine_checkpoint.py) -------------------------------------------------

    def save_checkpoint(self, save_dir: Any, tag: Any = None, client_state: Optional[dict] = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Write ``save_dir/<tag>/`` (default tag ``global_step<N>``) as a sharded checkpoint, every rank
        its own part, and ``save_dir/latest`` naming the tag. A collective; see engine_checkpoint.py."""
        return engine_checkpoint.save(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: Any, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[Any, Any]:
        """Load ``load_dir/<tag>`` (the tag ``latest`` names by default), saved by this engine at any
        world size and stage, or by DeepSpeed; returns ``(path, client_state)``, or ``(None, None)``
        with a warning when ``load_dir`` has no ``latest`` file (as DeepSpeed). A collective."""
        return engine_checkpoint.load(self, load_dir, tag, load_module_strict, load_optimizer_states,
                                      load_lr_scheduler_states, load_module_only, custom_load_fn)

    def save_16bit_model(self, save_dir: Any, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Rank 0 writes the whole model's state dict, in the working dtype (fp32, bf16 or fp16), to
        ``save_dir/save_filename`` with torch.save; returns True. A collective (stage 3 gathers it unit
        by unit), so every rank calls it; unlike DeepSpeed, stage 3 saves without
        ``stage3_gather_16bit_weights_on_model_save``, the gather costing one unit's memory at a time."""
        return engine_checkpoint.save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def save_pretrained(self, save_directory: Any, **options: Any) -> Any:
        """Write the model in the Hugging Face layout from rank 0, one tensor gathered at a time; options as
        ``zero_strategy.frontend.pretrained.save_pretrained``. A collective: call it on every rank."""
        return save_pretrained(self.engine_model, save_directory, **options)

    def destroy(self) -> None:
        """Wait for a checkpoint being saved in the background, remove the engine's hooks from the model
        and delete disk-offload files."""
        self.engine_model.finish_saves()
        if self.optimizer is not None:
            self.optimizer.remove_hooks()
            self.optimizer.close()
        if self.sharder is not None:
            self.sharder.remove_hooks()


def _at_boundary(engine: "weakref.ref[ZeroEngine]") -> bool:
    """Whether the backward starting now is the one before an optimizer step (an engine gone: yes)."""
    target = engine()
    return target is None or target.is_gradient_accumulation_boundary()


def initialize(args: Any = None, model: Optional[nn.Module] = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = DEFAULT_PORT, mpu: Any = None, dist_init_required: Optional[bool] = None,
               collate_fn: Any = None, config: Any = None, mesh_param: Any = None,
               config_params: Any = None) -> tuple[ZeroEngine, Optional[ZeroOptimizer], Any, Any]:
    """DeepSpeed's ``initialize``, on this package's engine: returns ``(engine, optimizer,
    training_dataloader, lr_scheduler)``.

    ``config`` is a DeepSpeed config (a dict or a JSON file's path; or ``args.deepspeed_config``)
    mapped as ``map_deepspeed_config`` maps it: ZeRO stage 0-3 (0 runs as 1: [Note: stage 0]),
    offload, fp16 (with DeepSpeed's loss scaling) or bf16 weights with fp32 master shards, clipping,
    batch sizes, optimizer and scheduler. ``optimizer`` is a torch optimizer or a callable taking
    ``model_parameters`` (parameters or param-group dicts; the model's by default); without one the
    config's ``"optimizer"`` is built. ``lr_scheduler`` is a scheduler built on ``optimizer``, or a
    callable taking the engine's optimizer; else the config's ``"scheduler"``. ``training_data`` (a
    map-style Dataset) gives a DataLoader of the micro batch size with a DistributedSampler.
    Starts the process group if none runs (``init_distributed``). The returned optimizer is the
    ZeroOptimizer (None without one), sharing its param groups with the one given.
    """
    if model is None:
        raise ValueError("initialize(model=...) is required: pass the torch.nn.Module to train.")
    if mpu is not None or mesh_param is not None:
        raise ValueError("initialize(mpu=..., mesh_param=...): model, tensor and sequence parallelism are not "
                         "supported; this package is data parallel (ZeRO) only. Drop the argument.")
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    config = resolve_config(config, config_params, args)
    settings = map_deepspeed_config(config, world_size=dist.get_world_size(), front_end="initialize")
    check_batch_sizes(settings)
    stage = int(settings.strategy["stage"])
    # broadcast_buffers=False: DeepSpeed's engine broadcasts the parameters once (_broadcast_model) and the
    # buffers never, so a ported script keeps each rank's own (see [Note: buffers kept in step])
    # the FLOPs and latencies of DeepSpeed's reports are the step breakdown's (see [Note: DeepSpeed's reports])
    timed = {"step_breakdown": True} if settings.reporting.wall_clock_breakdown else {}
    zero_config = ZeroConfig(**{**settings.strategy, "stage": max(stage, 1), "broadcast_buffers": False, **timed})
    comm = Collectives(collective_timeout=zero_config.collective_timeout)
    rank_here = local_rank_from_arguments(args)  # see [Note: args.local_rank] in deepspeed/arguments.py
    rank_here = local_rank() if rank_here is None else rank_here
    record_local_rank(args, rank_here)
    device = engine_device(rank_here)
    precision = WorkingPrecision(settings.precision or "32-true", **settings.precision_kwargs,
                                 **autocast_kwargs(settings.autocast, device, settings.precision))

    def build() -> list[torch.optim.Optimizer]:  # after the dtype and the device, as DeepSpeed builds it
        built = build_optimizer(model, optimizer, model_parameters, settings)
        return [built] if built is not None else []

    engine_model = setup_engine(model, zero_config, precision, comm, device, build)  # see [Note: the order of setup]
    engine_optimizer = engine_model.optimizers[0] if engine_model.optimizers else None
    scheduler = build_scheduler(lr_scheduler, optimizer if isinstance(optimizer, torch.optim.Optimizer) else None,
                                engine_optimizer, settings)
    loader = build_dataloader(training_data, collate_fn, settings, comm, device)
    engine = ZeroEngine(engine_model, settings, config, rank_here, scheduler)
    if comm.rank == 0:
        log.info("initialize: ZeRO stage %d%s, %s, %d rank(s). %s", stage, " (run as stage 1)" if stage == 0 else "",
                 precision.precision, comm.world_size, settings.log_summary())
    return engine, engine_optimizer, loader, scheduler
