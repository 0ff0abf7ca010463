"""``EngineModel``: a module on the engine, as every front end holds it after set-up (setup.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ..activation import remove_activation_offload
from ..checkpoint.background import BackgroundSaver
from ..checkpoint.sharded import flat_groups
from ..config import ZeroConfig
from ..engine import Collectives, FlatParameters, ZeroOptimizer
from ..engine.buffers.flat import FlatGroup
from ..engine.params.attached import detach_hook
from ..engine.params.buffer_sync import BufferBroadcast
from .precision import WorkingPrecision


@dataclass
class EngineModel:
    """A module on the engine and what a front end needs of it afterwards: its sharder (the owner
    of its flat groups, None at stages 1-2 until there are optimizers), its ZeroOptimizers, and the
    precision, settings and collectives they were built with."""

    module: nn.Module
    config: ZeroConfig  # master_weights as ``precision`` says
    precision: WorkingPrecision
    comm: Collectives
    device: torch.device
    sharder: Optional[FlatParameters] = None
    optimizers: list[ZeroOptimizer] = field(default_factory=list)
    saver: Optional[BackgroundSaver] = None  # with async_save: see [Note: saving in the background]
    buffer_sync: Optional[BufferBroadcast] = None  # with broadcast_buffers: see [Note: buffers kept in step]
    hooks: list = field(default_factory=list)  # (module, handle) of the step breakdown's forward hooks

    @property
    def stage(self) -> int:
        return self.config.stage

    @property
    def groups(self) -> list[FlatGroup]:
        """Every flat group of the module's parameters (see [Note: one owner of the flat groups])."""
        return flat_groups(self.optimizers, self.sharder)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's whole state dict on every rank: at stage 3 gathered unit by unit (a
        collective), as CPU copies; at stages 1-2 the module's own."""
        if self.sharder is not None and self.stage == 3:
            return self.sharder.full_state_dict()
        return self.module.state_dict()

    def finish_saves(self) -> None:
        """Wait for a checkpoint being written in the background; raise what it failed with."""
        if self.saver is not None:
            self.saver.wait()

    def remove_hooks(self) -> None:
        for opt in self.optimizers:
            opt.remove_hooks()
        if self.sharder is not None:
            self.sharder.remove_hooks()
        if self.buffer_sync is not None:
            self.buffer_sync.remove_hooks()
        for module, handle in self.hooks:
            detach_hook(module, handle)
        self.hooks.clear()
        self.comm.breakdown.unwatch(self.module)
        remove_activation_offload(self.module)
