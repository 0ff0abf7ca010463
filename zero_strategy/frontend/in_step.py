"""What the front ends keep in step across the ranks as DDP does: the module's buffers (see [Note:
buffers kept in step] in engine/params/buffer_sync.py) and, on request, batch norm's statistics
(Lightning's ``sync_batchnorm``). No Lightning here: a layer sync plugin is anything with
``apply(module)`` and ``revert(module)``, as Lightning's ``LayerSync``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ..engine.params.buffer_sync import BufferBroadcast


def sync_batchnorm_devices() -> tuple[str, ...]:
    """The device types whose inputs torch's SyncBatchNorm synchronises (its forward refuses others)."""
    return ("cuda", "hpu", "xpu", torch._C._get_privateuse1_backend_name())


def apply_layer_sync(layer_sync: Any, module: nn.Module, device: torch.device) -> nn.Module:
    """``module`` with ``layer_sync`` applied (``Trainer(sync_batchnorm=True)``: its BatchNorm layers
    become ``torch.nn.SyncBatchNorm``), as Lightning's DDP strategy applies it when fitting, before the
    engine's setup. Refused, with ``module`` as it was, where torch's SyncBatchNorm refuses the device:
    training would fail at its first step (as DDP refuses such a module at once)."""
    if layer_sync is None:
        return module
    before = dict(module.named_modules())
    synced = layer_sync.apply(module)
    layers = [name for name, m in synced.named_modules() if isinstance(m, nn.SyncBatchNorm)]
    if layers and device.type not in sync_batchnorm_devices():
        for name, original in before.items():  # the user's own layers back (a plugin's revert makes new ones)
            if name:
                parent, _, child = name.rpartition(".")
                before[parent]._modules[child] = original
        raise ValueError(
            f"Trainer(sync_batchnorm=True) on a {device.type} device: torch's SyncBatchNorm synchronises batch "
            f"statistics on {'/'.join(sync_batchnorm_devices())} devices only, and refuses {device.type} inputs "
            f"(DDP refuses the module too), so the {len(layers)} batch norm layers of {type(module).__name__} "
            f"({layers[:3]}) cannot be synchronised. Train on GPUs (accelerator='gpu'), or drop sync_batchnorm=True: "
            "each rank then normalises by its own batch's statistics, and the running statistics are rank 0's, "
            "broadcast before each training step (broadcast_buffers=True, as under DDP).")
    return synced


@contextlib.contextmanager
def one_forward(sync: Optional[BufferBroadcast]) -> Iterator[None]:
    """What DDP does around a forward it wraps (for the Trainer, a training or validation step while
    fitting): the buffer broadcast before it when due, and after it whether the next is due; nothing
    after a step that raised, as DDP."""
    if sync is None:
        yield
        return
    sync.before_forward()
    yield
    sync.after_forward()


@contextlib.contextmanager
def no_sync(sync: Optional[BufferBroadcast]) -> Iterator[None]:
    """Forwards inside do not sync gradients (DDP's ``no_sync``): the next forward broadcasts nothing."""
    if sync is None:
        yield
        return
    before, sync.no_sync = sync.no_sync, True
    try:
        yield
    finally:
        sync.no_sync = before
