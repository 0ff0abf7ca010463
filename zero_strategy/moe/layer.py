"""``deepspeed.moe.layer``: ``MoE`` raises when built (see zero_strategy/deepspeed/unsupported.py)."""

from ..deepspeed.unsupported import MOE, module_getattr, refusing

MoE = refusing("deepspeed.moe.layer.MoE", MOE)
__getattr__ = module_getattr("deepspeed.moe.layer", MOE)
