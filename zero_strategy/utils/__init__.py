"""``zero_strategy.utils``, as ``deepspeed.utils``: ``zero_to_fp32`` (a checkpoint's fp32 weights)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["zero_to_fp32"]


def __getattr__(name: str) -> Any:
    if name == "zero_to_fp32":
        return importlib.import_module(f"{__name__}.zero_to_fp32")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}; this package has {__all__} of "
                         "deepspeed.utils (for a whole parameter at stage 3 use zero_strategy.zero.GatheredParameters).")
