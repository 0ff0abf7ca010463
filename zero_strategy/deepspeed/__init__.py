"""What DeepSpeed users bring along: their JSON configs (``config.py``, with ``keys.py``,
``optimizers.py`` and ``schedulers.py``), their training loop (``engine.py``: ``initialize``, with
``launch.py``: ``init_distributed``) and their checkpoints (``engine_checkpoint.py``, and
zero_strategy/checkpoint/deepspeed.py).

Importing this package costs nothing: ``initialize`` and ``init_distributed`` are loaded on first
use, so ``import zero_strategy.deepspeed as deepspeed`` gives ``deepspeed.initialize(...)``.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"initialize": "engine", "ZeroEngine": "engine", "init_distributed": "launch",
         "add_config_arguments": "arguments", "get_accelerator": "accelerator"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
