"""Finding, compiling and launching the CUDA sources in cuda/ with CuPy (NVRTC).

[Note: where cuda/ is]
The .cu sources live at the top of the repository (cuda/), where the design puts them. This
package reaches them through ``zero_strategy/kernels/cuda``, a symbolic link to ``../../cuda`` in a
checkout; building a wheel follows the link, so the wheel holds the files themselves (package data
of ``zero_strategy.kernels``). One copy of each source, found the same way everywhere.

[Note: one module per source and device]
A source compiles into one CuPy ``RawModule`` holding every template instantiation that the Python
side names (``KERNELS``), once per device: CuPy compiles for the architecture of the current device
(``-arch=sm_XY``) and caches the binary on disk, so later processes load it without compiling.
The source goes to NVRTC behind ``#line 1 "<path>"``, so a compiler error names the .cu file and
line, and with ``-I <cuda dir>`` for the shared header.

Kernels take raw addresses (``tensor.data_ptr()``) instead of CuPy arrays: no DLPack capsule per
tensor, no copy, and bf16 is just 16-bit words. They run on torch's current stream of the tensors'
device, so they are ordered with torch's own kernels like any torch op.
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from itertools import product
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

ENV_VAR = "ZERO_STRATEGY_KERNELS"
BACKENDS = ("auto", "torch")
"""auto: the CUDA kernels for CUDA tensors when CuPy imports, torch elsewhere (and on CPU the compiled
low-precision state codec: cpu_codec.py); torch: always torch."""

GRAD_TYPES = ("float", "bf16_t", "f16_t")
OUT_TYPES = ("no_out_t", "bf16_t", "f16_t")
KERNELS: dict[str, tuple[str, ...]] = {
    "fused_adam": tuple(f"adam_step<{g}, {o}>" for g, o in product(GRAD_TYPES, OUT_TYPES)),
    "fused_sgd": tuple(f"sgd_step<{g}, {o}>" for g, o in product(GRAD_TYPES, OUT_TYPES)),
    "grad_norm": tuple(f"grad_norm_partials<{g}>" for g in GRAD_TYPES) + ("grad_norm_final",),
    "quantize": tuple(f"quant_scales<{t}>" for t in GRAD_TYPES)
    + tuple(f"{k}<{t}, {b}>" for k, t, b in product(("quant_codes", "dequant_rows"), GRAD_TYPES, (8, 4)))
    + ("dequant_sum<8>", "dequant_sum<4>"),
    "adam_lowp": tuple(f"adam_lowp_step<{g}, {s}, {p}>" for g, s, p in product(("float", "bf16_t"), ("q8_t", "bf16_t"),
                                                                               ("float", "bf16_t"))),
}
"""Every kernel each source defines, by the name CuPy looks it up with (its explicit instantiations)."""

CUDA_TYPE_NAMES = {torch.float32: "float", torch.bfloat16: "bf16_t", torch.float16: "f16_t"}
"""torch dtype -> the kernels' storage type."""

_backend: Optional[str] = None
_launches: Counter = Counter()  # kernel launches by source stem, for ``launch_counts``


def source_dir() -> Path:
    """The folder of the .cu sources: see [Note: where cuda/ is]."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "cuda", here.parents[1] / "cuda"):
        if any(candidate.glob("*.cu")):
            return candidate.resolve()  # the link's target: compiler errors name cuda/<file>.cu
    raise FileNotFoundError(f"zero_strategy's CUDA sources are missing: neither {here / 'cuda'} nor "
                            f"{here.parents[1] / 'cuda'} holds a .cu file; reinstall the package.")


def source_files() -> list[Path]:
    """Every cuda/*.cu, sorted."""
    return sorted(source_dir().glob("*.cu"))


def with_line_directive(source: str, path: Path) -> str:
    """``source`` behind ``#line 1 "<path>"``: NVRTC then reports errors against the file itself."""
    name = str(path).replace("\\", "\\\\").replace('"', '\\"')
    return f'#line 1 "{name}"\n{source}'


def read_source(stem: str) -> str:
    """The text of ``cuda/<stem>.cu``, ready for NVRTC (see ``with_line_directive``)."""
    path = source_dir() / f"{stem}.cu"
    if not path.is_file():
        raise FileNotFoundError(f"no CUDA source {path}; the sources are {[p.stem for p in source_files()]}.")
    return with_line_directive(path.read_text(), path)


def compile_options() -> tuple[str, ...]:
    """NVRTC options; CuPy adds the architecture of the current device."""
    return ("-std=c++17", f"-I{source_dir()}")


# ---- the switch ------------------------------------------------------------------------------

def backend() -> str:
    """``"auto"`` or ``"torch"``: set by ``set_backend``, else by $ZERO_STRATEGY_KERNELS, else auto."""
    if _backend is not None:
        return _backend
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={value!r} is not a kernel backend; use one of {BACKENDS} "
                         "(torch forces the torch reference everywhere).")
    return value


def set_backend(name: Optional[str]) -> None:
    """Force the torch reference (``"torch"``), allow the kernels (``"auto"``), or defer to the
    environment variable again (``None``)."""
    global _backend
    if name is not None and name not in BACKENDS:
        raise ValueError(f"kernel backend {name!r} is not one of {BACKENDS}.")
    _backend = name


@functools.lru_cache(maxsize=None)
def cupy_module() -> Optional[Any]:
    """``cupy`` if it imports (and finds a CUDA driver), else None."""
    try:
        import cupy  # noqa: PLC0415  (optional dependency)

        cupy.cuda.runtime.getDeviceCount()
        return cupy
    except Exception:  # not installed, or no usable CUDA: the torch reference runs instead
        return None


def available(tensor: torch.Tensor) -> bool:
    """True when ``tensor``'s operations would run the CUDA kernels: it is a CUDA tensor, CuPy
    imports, and the backend is not forced to torch."""
    return tensor.is_cuda and backend() == "auto" and cupy_module() is not None


# ---- compiling and launching -----------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _module(stem: str, device_index: int) -> Any:
    cupy = cupy_module()
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=read_source(stem), options=compile_options(), name_expressions=KERNELS[stem])
        module.compile()
    return module


def get_kernel(stem: str, name: str, device: torch.device) -> Any:
    """The compiled kernel ``name`` of ``cuda/<stem>.cu`` on ``device``: see [Note: one module per source
    and device]."""
    if name not in KERNELS.get(stem, ()):
        raise KeyError(f"{stem}.cu has no kernel {name!r}; it has {KERNELS.get(stem)}.")
    return _kernel(stem, name, _index(device))


@functools.lru_cache(maxsize=None)
def _kernel(stem: str, name: str, device_index: int) -> Any:
    with cupy_module().cuda.Device(device_index):  # a module's functions belong to the device it loaded on
        return _module(stem, device_index).get_function(name)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _cupy_stream(device: torch.device) -> Any:
    cupy = cupy_module()
    stream = torch.cuda.current_stream(device)
    if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy >= 14: the CUDA stream protocol
        return cupy.cuda.Stream.from_external(stream)
    return cupy.cuda.ExternalStream(stream.cuda_stream, device.index)


def launch_counts() -> dict[str, int]:
    """How many kernels of each source (``"fused_adam"``, ``"grad_norm"``, ...) this process has launched:
    how a caller (a test, a benchmark) sees that the CUDA kernels ran rather than the torch reference."""
    return dict(_launches)


def launch(stem: str, name: str, device: torch.device, grid: int, block: int, args: Sequence[Any]) -> None:
    """Run a kernel on torch's current stream of ``device``. ``args`` must already have the kernel's C
    types (numpy scalars: ``np.uint64`` for addresses, ``np.float32``, ``np.int32``, ``np.int64``)."""
    if grid == 0:
        return
    _launches[stem] += 1
    cupy = cupy_module()
    kernel = get_kernel(stem, name, device)
    with cupy.cuda.Device(_index(device)), _cupy_stream(device):
        kernel((grid,), (block,), tuple(args))
