"""ZeRO sharded training for PyTorch Lightning.

Importing the package registers ``"zero_stage_1"``, ``"zero_stage_2"`` and ``"zero_stage_3"``
with Lightning's StrategyRegistry, so ``Trainer(strategy="zero_stage_2")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from .activation import SavedActivationMeter, apply_activation_checkpointing, offload_activations, saved_activation_bytes
from .checkpoint import consolidate_checkpoint
from .config import ZeroConfig
from .engine import ZeroOptimizer
from .engine.parameters import gathered_parameters
from .memory import count_parameters, estimate_memory, memory_stats
from .precision import ZeroPrecision
from .strategy import ZeroStrategy

ZeroStrategy.register_strategies(StrategyRegistry)

__all__ = ["SavedActivationMeter", "ZeroConfig", "ZeroOptimizer", "ZeroPrecision", "ZeroStrategy",
           "apply_activation_checkpointing", "consolidate_checkpoint", "count_parameters", "estimate_memory",
           "gathered_parameters", "memory_stats", "offload_activations", "saved_activation_bytes"]
