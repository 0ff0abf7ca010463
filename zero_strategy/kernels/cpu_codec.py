"""The low-precision state codec in C (int8_codec.c), compiled at run time by the system's C compiler.

[Note: the compiled CPU codec]
On CPU, the int8 encode and decode of ``Int8State`` and the stochastic bf16 rounding of
``round_to_bf16`` (engine/optim/lowp.py) are each a dozen torch passes over a tile (gathers, integer
arithmetic on order keys, a block maximum, a divide; splitmix64's int64 passes), which made the
int8 step about 3.3x the fp32-state step and bf16 state 4.3x. int8_codec.c does each in one pass,
with exactly the bits of the torch code (tests/test_lowp_codec.py). The source is compiled once per
machine with ``$CC`` (else ``cc``), ``-O3 -march=native -fopenmp`` (each of the last two dropped if
the compiler refuses it) and no floating-point contraction or fast-math (the operations must round
as torch's do), into ``$ZERO_STRATEGY_CACHE`` (else ``$XDG_CACHE_HOME/zero_strategy``, else
``~/.cache/zero_strategy``) under a name that hashes the source, the compiler's version, the flags
and the CPU's, so a cache shared by unlike machines never loads another's binary; the file is
written to a temporary name and renamed, so concurrent ranks never load half a file. It takes under
a second. Where there is no compiler or it fails, the torch code runs (the same bits, slower) and
one warning says why; ``ZERO_STRATEGY_KERNELS=torch`` (``kernels.set_backend("torch")``) forces the
torch code here as for the CUDA kernels.

[Note: the codec's threads]
torch's own operations in the step (the update) run on ``torch.get_num_threads()`` threads, so the
C functions do too: OpenMP loops over whole int8 blocks (or chunks of positions), on at most that
many threads and one per ``PART_NUMEL`` elements. torch's CPU build loads its own libgomp.so.1, and
the compiled file, linked against ``libgomp.so.1`` by ``-fopenmp``, binds to the library already
loaded under that name: one OpenMP runtime and one set of threads for both. (A pool of Python
threads was tried first: torch's OpenMP workers spin for a while after each operation and took
the cores from it, making the 2-thread step slower than the 1-thread codec.) Every block, and every
position's random bits, is computed alone, so any number of threads gives the bits of one. Without
OpenMP (a compiler that refuses ``-fopenmp``) the pragmas are ignored and one thread runs.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "int8_codec.c"
FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC")
EXTRA = (("-march=native", "-fopenmp"), ("-fopenmp",), ("-march=native",), ())
"""Tried in turn until the compiler accepts them: see [Note: the codec's threads] for OpenMP."""

PART_NUMEL = 1 << 16
"""The fewest elements one thread takes: below it, waking a thread costs more than it saves."""


def cache_dir() -> Path:
    explicit = os.environ.get("ZERO_STRATEGY_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "zero_strategy"


def _cpu_signature() -> str:
    """What tells this CPU's instruction set from another's: the flags line of /proc/cpuinfo on Linux."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


def _compile(compiler: str, source: Path, target: Path) -> Optional[str]:
    """Build ``target``; None, or why it failed."""
    why = None
    for extra in EXTRA:
        flags = (*extra, *FLAGS)
        with tempfile.NamedTemporaryFile(dir=target.parent, prefix=target.stem, suffix=".tmp", delete=False) as tmp:
            partial = Path(tmp.name)
        try:
            done = subprocess.run([compiler, *flags, "-o", str(partial), str(source)], capture_output=True,
                                  text=True, timeout=120)
            if done.returncode == 0:
                os.replace(partial, target)
                return None
            why = f"{compiler} {' '.join(flags)} failed: {done.stderr.strip()[-500:]}"
        except (OSError, subprocess.SubprocessError) as err:
            why = f"{compiler} could not run: {err}"
        finally:
            partial.unlink(missing_ok=True)
    return why


@functools.lru_cache(maxsize=None)
def _library() -> Optional[ctypes.CDLL]:
    compiler = os.environ.get("CC") or "cc"
    found = shutil.which(compiler)
    if found is None:
        log.warning("the int8 optimizer state encodes with torch on the CPU, which is slower: no C compiler "
                    "(%r, from $CC or the default) to build %s (the same results either way)", compiler, SOURCE.name)
        return None
    try:
        version = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=30).stdout
        digest = hashlib.sha256("\0".join([SOURCE.read_text(), version, repr((FLAGS, EXTRA)),
                                           _cpu_signature()]).encode()).hexdigest()[:16]
        folder = cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / f"int8_codec-{digest}.so"
        why = None if target.exists() else _compile(found, SOURCE, target)
        library = None if why else ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as err:
        why, library = str(err), None
    if library is None:
        log.warning("the int8 optimizer state encodes with torch on the CPU, which is slower: building %s "
                    "failed (%s); the results are the same either way", SOURCE.name, why)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.zs_int8_decode.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_int]
    library.zs_int8_decode.restype = None
    library.zs_int8_encode.argtypes = [ptr, i64, i64, ctypes.c_int, ptr, ptr, ptr, ctypes.c_int]
    library.zs_int8_encode.restype = ctypes.c_int
    library.zs_bf16_stochastic.argtypes = [ptr, i64, ctypes.c_uint64, ptr, ctypes.c_int]
    library.zs_bf16_stochastic.restype = None
    return library


def library() -> Optional[ctypes.CDLL]:
    """The compiled codec, or None: the torch code runs (see [Note: the compiled CPU codec])."""
    from .loader import backend  # noqa: PLC0415  (kernels/__init__ imports engine/lowp, which imports this)

    return None if backend() == "torch" else _library()


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the compiled codec takes these tensors (CPU, contiguous) and is built."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors) and library() is not None


def _threads(numel: int) -> int:
    """Threads for a call over ``numel`` elements: torch's, at most one per ``PART_NUMEL``."""
    return max(1, min(torch.get_num_threads(), numel // PART_NUMEL))


def decode(codes: torch.Tensor, scales: torch.Tensor, values_map: torch.Tensor, out: torch.Tensor, block: int) -> None:
    library().zs_int8_decode(codes.data_ptr(), scales.data_ptr(), values_map.data_ptr(), out.data_ptr(),
                             codes.numel(), block, _threads(codes.numel()))


def encode(x: torch.Tensor, block: int, signed: bool, table: torch.Tensor, scales: torch.Tensor,
           codes: torch.Tensor) -> bool:
    """Codes and scales of ``x``; False (nothing written) when the map is unsigned and a value is negative."""
    return library().zs_int8_encode(x.data_ptr(), x.numel(), block, int(signed), table.data_ptr(), scales.data_ptr(),
                                    codes.data_ptr(), _threads(x.numel())) == 0


def bf16_stochastic(x: torch.Tensor, offset: int, out: torch.Tensor) -> None:
    """``out`` (bf16) = ``x`` (fp32) rounded stochastically with the random bits of positions ``offset``,
    ``offset + golden``, ... (see ``zs_bf16_stochastic``)."""
    library().zs_bf16_stochastic(x.data_ptr(), x.numel(), offset & ((1 << 64) - 1), out.data_ptr(),
                                 _threads(x.numel()))
