"""A DeepSpeed config given to ZeroStrategy (``ZeroStrategy(config="ds.json")``): what it sets.

The mapping itself is ``map_deepspeed_config`` in config.py beside this (no Lightning); this module
is the Lightning side of it (only strategy.py imports it), applied at three moments:

- construction: the engine settings (stage, offload, buckets, stage-3 options) and, when the config
  enables fp16 or bf16, the precision plugin with DeepSpeed's loss-scaling knobs. A ZeroStrategy
  argument given explicitly with another value than the config's is an error naming both. This part
  is shared with ZeroFabricStrategy: ``engine_settings`` in frontend/options.py.
- setup: the Trainer's accumulation, clipping and precision are checked against the config (an
  error naming both values when they disagree), and the config's values the Trainer does not have
  are applied to it (accumulation, clipping by norm: DeepSpeed clips at 1.0 when the config does not
  say, unless the Trainer does); the optimizer and LR scheduler of the config are built when
  ``configure_optimizers`` gives none.
- the start of training: the training DataLoader's batch size against the config's micro batch.
"""

from __future__ import annotations

import logging

import lightning.pytorch as pl
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.types import LRSchedulerConfig

from .config import DeepSpeedConfigError, DeepSpeedSettings, check_against_trainer, resolve_batch_sizes
from ..frontend.options import DeepSpeedConfig, engine_settings

__all__ = ["DeepSpeedConfig", "apply_to_trainer", "check_batch_size", "engine_settings", "optimizers_from_config"]

log = logging.getLogger(__name__)

def apply_to_trainer(settings: DeepSpeedSettings, trainer: "pl.Trainer", world_size: int) -> None:
    """Check the Trainer against the config, then give it the config's accumulation and clipping."""
    connector = getattr(trainer, "_accelerator_connector", None)
    check_against_trainer(settings, accumulate_grad_batches=trainer.accumulate_grad_batches,
                          gradient_clip_val=trainer.gradient_clip_val,
                          precision=getattr(connector, "_precision_flag", None), micro_batch_size=None,
                          world_size=world_size)
    _, _, steps = resolve_batch_sizes(settings.train_batch_size, settings.train_micro_batch_size_per_gpu,
                                      settings.gradient_accumulation_steps, world_size)
    if steps is not None:
        trainer.accumulate_grad_batches = steps
    clip = settings.clipping(trainer.gradient_clip_val) or None  # the config's, the Trainer's, or DeepSpeed's 1.0
    if clip != trainer.gradient_clip_val:
        trainer.gradient_clip_val = clip
        trainer.gradient_clip_algorithm = GradClipAlgorithmType.NORM
    if trainer.global_rank == 0:
        log.info(settings.log_summary())


def check_batch_size(settings: DeepSpeedSettings, trainer: "pl.Trainer", world_size: int) -> None:
    """At the start of training: the DataLoader's batch size is the config's micro batch."""
    loader = trainer.train_dataloader
    batch_size = getattr(loader, "batch_size", None)
    if batch_size is not None:
        check_against_trainer(settings, accumulate_grad_batches=None, gradient_clip_val=None, precision=None,
                              micro_batch_size=batch_size, world_size=world_size)


def optimizers_from_config(settings: DeepSpeedSettings, module: "pl.LightningModule", optimizers: list,
                           schedulers: list) -> tuple[list, list]:
    """The config's optimizer (and scheduler, stepped every optimizer step) when ``configure_optimizers``
    gave none; the module's own otherwise, and an error when both give one."""
    mine = [opt for opt in optimizers if not isinstance(opt, _MockOptimizer)]
    if settings.optimizer is None:
        return optimizers, schedulers
    if mine:
        raise DeepSpeedConfigError(
            f"both the DeepSpeed config (optimizer {settings.optimizer.optimizer_class.__name__}) and "
            f"{type(module).__name__}.configure_optimizers ({', '.join(type(o).__name__ for o in mine)}) give an "
            "optimizer; keep one: remove the config's \"optimizer\" section, or return None from configure_optimizers.")
    optimizer = settings.optimizer([p for p in module.parameters() if p.requires_grad], module=module)
    if settings.scheduler is None:
        return [optimizer], []
    return [optimizer], [LRSchedulerConfig(settings.scheduler(optimizer), interval="step")]
