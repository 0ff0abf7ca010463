"""A module's buffers kept in step across the ranks, as DDP keeps them.

[Note: buffers kept in step]
DDP (``DistributedDataParallel._pre_forward`` and ``_post_forward``, torch 2.13) broadcasts the
wrapped module's buffers from rank 0 at the start of its forward, in one coalesced broadcast, when
``broadcast_buffers`` is on and its flag ``require_forward_param_sync`` is set. The flag starts set,
and each forward sets it to ``torch.is_grad_enabled() and require_backward_grad_sync`` (False inside
``no_sync``). So the first forward broadcasts, a training forward makes the next one broadcast, and an
evaluation forward (under no_grad) or one inside ``no_sync`` makes the next one not: in a Lightning
fit, whose validation steps go through DDP's forward under no_grad, the first validation step
broadcasts and the first training step after it does not; with accumulation, the first micro-batch of
each step does. Without it, BatchNorm's running statistics follow each rank's own batches, and
evaluation differs from rank to rank and from DDP's.

``BufferBroadcast`` does that for a module on the engine, at every stage (stage 3 keeps buffers whole
on every rank, as stages 1-2 do): ``before_forward`` and ``after_forward`` run around what the front
end counts as one forward of the wrapped module, which is the root module's forward for Fabric and a
plain loop (``hook``) and a training or validation step for the Trainer (Lightning's DDP wraps the
steps); the front ends set ``no_sync`` while their no-sync context is open. ``setup_engine`` makes
and hooks it; a plain loop of ``ZeroOptimizer`` and ``shard_module`` hooks one itself
(``BufferBroadcast(module, comm).hook()``). The buffers go as bytes, one broadcast per device, through
the engine's collectives: ``comm_stats()`` counts it, and the communication model predicts it
(comm_model.py: once per training step, before its first micro-batch). They are read again at each
broadcast (a module may assign new ones, as DDP allows for), and their version counters are kept
(autograd may hold one saved by an earlier forward, as DDP allows). Under ``Join`` the source is the
highest rank still working, as DDP's Join chooses, and a joined rank broadcasts when the others do
(see [Note: joining] in engine/join.py).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import nn

from ..comm.collectives import Collectives
from .attached import attach_hook, detach_hook
from .unit import in_backward

_OF: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[BufferBroadcast]]" = weakref.WeakKeyDictionary()


def broadcast_of(module: nn.Module) -> Optional["BufferBroadcast"]:
    """The BufferBroadcast keeping ``module``'s buffers in step, if one does (the front end holds it)."""
    ref = _OF.get(module)
    return ref() if ref is not None else None


class BufferBroadcast:
    """Rank ``source``'s buffers of ``module`` to every rank of ``comm`` before a forward, as DDP's
    default does (see [Note: buffers kept in step])."""

    def __init__(self, module: nn.Module, comm: Collectives) -> None:
        self.module = module
        self.comm = comm
        self.due = True  # DDP's require_forward_param_sync: the first forward broadcasts
        self.no_sync = False  # a forward now does not sync gradients (DDP's no_sync)
        self.source = 0  # Join sets the highest working rank
        self.paused = False  # a joined rank's replay, which Join drives itself
        self._handles: list[Any] = []
        _OF[module] = weakref.ref(self)

    @property
    def due_after(self) -> bool:
        """Whether a forward that runs now makes the next one broadcast."""
        return torch.is_grad_enabled() and not self.no_sync

    def before_forward(self) -> None:
        if self.due:
            self.broadcast(self.source)

    def after_forward(self) -> None:
        self.due = self.due_after

    def broadcast(self, source: int) -> None:
        """Rank ``source``'s buffers into every rank's, in one broadcast of their bytes per device."""
        buffers = [b for b in self.module.buffers() if not b.is_meta]
        if self.comm.world_size == 1 or not buffers:
            return
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for b in buffers:
            by_device.setdefault(b.device, []).append(b)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
            for group in by_device.values():
                packed = torch.cat([b.detach().reshape(-1).view(torch.uint8) for b in group])  # (bytes,)
                self.comm.broadcast(packed, src=source, what=lambda: f"broadcast of the module's buffers from rank "
                                    f"{source} before a forward (broadcast_buffers)")
                offset = 0
                for b in group:
                    chunk = packed[offset:offset + b.numel() * b.element_size()]
                    offset += chunk.numel()
                    if b.is_contiguous():
                        b.view(-1).view(torch.uint8).copy_(chunk)
                    else:
                        b.copy_(chunk.clone().view(b.dtype).view(b.shape))

    # ---- around the module's own forward: Fabric, a plain loop --------------------------------

    def hook(self) -> "BufferBroadcast":
        """Broadcast around every forward of the module itself (not recomputations in backward)."""
        module = self.module
        self._handles = [
            attach_hook(module, module.register_forward_pre_hook(torch._dynamo.disable(self._pre), prepend=True)),
            attach_hook(module, module.register_forward_hook(torch._dynamo.disable(self._post)))]
        return self

    def _pre(self, module: nn.Module, args: Any) -> None:
        if not self.paused and not in_backward():
            self.before_forward()

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self.paused and not in_backward():  # a forward that raised leaves the flag, as DDP's does
            self.after_forward()

    def remove_hooks(self) -> None:
        for handle in self._handles:
            detach_hook(self.module, handle)
        self._handles.clear()
        if broadcast_of(self.module) is self:
            del _OF[self.module]
