"""``deepspeed.checkpointing``: activation checkpointing called from model code
(``deepspeed.checkpointing.checkpoint(block, hidden)``), on torch.utils.checkpoint.

[Note: deepspeed.checkpointing here]
``checkpoint(function, *args)`` recomputes ``function``'s forward in backward (torch's non-reentrant
checkpoint, which restores the RNG state as DeepSpeed's does). ``configure`` takes DeepSpeed's
settings: ``checkpoint_in_cpu`` (or the config's ``activation_checkpointing.cpu_checkpointing``)
keeps the checkpointed inputs in host memory (``zero_strategy.offload_activations``);
``partition_activations`` splits activations over model-parallel ranks, of which data parallelism
has one, so it changes nothing; ``contiguous_checkpointing``, ``num_checkpoints``, ``synchronize``
and ``profile`` are buffer and timing options of DeepSpeed's and change nothing here. A model-
parallel unit (``mpu_``) is refused. The RNG tracker is Megatron's API for model-parallel seeds:
with one model-parallel rank its ``fork()`` is the ordinary RNG.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from ..activation import offload_activations

__all__ = ["checkpoint", "configure", "get_cuda_rng_tracker", "is_configured", "model_parallel_cuda_manual_seed",
           "non_reentrant_checkpoint", "reset"]

_settings: dict[str, Any] = {"configured": False, "cpu": False}


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: Optional[bool] = None,
              contiguous_checkpointing: Optional[bool] = None, num_checkpoints: Optional[int] = None,
              checkpoint_in_cpu: Optional[bool] = None, synchronize: Optional[bool] = None,
              profile: Optional[bool] = None) -> None:
    """DeepSpeed's settings for ``checkpoint`` (see [Note: deepspeed.checkpointing here])."""
    if mpu_ is not None:
        raise ValueError("checkpointing.configure(mpu_=...): model parallelism is not supported; this package is data "
                         "parallel (ZeRO) only. Pass mpu_=None.")
    cpu = False
    if deepspeed_config is not None:
        from .keys import load_deepspeed_config

        section = load_deepspeed_config(deepspeed_config).get("activation_checkpointing") or {}
        cpu = bool(section.get("cpu_checkpointing", False))
    if checkpoint_in_cpu is not None:
        cpu = bool(checkpoint_in_cpu)
    _settings.update(configured=True, cpu=cpu)


def is_configured() -> bool:
    return bool(_settings["configured"])


def reset() -> None:
    """DeepSpeed frees its contiguous buffers here; there are none."""


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``, its activations recomputed in backward instead of kept."""
    with offload_activations(enabled=_settings["cpu"] and torch.is_grad_enabled()):
        return _torch_checkpoint(function, *args, use_reentrant=False)


non_reentrant_checkpoint = checkpoint


class _RNGTracker:
    """Megatron's model-parallel RNG tracker, for one model-parallel rank: ``fork()`` uses the ordinary RNG."""

    def add(self, name: str, seed: int) -> None:
        torch.manual_seed(seed)

    def reset(self) -> None:
        return None

    def get_states(self) -> dict[str, Any]:
        return {}

    def set_states(self, states: dict[str, Any]) -> None:
        return None

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Any:
        yield


_tracker = _RNGTracker()


def get_cuda_rng_tracker() -> _RNGTracker:
    return _tracker


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """With one model-parallel rank, the seed of every RNG."""
    torch.manual_seed(seed)
