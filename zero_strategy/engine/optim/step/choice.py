"""Which step backend a ZeroOptimizer gets, and building it (see [Note: step backends] in engine/optim/step/backend.py).

The choice is made once, from the modes in the config and whether the CUDA kernels run on the
pieces' device (``choose_step_backend``); the chosen class then says how the pieces and the inner
optimizer are built (``build_stepped``), and is constructed over them (``build_step_backend``).
"""

from __future__ import annotations

from typing import Any

import torch

from .... import kernels
from ....config import ZeroConfig
from ...buffers.flat import FlatGroup
from ..checks import ELEMENTWISE_OPTIMIZERS, constructor_kwargs, needs_whole_parameters
from .backend import StepBackend, Stepped, master_dtypes
from .cpu_tiles import CpuTilesStep
from .disk import DiskStep
from .fused import FusedStep
from .host import HostTilesStep
from .lowp import LowPrecisionHostStep, LowPrecisionStep
from .overlap import OverlappedStep
from .torch_step import TorchStep
from .whole import WholeParameterStep


def choose_step_backend(config: ZeroConfig, cls: type, device: torch.device) -> type[StepBackend]:
    """The step backend for ``config`` and an optimizer class ``cls`` stepping pieces on ``device``."""
    if needs_whole_parameters(cls, config):  # the modes it cannot combine with are refused in checks.py
        return WholeParameterStep
    if config.offload_overlap:
        return OverlappedStep
    if config.offload_dir is not None:
        return DiskStep
    if config.low_precision_step:  # see [Note: the low-precision step] in engine/optim/step/lowp.py
        return LowPrecisionHostStep if config.offload_optimizer else LowPrecisionStep
    if config.offload_optimizer:
        return HostTilesStep
    if kernels.available(torch.empty(0, device=device)):
        return FusedStep
    return _torch_backend(cls, device)


def _torch_backend(cls: type, device: torch.device) -> type[TorchStep]:
    """torch's update: in tiles on CPU, for torch's own classes (see [Note: the CPU step in tiles])."""
    return CpuTilesStep if device.type == "cpu" and cls in ELEMENTWISE_OPTIMIZERS else TorchStep


def build_stepped(backend: type[StepBackend], optimizer: torch.optim.Optimizer, groups: list[FlatGroup],
                  device: torch.device, rank: int) -> Stepped:
    """What ``backend`` steps for ``optimizer`` over its flat ``groups``: each piece's tensor (as the
    backend builds it) and user param group, and the inner optimizer, the user's class re-created over
    those tensors with the backend's options."""
    cls = type(optimizer)
    dtypes = master_dtypes(groups) if backend.on_host else []
    user_group_of = {p: gi for gi, group in enumerate(optimizer.param_groups) for p in group["params"]}
    inner_groups = [backend.group_options(cls, {**user_group, "params": []}, dtypes)
                    for user_group in optimizer.param_groups]
    tensors, user_groups = [], []  # per group, the inner optimizer's tensor and param group of each piece
    for g in groups:
        tensors.append(backend.pieces_of(g))
        user_groups.append([user_group_of[g.params[piece.param]] for piece in g.pieces])
        for t, gi in zip(tensors[-1], user_groups[-1]):
            inner_groups[gi]["params"].append(t)
    kwargs = backend.options(cls, constructor_kwargs(cls, optimizer.defaults), dtypes)
    return Stepped(groups, tensors, user_groups, backend.build_inner(cls, inner_groups, kwargs), kwargs, device, rank)


def build_step_backend(backend: type[StepBackend], stepped: Stepped, config: ZeroConfig, owner: Any) -> StepBackend:
    """``backend`` over ``stepped``; ``owner``: a weak proxy of the ZeroOptimizer (the gradient hooks
    hold the backend's listener, which must not keep the optimizer alive)."""
    if backend is FusedStep:  # what the kernels do not take over steps as torch's update would
        return FusedStep(stepped, config, owner, fallback=_torch_backend(stepped.cls, stepped.device)(
            stepped, config, owner))
    return backend(stepped, config, owner)
