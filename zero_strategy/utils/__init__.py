"""``zero_strategy.utils``, as ``deepspeed.utils``: ``zero_to_fp32`` (a checkpoint's fp32 weights) and the
leaf-module names (``set_z3_leaf_modules`` and its kin: see z3_leaf_module.py)."""

from ..deepspeed.unsupported import module_getattr
from . import zero_to_fp32
from .z3_leaf_module import (get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module,
                             z3_leaf_parameter)

__all__ = ["get_z3_leaf_modules", "set_z3_leaf_modules", "unset_z3_leaf_modules", "z3_leaf_module",
           "z3_leaf_parameter", "zero_to_fp32"]

__getattr__ = module_getattr("deepspeed.utils", "of deepspeed.utils this package has utils.zero_to_fp32 and the "
                                                "z3 leaf-module names (for a whole parameter at stage 3 use "
                                                "zero_strategy.zero.GatheredParameters).")
