"""Saved-tensor hooks that let autograd keep *where* a gathered weight was, not its memory.

[Note: saved weights]
A linear layer saves its weight (a transposed view of it) for backward. At stage 3 that is a view
of the unit's gathered buffer, and as long as autograd holds it, the buffer cannot go back to the
pool (see [Note: reused buffers] in engine/buffers/pool.py): every unit would stay gathered from its forward to
its backward. So while a unit's module runs with grad enabled (its forward, or a recomputation in
backward), the sharder pushes these hooks: a saved tensor that lies in a gathered unit's buffer is
kept as (group, shape, strides, offset), and when backward needs it, it is rebuilt over the
group's buffer as gathered again by then (the hook on the unit's outputs gathers it before any of
its saved tensors is unpacked: see [Note: when units are gathered] in engine/params/flat_parameters.py). Unpacking it
while the unit is released is an error naming the unit, never a read of another unit's memory.

Only the innermost saved-tensor hooks apply, so everything else is handed to the hooks that were
in force when these were pushed (activation offload, torch's checkpointing inside a checkpointed
module, a user's own), and those keep working as without stage 3; with none, it is kept as autograd
would keep it, with autograd's check that it was not modified in place meanwhile (which autograd
itself skips for a tensor that hooks packed). The hooks are pushed in the unit's forward and recomputation alike, so a checkpoint
around units sees the same sequence of saved tensors in both. Where hooks are disabled (inside
torch.func transforms) nothing is pushed, and a saved weight keeps its buffer alive instead.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..buffers.pool import BufferPool


class _InBuffer:
    """A saved tensor that lies in a gathered group's buffer, by position only."""

    __slots__ = ("group", "size", "stride", "offset")

    def __init__(self, group: Any, tensor: torch.Tensor, buffer: torch.Tensor) -> None:
        self.group = group
        self.size, self.stride = tensor.size(), tensor.stride()
        self.offset = tensor.storage_offset() - buffer.storage_offset()

    def unpack(self) -> torch.Tensor:
        buffer = self.group.buffer
        if buffer is None:
            raise RuntimeError(
                f"backward needs a weight of stage-3 unit {self.group.unit_name!r}, which is released: it was used by "
                "a module outside the unit, after the unit's forward ended, or (a frozen weight) after backward had "
                "reached the unit that ran before it in forward. Use each unit's parameters inside its own modules' "
                "forward, and the units in a chain (or make that module a unit with shard_modules=[...]).")
        return buffer.as_strided(self.size, self.stride, buffer.storage_offset() + self.offset)


class _ByOuter:
    """A saved tensor packed by the hooks that were in force when ours were pushed."""

    __slots__ = ("packed", "unpack_hook")

    def __init__(self, packed: Any, unpack_hook: Callable[[Any], torch.Tensor]) -> None:
        self.packed, self.unpack_hook = packed, unpack_hook

    def unpack(self) -> torch.Tensor:
        return self.unpack_hook(self.packed)


class _Kept:
    """A saved tensor kept as autograd keeps one, with autograd's check that it was not modified in
    place since (autograd skips that check for tensors that saved-tensor hooks packed)."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()  # not the tensor itself: a saved output would hold its own graph
        self.version = tensor._version  # the detached tensor shares its version counter

    def unpack(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{self.tensor.type()} {list(self.tensor.shape)}] is at version {self.tensor._version}; expected "
                f"version {self.version} instead (saved in the forward of a stage-3 unit's module). Make that "
                "operation out of place (x = x + 1 for x += 1, inplace=False), as it would have to be without ZeRO.")
        return self.tensor


class SavedWeights:
    """Pushes and pops the hooks of [Note: saved weights] for the buffers of ``pool``."""

    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool
        self._pushed: list[bool] = []  # per push(): whether hooks were really pushed

    def push(self) -> None:
        """Push the hooks (a unit's module begins its forward); every ``push`` needs its ``pop``."""
        self._pushed.append(False)
        if torch.is_grad_enabled() and torch._C._autograd._saved_tensors_hooks_is_enabled():
            outer: Optional[tuple] = torch._C._autograd._top_saved_tensors_default_hooks(False)
            torch._C._autograd._push_saved_tensors_default_hooks(self._packer(outer), _unpack)
            self._pushed[-1] = True

    def pop(self) -> None:
        if self._pushed and self._pushed.pop():
            torch._C._autograd._pop_saved_tensors_default_hooks()

    def _packer(self, outer: Optional[tuple]) -> Callable[[torch.Tensor], Any]:
        pool = self.pool

        def pack(tensor: torch.Tensor) -> Any:
            group = _owner(pool, tensor)
            if group is not None and tensor.dtype == group.dtype:
                return _InBuffer(group, tensor, group.buffer)
            if outer is not None:
                return _ByOuter(outer[0](tensor), outer[1])
            return _Kept(tensor)

        return pack


def _owner(pool: BufferPool, tensor: torch.Tensor) -> Optional[Any]:
    try:
        return pool.owner_of(tensor)
    except (RuntimeError, NotImplementedError):  # no storage (a tensor subclass, sparse, nested)
        return None


def _unpack(packed: Any) -> torch.Tensor:
    return packed.unpack()
