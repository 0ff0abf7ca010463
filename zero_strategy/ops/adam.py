"""``zero_strategy.ops.adam``, as ``deepspeed.ops.adam`` (see zero_strategy/deepspeed/adam.py)."""

from ..deepspeed.adam import DeepSpeedCPUAdam, FusedAdam  # noqa: F401

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
