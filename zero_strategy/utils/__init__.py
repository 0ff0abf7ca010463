"""``zero_strategy.utils``, as ``deepspeed.utils``: ``zero_to_fp32`` (a checkpoint's fp32 weights)."""

from ..deepspeed.unsupported import module_getattr
from . import zero_to_fp32

__all__ = ["zero_to_fp32"]

__getattr__ = module_getattr("deepspeed.utils", "of deepspeed.utils this package has only utils.zero_to_fp32 (for a "
                                                "whole parameter at stage 3 use zero_strategy.zero.GatheredParameters).")
