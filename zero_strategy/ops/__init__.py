"""``zero_strategy.ops``, as ``deepspeed.ops``: ``adam`` (FusedAdam, DeepSpeedCPUAdam as torch's Adam)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["adam"]


def __getattr__(name: str) -> Any:
    if name == "adam":
        return importlib.import_module(f"{__name__}.adam")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}: of deepspeed.ops this package has only "
                         "ops.adam (FusedAdam, DeepSpeedCPUAdam); use torch.optim for other optimizers.")
