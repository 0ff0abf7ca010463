"""The precision plugin Lightning talks to when it trains with ZeroStrategy.

[Note: precision]
"bf16-mixed" and "16-mixed" here mean what they mean in ZeRO, not autocast: the module's weights
and gradients are bf16/fp16 (half the memory and communication), and each rank keeps an fp32
master copy of its shard, which the optimizer updates. fp16 scales the loss (see LossScaler).
"bf16-true" and "16-true" keep no fp32 copy at all. Floating-point inputs are cast to the
weights' dtype.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Generator, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.optim import Optimizer

from .engine import LossScaler, ZeroOptimizer
from .memory import PRECISION_DTYPES, has_master_weights

SUPPORTED_PRECISION = tuple(PRECISION_DTYPES)  # see [Note: precision names] in memory.py


def _engine(optimizer: Any) -> Optional[ZeroOptimizer]:
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps it
    return optimizer if isinstance(optimizer, ZeroOptimizer) else None


class ZeroPrecision(Precision):
    """Precision for ZeRO: low-precision working weights with fp32 master shards (see
    [Note: precision]), fp16 loss scaling, and gradients reduced before clipping sees them.

    Lightning's own plugin runs ``on_before_optimizer_step`` and clipping right after backward;
    at stage 1 the gradients are not reduced yet then, and at stages 2 and 3 no parameter holds a
    full gradient. So the closure reduces (and unscales) first, and clipping goes through the
    engine, which computes the norm over all ranks' shards.

    fp16 loss scaling takes DeepSpeed's knobs: ``loss_scale`` (0: dynamic, else a static scale),
    ``initial_scale_power``, ``loss_scale_window``, ``hysteresis`` and ``min_loss_scale``.
    """

    def __init__(self, precision: str = "32-true", loss_scale: float = 0.0, initial_scale_power: int = 16,
                 loss_scale_window: int = 1000, hysteresis: int = 2, min_loss_scale: float = 1.0) -> None:
        if precision not in PRECISION_DTYPES:
            raise ValueError(f"precision={precision!r} is not supported by ZeroStrategy; supported: "
                             f"{', '.join(SUPPORTED_PRECISION)}.")
        self.precision = precision  # type: ignore[assignment]
        self.dtype = PRECISION_DTYPES[precision]
        self.scaler: Optional[LossScaler] = None
        if precision == "16-mixed":
            dynamic = loss_scale == 0
            self.scaler = LossScaler(scale=2.0**initial_scale_power if dynamic else float(loss_scale),
                                     dynamic=dynamic, window=loss_scale_window, hysteresis=hysteresis,
                                     min_scale=min_loss_scale)

    @property
    def master_weights(self) -> bool:
        """Whether the optimizer keeps fp32 copies of low-precision weights."""
        return has_master_weights(self.precision)

    # ---- dtypes of the module, its inputs and outputs --------------------------------------

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.dtype is not torch.float32:
            module.to(self.dtype)  # floating-point parameters and buffers; in place, keeps Parameter objects
        return module

    @contextmanager
    def module_init_context(self) -> Generator[None, None, None]:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)

    def convert_input(self, data: Any) -> Any:
        return apply_to_collection(data, Tensor, lambda t: t.to(self.dtype) if t.is_floating_point() else t)

    # ---- backward and step -----------------------------------------------------------------

    def pre_backward(self, tensor: Tensor, module: "pl.LightningModule") -> Tensor:
        tensor = super().pre_backward(tensor, module)
        return self.scaler.scale_loss(tensor) if self.scaler is not None else tensor

    def _wrap_closure(self, model: "pl.LightningModule", optimizer: Optimizer, closure: Callable[[], Any]) -> Any:
        closure_result = closure()
        engine = _engine(optimizer)
        if engine is not None:
            engine.reduce_gradients()
        self._after_closure(model, optimizer)
        return closure_result

    def optimizer_step(self, optimizer: Optimizer, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        result = super().optimizer_step(optimizer, model, closure, **kwargs)
        if self.scaler is not None and isinstance(model, pl.LightningModule) and model._trainer is not None:
            model.log("loss_scale", self.scaler.scale, rank_zero_only=True)
            model.log("skipped_steps", float(self.scaler.skipped_steps), rank_zero_only=True)
        return result

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        engine = _engine(optimizer)
        if engine is None:
            return super().clip_grad_by_norm(optimizer, clip_val)
        if not engine.overflowed:  # the step is skipped anyway; an inf norm would poison the gradients
            engine.clip_grad_norm_(float(clip_val))

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        engine = _engine(optimizer)
        if engine is None:
            return super().clip_grad_by_value(optimizer, clip_val)
        engine.clip_grad_value_(float(clip_val))

    # ---- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"loss_scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and "loss_scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scaler"])


def to_zero_precision(plugin: Optional[Precision]) -> Optional[ZeroPrecision]:
    """Replace the generic plugin Lightning picked for ``precision=...``; reject what we cannot do."""
    if plugin is None or isinstance(plugin, ZeroPrecision):
        return plugin
    name = str(getattr(plugin, "precision", type(plugin).__name__))
    if type(plugin).__name__ in ("Precision", "MixedPrecision", "HalfPrecision") and name in PRECISION_DTYPES:
        return ZeroPrecision(name)
    raise ValueError(
        f"ZeroStrategy does not support precision={name!r} ({type(plugin).__name__}); supported: "
        f"{', '.join(SUPPORTED_PRECISION)}. Pass Trainer(precision=...) one of those."
    )
