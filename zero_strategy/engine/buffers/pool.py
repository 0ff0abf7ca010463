"""Buffers reused across a step: stage 3's gathered units and the gradients staged for a reduction.

[Note: reused buffers]
A stage-3 step needs, for every unit, a full buffer to all-gather into (in forward and again in
backward), and at stages 2 and 3 a staging buffer per gradient segment for its reduction. Fresh
memory for each costs page faults on CPU (0.3 s per GiB with 4 KiB pages on the benchmark machine:
a third of the step of the 67M-parameter MLP) and fragments glibc's heap, whose resident size then
grows for tens of steps while the bytes in use do not (benchmarks/RESULTS.md); on CUDA the caching
allocator reuses blocks anyway, and the pool only saves it the bookkeeping. So these buffers come
from a ``BufferPool``:

- ``take`` returns a free buffer of the same dtype and device that fits (at most a third larger
  than asked, so a big buffer is not spent on a small request), else a new one;
- ``give`` puts it back. The pool keeps free buffers up to the bytes that were in use at once
  during the last pass (``begin_pass``/``end_pass``: a forward and its backward, or one backward),
  dropping the least recently given first, so what it holds between steps is bounded by what the
  step needed at its peak anyway; a gather outside a pass (``gathered_parameters`` of a whole
  model) keeps nothing past that bound once released;
- a buffer is handed out again only when nothing else holds a view of it (its storage's use
  count). A view kept past its release (one autograd saved outside the hooks of [Note: saved weights] in
  engine/params/saved_weights.py, or one the user kept) keeps reading the values it was gathered
  with, and the next ``take`` allocates another buffer; so reuse can never show one unit's weights
  through another's view.

``owner_of`` answers which group holds the buffer under a tensor (for those saved-tensor hooks).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

_use_count = getattr(torch._C, "_storage_Use_Count", None)
_FREE_USE_COUNT = 2  # the pool's own tensor, and the storage object the check itself makes


def _unshared(buffer: torch.Tensor) -> bool:
    """Nothing but the pool refers to ``buffer``'s memory (without torch's counter: assume not)."""
    return _use_count is not None and _use_count(buffer.untyped_storage()._cdata) <= _FREE_USE_COUNT


def _nbytes(buffer: torch.Tensor) -> int:
    return buffer.numel() * buffer.element_size()


class BufferPool:
    """1-D buffers taken and given back (see [Note: reused buffers])."""

    SLACK = 4  # a free buffer serves a request of at least 1 - 1/SLACK of its size

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []  # least recently given first
        self._taken: dict[int, tuple[torch.Tensor, Any]] = {}  # storage address -> (buffer, owner)
        self._in_use = 0  # bytes taken and not given back
        self._pass_peak = 0  # the most bytes in use at once since begin_pass
        self._limit = 0  # bytes the pool may hold (taken and free) outside a pass: the last pass's peak
        self._in_pass = False

    def take(self, numel: int, dtype: torch.dtype, device: torch.device, owner: Any = None) -> torch.Tensor:
        """A buffer of ``numel`` elements (a view of the first ``numel`` of a reused one), contents
        undefined; ``owner`` is what ``owner_of`` answers for it until it is given back."""
        if numel == 0:
            return torch.empty(0, dtype=dtype, device=device)
        fits = [i for i, b in enumerate(self._free) if b.dtype == dtype and b.device == device
                and numel <= b.numel() <= numel + numel // (self.SLACK - 1) and _unshared(b)]
        if fits:
            base = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        else:
            base = torch.empty(numel, dtype=dtype, device=device)
        self._taken[base.untyped_storage().data_ptr()] = (base, owner)
        self._in_use += _nbytes(base)
        self._pass_peak = max(self._pass_peak, self._in_use)
        self._trim()
        return base[:numel]

    def give(self, buffer: torch.Tensor) -> None:
        """Put back a buffer ``take`` returned (any view of it will do)."""
        if buffer.numel() == 0:
            return
        base, _ = self._taken.pop(buffer.untyped_storage().data_ptr())
        self._in_use -= _nbytes(base)
        self._free.append(base)
        self._trim()

    def owner_of(self, tensor: torch.Tensor) -> Optional[Any]:
        """The owner of the taken buffer ``tensor`` lies in, if any."""
        entry = self._taken.get(tensor.untyped_storage().data_ptr())
        return entry[1] if entry is not None else None

    def begin_pass(self) -> None:
        self._in_pass = True
        self._pass_peak = self._in_use
        self._trim()

    def end_pass(self) -> None:
        self._in_pass = False
        self._limit = self._pass_peak
        self._trim()

    def free_buffers(self) -> list[torch.Tensor]:
        """The buffers held free now (memory accounting: the engine's workspace)."""
        return list(self._free)

    def _trim(self) -> None:
        allowed = max(self._limit, self._pass_peak) if self._in_pass else self._limit
        held = self._in_use + sum(_nbytes(b) for b in self._free)
        while self._free and held > allowed:
            held -= _nbytes(self._free.pop(0))
