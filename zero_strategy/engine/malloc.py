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
which also stops its rising: blocks of 4 MiB and more leave the process when freed, and its
resident memory follows the bytes in use. Each such block then takes fresh pages when it is
allocated again, a cost that the engine's own large buffers avoid by being reused
([Note: reused buffers] in pool.py) and the optimizer's temporaries by staying small ([Note: the
CPU step in tiles] in tiled_step.py). The setting is the process's (``mallopt``), so it applies to
all of its allocations from then on; ``None`` leaves glibc's own rule. Elsewhere than glibc
(macOS, musl) nothing is set.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3

_threshold_set: Optional[int] = None  # bytes this process's threshold was set to here


def _glibc() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only
        return libc
    except (OSError, AttributeError):
        return None


def set_mmap_threshold(mb: Optional[float]) -> bool:
    """Have glibc map blocks of ``mb`` MiB or more, and unmap them when freed (see [Note: glibc's mmap
    threshold]); the heap is trimmed from twice that, as glibc does with its own threshold. True when
    the threshold is ``mb`` now; False for ``mb=None`` or without glibc."""
    global _threshold_set
    if mb is None:
        return False
    nbytes = int(mb * 2**20)
    if _threshold_set == nbytes:
        return True
    libc = _glibc()
    if libc is None or not libc.mallopt(M_MMAP_THRESHOLD, nbytes):
        return False
    libc.mallopt(M_TRIM_THRESHOLD, 2 * nbytes)
    _threshold_set = nbytes
    log.info("zero_strategy: glibc's mmap threshold is %s MiB in this process (ZeroConfig.cpu_mmap_threshold_mb; "
             "None leaves glibc's own)", mb)
    return True
