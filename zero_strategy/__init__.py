"""ZeRO sharded training for PyTorch Lightning."""

from .config import ZeroConfig
from .engine import ZeroOptimizer

__all__ = ["ZeroConfig", "ZeroOptimizer"]
