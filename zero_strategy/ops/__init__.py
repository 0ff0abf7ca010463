"""``zero_strategy.ops``, as ``deepspeed.ops``: ``adam`` (FusedAdam, DeepSpeedCPUAdam as torch's Adam)."""

from ..deepspeed.unsupported import module_getattr
from . import adam

__all__ = ["adam"]

__getattr__ = module_getattr("deepspeed.ops", "of deepspeed.ops this package has only ops.adam (FusedAdam, "
                                              "DeepSpeedCPUAdam); use torch.optim for other optimizers.")
