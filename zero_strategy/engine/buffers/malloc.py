"""glibc's mmap threshold, for training on CPU.

[Note: glibc's mmap threshold]
On CPU every tensor is malloc'd. glibc serves a block of at least its *mmap threshold* with pages
of its own and gives them back to the system when the block is freed; a smaller block comes from
the heap, whose freed memory stays in the process for later blocks. The threshold starts at
128 KiB and rises, up to 32 MiB, to the size of each mapped block freed. So after the first
steps of training every block is a heap block, and a step that frees and allocates blocks of
several MiB in a changing order (stage 3's gathered units, autograd's weight gradients, the
optimizer's temporaries) leaves holes that the heap keeps: measured on the MLP of
``benchmarks/bench_stage3_defaults.py`` at stage 3, 2 ranks, the resident memory grows over 16
steps to 1.3x the bytes in use.

So on CPU the engine fixes the threshold (``ZeroConfig.cpu_mmap_threshold_mb``, 4 MiB by default),
which also stops its rising: blocks of 4 MiB and more that malloc takes from the system from then
on leave the process when freed, and its resident memory follows the bytes in use. (Free heap
memory from before stays in the heap and serves later blocks.) Each such block takes fresh pages
when it is allocated again, a cost that the engine's own large buffers avoid by being reused
([Note: reused buffers] in engine/buffers/pool.py) and the optimizer's temporaries by staying small ([Note: the CPU
step in tiles] in engine/optim/tiles.py); autograd's weight gradients pay it (benchmarks/RESULTS.md,
"glibc's mmap threshold and the CPU step in tiles"). The setting is the process's (``mallopt``):
it applies to all of its allocations from then on and stays for good; ``None`` sets nothing.
Where the process was started with a threshold of its own (``MALLOC_MMAP_THRESHOLD_``, or
``glibc.malloc.mmap_threshold`` in ``GLIBC_TUNABLES``) that one is kept, and elsewhere than glibc
on Linux (macOS, Windows, musl) nothing is set.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from typing import Optional

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3

_threshold_set: Optional[int] = None  # bytes this process's threshold was set to here


def _glibc() -> Optional[ctypes.CDLL]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only (not musl)
        return libc
    except (OSError, AttributeError, TypeError):
        return None


def _start_environment() -> dict[str, str]:
    """The environment this process started with, which glibc read (``os.environ`` may differ since)."""
    try:
        with open("/proc/self/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return dict(os.environ)
    pairs = (item.decode(errors="replace").partition("=") for item in items if item)
    return {name: value for name, _, value in pairs}


def _set_by_environment() -> Optional[str]:
    """The variable through which whoever started this process chose glibc's mmap threshold, if any."""
    start = _start_environment()
    if "MALLOC_MMAP_THRESHOLD_" in start:
        return "MALLOC_MMAP_THRESHOLD_"
    if "glibc.malloc.mmap_threshold" in start.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    return None


def set_mmap_threshold(mb: Optional[float]) -> bool:
    """Have glibc map blocks of ``mb`` MiB or more that it allocates from now on, and unmap them when
    freed (see [Note: glibc's mmap threshold]); the heap is trimmed from twice that, as glibc does
    with its own threshold. True when the threshold is ``mb`` now. Nothing is set for ``mb=None``,
    without glibc, or where the process was started with a threshold of its own
    (``MALLOC_MMAP_THRESHOLD_`` or ``GLIBC_TUNABLES``), which is kept."""
    global _threshold_set
    if mb is None:
        return False
    nbytes = int(mb * 2**20)
    if _threshold_set == nbytes:
        return True
    chosen = _set_by_environment()
    if chosen is not None:
        log.info("zero_strategy: glibc's mmap threshold stays as %s sets it (cpu_mmap_threshold_mb=%s not applied)",
                 chosen, mb)
        return False
    libc = _glibc()
    if libc is None:
        return False
    if not libc.mallopt(M_MMAP_THRESHOLD, nbytes):
        log.warning("zero_strategy: glibc refused an mmap threshold of %s MiB (cpu_mmap_threshold_mb); its own rule "
                    "stays", mb)
        return False
    libc.mallopt(M_TRIM_THRESHOLD, 2 * nbytes)
    _threshold_set = nbytes
    log.info("zero_strategy: glibc's mmap threshold is %s MiB in this process (ZeroConfig.cpu_mmap_threshold_mb; "
             "None leaves glibc's own)", mb)
    return True
