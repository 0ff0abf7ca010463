"""``get_accelerator()``: the device calls DeepSpeed scripts make (``deepspeed.accelerator``), for
CUDA and the CPU.

[Note: which accelerator]
As DeepSpeed chooses: ``$DS_ACCELERATOR`` when set ("cuda" or "cpu" here; DeepSpeed's other names,
"xpu", "npu", "hpu", "mps", ..., are refused with what this package runs on), else CUDA when torch
sees a device, else the CPU. The choice is made once per process (as DeepSpeed's), and the engine
(``initialize``, ``init_distributed``) uses the same one, so ``DS_ACCELERATOR=cpu`` trains on the
CPU with gloo on a machine with GPUs. ``set_accelerator`` replaces it (before ``initialize``).

On the CPU, as DeepSpeed's CPU accelerator: every device name is "cpu", ``current_device()`` is
``$LOCAL_RANK`` (an int here), ``device_count()`` is ``$LOCAL_SIZE`` or else 1 (DeepSpeed counts
NUMA nodes), the memory readings are this process's resident set (its peak since the last reset),
streams and events are None, and the communication backend is gloo.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import torch

__all__ = ["CPUAccelerator", "CUDAAccelerator", "get_accelerator", "is_current_accelerator_supported",
           "set_accelerator"]

SUPPORTED = ("cuda", "cpu")


def _resident_bytes() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:  # Linux without psutil: the second field of statm, in pages
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class CPUAccelerator:
    """The CPU as DeepSpeed's CPU accelerator presents it (see [Note: which accelerator])."""

    _name = "cpu"

    def __init__(self) -> None:
        self._peak = _resident_bytes()

    # devices
    def device_name(self, device_index: Optional[int] = None) -> str:
        return "cpu"

    def device(self, device_index: Optional[int] = None) -> Optional[torch.device]:
        return None

    def set_device(self, device_index: Any) -> None:
        return None

    def current_device(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        return int(os.environ.get("LOCAL_SIZE", 0)) or 1

    def is_available(self) -> bool:
        return True

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def is_synchronized_device(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "gloo"

    # random numbers
    def random(self) -> Any:
        return torch.random

    def manual_seed(self, seed: int) -> Any:
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device_index: Optional[int] = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: Optional[int] = None) -> None:
        torch.set_rng_state(new_state)

    def default_generator(self, device_index: Optional[int] = None) -> torch.Generator:
        return torch.default_generator

    # streams and events: none on the CPU
    Stream = None
    Event = None

    def stream(self, stream: Any) -> Any:
        return contextlib.nullcontext()

    def current_stream(self, device_index: Optional[int] = None) -> None:
        return None

    def default_stream(self, device_index: Optional[int] = None) -> None:
        return None

    # memory: this process's resident set
    def _reading(self) -> int:
        now = _resident_bytes()
        self._peak = max(self._peak, now)
        return now

    def empty_cache(self) -> None:
        return None

    def memory_allocated(self, device_index: Optional[int] = None) -> int:
        return self._reading()

    def max_memory_allocated(self, device_index: Optional[int] = None) -> int:
        self._reading()
        return self._peak

    def reset_peak_memory_stats(self, device_index: Optional[int] = None) -> None:
        self._peak = _resident_bytes()

    reset_max_memory_allocated = reset_max_memory_cached = reset_peak_memory_stats
    memory_cached = memory_reserved = memory_allocated
    max_memory_cached = max_memory_reserved = max_memory_allocated

    def memory_stats(self, device_index: Optional[int] = None) -> dict[str, int]:
        now = self._reading()
        return {"allocated_bytes.all.current": now, "allocated_bytes.all.peak": self._peak}

    def total_memory(self, device_index: Optional[int] = None) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: Optional[int] = None) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    # data types
    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True  # torch computes fp16 on any CPU (DeepSpeed's asks oneDNN; the engine does not use it)

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    # misc
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def range_push(self, msg: str, *args: Any, **kwargs: Any) -> None:
        return None

    def range_pop(self, *args: Any, **kwargs: Any) -> None:
        return None

    def lazy_call(self, callback: Any) -> Any:
        return callback()

    def is_triton_supported(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class CUDAAccelerator(CPUAccelerator):
    """CUDA, each call the torch.cuda one (see [Note: which accelerator])."""

    _name = "cuda"

    def device_name(self, device_index: Optional[int] = None) -> str:
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: Optional[int] = None) -> torch.device:
        return torch.device("cuda", device_index) if device_index is not None else torch.device("cuda")

    def set_device(self, device_index: Any) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def synchronize(self, device_index: Optional[int] = None) -> None:
        torch.cuda.synchronize(device_index)

    def is_synchronized_device(self) -> bool:
        return False

    def communication_backend_name(self) -> str:
        return "nccl"

    def manual_seed(self, seed: int) -> Any:
        return torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def get_rng_state(self, device_index: Optional[int] = None) -> torch.Tensor:
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: Optional[int] = None) -> None:
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    def default_generator(self, device_index: Optional[int] = None) -> torch.Generator:
        return torch.cuda.default_generators[torch.cuda.current_device() if device_index is None else device_index]

    @property
    def Stream(self) -> Any:  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Stream

    @property
    def Event(self) -> Any:  # noqa: N802
        return torch.cuda.Event

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: Optional[int] = None) -> Any:
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: Optional[int] = None) -> Any:
        return torch.cuda.default_stream(device_index)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def memory_reserved(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    memory_cached, max_memory_cached = memory_reserved, max_memory_reserved

    def reset_peak_memory_stats(self, device_index: Optional[int] = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    reset_max_memory_allocated = reset_max_memory_cached = reset_peak_memory_stats

    def memory_stats(self, device_index: Optional[int] = None) -> dict[str, Any]:
        return torch.cuda.memory_stats(device_index)

    def total_memory(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.get_device_properties(device_index or 0).total_memory

    def available_memory(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.mem_get_info(device_index)[0]

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16] + ([torch.bfloat16] if self.is_bf16_supported() else [])

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    def range_push(self, msg: str, *args: Any, **kwargs: Any) -> None:
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self, *args: Any, **kwargs: Any) -> None:
        torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Any) -> Any:
        return torch.cuda._lazy_call(callback)

    def is_triton_supported(self) -> bool:
        return torch.cuda.get_device_capability()[0] >= 7


_chosen: Optional[CPUAccelerator] = None


def _choose(environ: Any = os.environ) -> CPUAccelerator:
    name = environ.get("DS_ACCELERATOR")
    if name is None:
        name = "cuda" if torch.cuda.device_count() > 0 and torch.cuda.is_available() else "cpu"
    if name not in SUPPORTED:
        raise ValueError(f"$DS_ACCELERATOR={name!r}: this package runs on {' or '.join(SUPPORTED)}; set "
                         "DS_ACCELERATOR=cuda or DS_ACCELERATOR=cpu, or unset it to choose CUDA when torch sees a GPU.")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("$DS_ACCELERATOR='cuda' but torch sees no CUDA device here; set DS_ACCELERATOR=cpu, or unset "
                         "it.")
    return CUDAAccelerator() if name == "cuda" else CPUAccelerator()


def get_accelerator() -> CPUAccelerator:
    """This process's accelerator, chosen on first call (see [Note: which accelerator])."""
    global _chosen
    if _chosen is None:
        _chosen = _choose()
    return _chosen


def set_accelerator(accelerator: CPUAccelerator) -> None:
    """Use ``accelerator`` from now on (a CPUAccelerator or CUDAAccelerator)."""
    global _chosen
    if not isinstance(accelerator, CPUAccelerator):
        raise TypeError(f"set_accelerator({accelerator!r}): give zero_strategy.accelerator.CPUAccelerator() or "
                        "CUDAAccelerator().")
    _chosen = accelerator


def is_current_accelerator_supported() -> bool:
    return get_accelerator()._name in SUPPORTED
