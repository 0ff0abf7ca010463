"""The precision of ZeRO training, the same object for every front end (no Lightning import here:
only ``lightning_utilities``' ``apply_to_collection``, a small package Lightning depends on).

[Note: precision]
"bf16-mixed" and "16-mixed" here mean what they mean in ZeRO, not autocast: the module's weights
and gradients are bf16/fp16 (half the memory and communication), and each rank keeps an fp32
master copy of its shard, which the optimizer updates. fp16 scales the loss (see LossScaler).
"bf16-true" and "16-true" keep no fp32 copy at all. Floating-point inputs are cast to the
weights' dtype. The names are Lightning's (see [Note: precision names] in memory.py), whichever
front end is used: the Trainer's ZeroPrecision and Fabric's ZeroFabricPrecision each hold a
``WorkingPrecision`` and hand everything but Lightning's hooks to it, and ``initialize`` uses one
directly.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from ..engine import LossScaler
from ..memory import PRECISION_DTYPES, has_master_weights

SUPPORTED_PRECISION = tuple(PRECISION_DTYPES)  # see [Note: precision names] in memory.py
STATE_KEY = "ZeroPrecision"
"""Where a checkpoint keeps the precision's state (the loss scaler): the key Lightning gives the
Trainer's plugin (its class name), so that the Trainer, Fabric and ``initialize`` read each other's."""


class WorkingPrecision:
    """The working weights' dtype, whether fp32 master copies are kept, and the fp16 loss scaler.

    fp16 loss scaling takes DeepSpeed's knobs: ``loss_scale`` (0: dynamic, else a static scale),
    ``initial_scale_power``, ``loss_scale_window``, ``hysteresis`` and ``min_loss_scale``.
    """

    def __init__(self, precision: str = "32-true", loss_scale: float = 0.0, initial_scale_power: int = 16,
                 loss_scale_window: int = 1000, hysteresis: int = 2, min_loss_scale: float = 1.0,
                 autocast_dtype: Optional[torch.dtype] = None) -> None:
        if precision not in PRECISION_DTYPES:
            raise ValueError(f"precision={precision!r} is not supported by ZeRO training (ZeroStrategy, "
                             f"ZeroFabricStrategy, initialize); supported: {', '.join(SUPPORTED_PRECISION)}.")
        self.precision = precision
        self.dtype: torch.dtype = PRECISION_DTYPES[precision]
        self.scaler: Optional[LossScaler] = None
        # [Note: the autocast mode] (DeepSpeed's torch_autocast, see deepspeed/autocast.py): the forward under
        # torch.autocast(autocast_dtype), over fp32 weights, gradients and optimizer ("32-true"), where fp16
        # scales the loss as torch's GradScaler does (2**16, halved at each overflow, doubled after 2000 clean
        # steps); or over bf16 weights ("bf16-mixed"/"bf16-true", DeepSpeed's bf16 with torch_autocast) in bf16
        self.autocast_dtype = autocast_dtype
        if autocast_dtype is not None:
            allowed = {"32-true": (torch.bfloat16, torch.float16), "bf16-mixed": (torch.bfloat16,),
                       "bf16-true": (torch.bfloat16,)}
            if autocast_dtype not in allowed.get(precision, ()):
                raise ValueError(f"autocast_dtype={autocast_dtype} with precision={precision!r}: the autocast mode "
                                 "autocasts fp32 weights (precision '32-true') to bfloat16 or float16, and bf16 "
                                 "weights ('bf16-mixed', 'bf16-true') to bfloat16 only. Autocast to bfloat16, or keep "
                                 "fp32 weights.")
            if autocast_dtype == torch.float16:
                self.scaler = LossScaler(scale=2.0**16, window=2000, hysteresis=1, min_scale=2.0**-24)
        if precision == "16-mixed":
            dynamic = loss_scale == 0
            self.scaler = LossScaler(scale=2.0**initial_scale_power if dynamic else float(loss_scale),
                                     dynamic=dynamic, window=loss_scale_window, hysteresis=hysteresis,
                                     min_scale=min_loss_scale)

    def __repr__(self) -> str:
        autocast = f", autocast_dtype={self.autocast_dtype}" if self.autocast_dtype is not None else ""
        return f"WorkingPrecision({self.precision!r}{autocast})"

    def autocast(self, device_type: str) -> Any:
        """The forward's context: ``torch.autocast`` in the autocast mode, else nothing."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.autocast_dtype)

    @property
    def master_weights(self) -> bool:
        """Whether the optimizer keeps fp32 copies of low-precision weights."""
        return has_master_weights(self.precision)

    # ---- dtypes of the module, its inputs and new tensors -----------------------------------

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Floating-point parameters and buffers to the working dtype, in place (the Parameter
        objects stay, so optimizers built before still hold them; meta tensors stay on meta)."""
        if self.dtype is not torch.float32:
            module.to(self.dtype)
        return module

    @contextlib.contextmanager
    def default_dtype(self) -> Iterator[None]:
        """Floating-point tensors created inside default to the working dtype."""
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)

    def convert_input(self, data: Any) -> Any:
        """Floating-point tensors in ``data`` (any nesting of collections) cast to the working dtype."""
        return apply_to_collection(data, Tensor, lambda t: t.to(self.dtype) if t.is_floating_point() else t)

    # ---- backward --------------------------------------------------------------------------

    def scale_loss(self, loss: Tensor) -> Tensor:
        """``loss`` times the fp16 loss scale (in fp32), or ``loss`` itself without a scaler."""
        return self.scaler.scale_loss(loss) if self.scaler is not None else loss

    # ---- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"loss_scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict.get("loss_scaler"):
            self.scaler.load_state_dict(state_dict["loss_scaler"])


class WorkingPrecisionPlugin:
    """What the Trainer's and Fabric's precision plugins (ZeroPrecision, ZeroFabricPrecision) share: a
    ``WorkingPrecision`` built from DeepSpeed's fp16 loss-scaling knobs, which converts the module and
    the inputs and holds the loss scaler's state. Put before the Lightning base class."""

    def __init__(self, precision: str = "32-true", loss_scale: float = 0.0, initial_scale_power: int = 16,
                 loss_scale_window: int = 1000, hysteresis: int = 2, min_loss_scale: float = 1.0) -> None:
        self.working = WorkingPrecision(precision, loss_scale, initial_scale_power, loss_scale_window, hysteresis,
                                        min_loss_scale)
        self.precision = precision

    def convert_module(self, module: nn.Module) -> nn.Module:
        return self.working.convert_module(module)

    def convert_input(self, data: Any) -> Any:
        return self.working.convert_input(data)

    def state_dict(self) -> dict[str, Any]:
        return self.working.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.working.load_state_dict(state_dict)


def generic_precision_name(plugin: Any, strategy: str, how: str) -> str:
    """The precision of the generic plugin Lightning picks for ``precision=...`` (``Precision``,
    ``MixedPrecision``, ``HalfPrecision``, ``DoublePrecision``), which a front end replaces by its own ZeRO plugin; an error
    naming the plugin, ``strategy`` and what is supported (``how`` to ask for one) for anything else."""
    name = str(getattr(plugin, "precision", type(plugin).__name__))
    if type(plugin).__name__ in ("Precision", "MixedPrecision", "HalfPrecision", "DoublePrecision") \
            and name in PRECISION_DTYPES:
        return name
    raise ValueError(f"{strategy} does not support precision={name!r} ({type(plugin).__name__}); supported: "
                     f"{', '.join(SUPPORTED_PRECISION)}. {how}")
