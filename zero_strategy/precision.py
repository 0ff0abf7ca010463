"""The precision plugin Lightning's Trainer talks to when it trains with ZeroStrategy: Lightning's
hooks around the shared ``WorkingPrecision`` (see [Note: precision] in frontend/precision.py)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Generator, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.optim import Optimizer

from .engine import LossScaler, ZeroOptimizer
from .frontend import SUPPORTED_PRECISION, clip_grad_norm, clip_grad_value
from .frontend.precision import WorkingPrecisionPlugin, generic_precision_name

__all__ = ["SUPPORTED_PRECISION", "ZeroPrecision", "to_zero_precision"]


def _engine(optimizer: Any) -> Optional[ZeroOptimizer]:
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps it
    return optimizer if isinstance(optimizer, ZeroOptimizer) else None


class ZeroPrecision(WorkingPrecisionPlugin, Precision):
    """Precision for ZeRO: low-precision working weights with fp32 master shards (see
    [Note: precision]), fp16 loss scaling, and gradients reduced before clipping sees them.

    Lightning's own plugin runs ``on_before_optimizer_step`` and clipping right after backward;
    at stage 1 the gradients are not reduced yet then, and at stages 2 and 3 no parameter holds a
    full gradient. So the closure reduces (and unscales) first, and clipping goes through the
    engine, which computes the norm over all ranks' shards.

    fp16 loss scaling takes DeepSpeed's knobs: ``loss_scale`` (0: dynamic, else a static scale),
    ``initial_scale_power``, ``loss_scale_window``, ``hysteresis`` and ``min_loss_scale``.
    """

    @property
    def dtype(self) -> torch.dtype:
        return self.working.dtype

    @property
    def scaler(self) -> Optional[LossScaler]:
        return self.working.scaler

    @property
    def master_weights(self) -> bool:
        """Whether the optimizer keeps fp32 copies of low-precision weights."""
        return self.working.master_weights

    # ---- dtypes of the module, its inputs and outputs --------------------------------------

    @contextmanager
    def module_init_context(self) -> Generator[None, None, None]:
        with self.working.default_dtype():
            yield

    # ---- backward and step -----------------------------------------------------------------

    def pre_backward(self, tensor: Tensor, module: "pl.LightningModule") -> Tensor:
        return self.working.scale_loss(super().pre_backward(tensor, module))

    def _wrap_closure(self, model: "pl.LightningModule", optimizer: Optimizer, closure: Callable[[], Any]) -> Any:
        closure_result = closure()
        engine = _engine(optimizer)
        if engine is not None:
            engine.reduce_gradients()
        self._after_closure(model, optimizer)
        return closure_result

    def optimizer_step(self, optimizer: Optimizer, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        result = super().optimizer_step(optimizer, model, closure, **kwargs)
        scaler = self.scaler
        if scaler is not None and isinstance(model, pl.LightningModule) and model._trainer is not None:
            model.log("loss_scale", scaler.scale, rank_zero_only=True)
            model.log("skipped_steps", float(scaler.skipped_steps), rank_zero_only=True)
        return result

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        engine = _engine(optimizer)
        if engine is None:
            return super().clip_grad_by_norm(optimizer, clip_val)
        clip_grad_norm(engine, clip_val)

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        engine = _engine(optimizer)
        if engine is None:
            return super().clip_grad_by_value(optimizer, clip_val)
        clip_grad_value(engine, clip_val)


def to_zero_precision(plugin: Optional[Precision]) -> Optional[ZeroPrecision]:
    """Replace the generic plugin Lightning picked for ``precision=...``; reject what we cannot do."""
    if plugin is None or isinstance(plugin, ZeroPrecision):
        return plugin
    return ZeroPrecision(generic_precision_name(plugin, "ZeroStrategy", "Pass Trainer(precision=...) one of those."))
