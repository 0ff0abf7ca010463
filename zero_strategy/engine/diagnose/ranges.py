"""Named ranges around what the engine does, for a profiler's trace.

[Note: profiler ranges]
The engine marks its work with ``torch.profiler.record_function`` ranges named for what they do:
``zero/gather <unit>`` (issuing a stage-3 unit's all-gathers) and ``zero/wait gather <unit>``,
``zero/reduce-scatter segment <k> of group <g>`` and its ``zero/wait ...``, ``zero/step``,
``zero/update`` (the optimizer's update), ``zero/all-gather updated parameters``, and with offload
``zero/offload shard to device <unit>`` and ``zero/offload wait for copies``. So a torch profiler
trace (or, under ``torch.autograd.profiler.emit_nvtx()``, an Nsight Systems timeline, where each
range is an NVTX range) names the engine's own spans beside the operators inside them. A range is
entered only while a profiler records (``torch.autograd.profiler`` says so, in one read of a module
flag): otherwise ``span`` returns a shared no-op context and builds no name.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch.autograd.profiler as _profiler

_NO_RANGE = contextlib.nullcontext()


def profiling() -> bool:
    """Whether a torch profiler (or ``emit_nvtx``) is recording now."""
    return _profiler._is_profiler_enabled


def span(name: Callable[[], str]) -> ContextManager:
    """A profiler range named ``name()`` while a profiler records, else a no-op (``name`` not called)."""
    if _profiler._is_profiler_enabled:
        return _profiler.record_function(name())
    return _NO_RANGE
