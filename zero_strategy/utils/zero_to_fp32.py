"""``zero_strategy.utils.zero_to_fp32``, as ``deepspeed.utils.zero_to_fp32`` (see
zero_strategy/deepspeed/zero_to_fp32.py)."""

from ..deepspeed.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,  # noqa: F401
                                      get_fp32_state_dict_from_zero_checkpoint, load_state_dict_from_zero_checkpoint)

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint"]
