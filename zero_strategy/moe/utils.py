"""``deepspeed.moe.utils``: no parameter is an expert's here; splitting groups for experts raises."""

from typing import Any

from ..deepspeed.unsupported import MOE, UnsupportedFeature, module_getattr


def is_moe_param(param: Any) -> bool:
    """False: no parameter belongs to an expert-parallel layer here (there are none)."""
    return False


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, *args: Any, **kwargs: Any) -> Any:
    raise UnsupportedFeature(f"deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer: {MOE}")


__getattr__ = module_getattr("deepspeed.moe.utils", MOE)
