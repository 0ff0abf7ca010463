"""The precision plugin Lightning talks to when it trains with ZeroStrategy."""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer

from .engine import ZeroOptimizer

SUPPORTED_PRECISION = ("32-true",)


def _engine(optimizer: Any) -> Optional[ZeroOptimizer]:
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps it
    return optimizer if isinstance(optimizer, ZeroOptimizer) else None


class ZeroPrecision(Precision):
    """fp32 training with ZeRO: gradients are reduced before clipping, and clipping sees every shard.

    Lightning's own plugin runs ``on_before_optimizer_step`` and clipping right after backward;
    at stage 1 the gradients are not reduced yet then, and at stage 2 no parameter holds a full
    gradient. So the closure reduces first, and clipping goes through the engine, which computes
    the norm over all ranks' shards.
    """

    precision = "32-true"

    def _wrap_closure(self, model: "pl.LightningModule", optimizer: Optimizer, closure: Callable[[], Any]) -> Any:
        closure_result = closure()
        engine = _engine(optimizer)
        if engine is not None:
            engine.reduce_gradients()
        self._after_closure(model, optimizer)
        return closure_result

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        engine = _engine(optimizer)
        if engine is None:
            return super().clip_grad_by_norm(optimizer, clip_val)
        engine.clip_grad_norm_(float(clip_val))

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        engine = _engine(optimizer)
        if engine is None:
            return super().clip_grad_by_value(optimizer, clip_val)
        engine.clip_grad_value_(float(clip_val))


def to_zero_precision(plugin: Optional[Precision]) -> Optional[ZeroPrecision]:
    """Replace the generic plugin Lightning picked for ``precision=...``; reject what we cannot do."""
    if plugin is None or isinstance(plugin, ZeroPrecision):
        return plugin
    if type(plugin) is Precision:  # what Lightning gives any strategy for "32-true"
        return ZeroPrecision()
    name = getattr(plugin, "precision", type(plugin).__name__)
    raise ValueError(
        f"ZeroStrategy does not support precision={name!r} ({type(plugin).__name__}) yet; supported: "
        f"{', '.join(SUPPORTED_PRECISION)}. Use Trainer(precision='32-true')."
    )
