"""``zero_strategy.moe``, as ``deepspeed.moe``: not supported; every name says so when used (see
zero_strategy/deepspeed/unsupported.py)."""

from ..deepspeed.unsupported import MOE, module_getattr
from . import layer, utils  # noqa: F401 - deepspeed.moe.layer.MoE and deepspeed.moe.utils.* are reached as attributes

__getattr__ = module_getattr("deepspeed.moe", MOE)
