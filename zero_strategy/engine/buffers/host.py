"""Host memory for what offload keeps off the device: pinned when it is copied to and from CUDA.

[Note: where offloaded bytes live]
With ``offload_optimizer`` the fp32 master shard (see [Note: master copies] in engine/buffers/flat.py), the
gradient shard the step reads, and the inner optimizer's state all live in host memory (pinned
when the parameters are on CUDA, so copies to and from the device run asynchronously). The device
keeps only the working weights and the staging buffers of the reductions in flight. On a CPU run
the host *is* the device: the same copies happen, between two CPU tensors, so the CPU tests check
exactly the code that runs on a GPU. fp32 parameters get a host master copy too (the device
weights are the working copy), except at stage 3 with ``offload_params``, where the host shard is
already fp32 and is its own master.
"""

from __future__ import annotations

import contextlib

import torch

from ..diagnose import breakdown
from ..diagnose.ranges import span

HOST = torch.device("cpu")


def host_empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host memory for ``numel`` elements, pinned when it is copied to and from a CUDA ``device``."""
    return torch.empty(numel, dtype=dtype, device=HOST, pin_memory=device.type == "cuda")


def host_copy(tensor: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host (pinned for CUDA) copy of ``tensor`` in ``dtype``; always a new tensor."""
    out = host_empty(tensor.numel(), dtype, device)
    out.copy_(tensor.reshape(-1))
    return out


def wait_for_copies(device: torch.device) -> None:
    """Block until the non-blocking copies queued on ``device`` are done (nothing to wait for on CPU);
    the wait counts as the step's ``offload`` (see [Note: the step breakdown] in engine/diagnose/breakdown.py)."""
    if device.type == "cuda":
        timer = breakdown.active()
        with span(lambda: "zero/offload wait for copies"), \
                timer.waiting(breakdown.OFFLOAD) if timer is not None else contextlib.nullcontext():
            torch.cuda.current_stream(device).synchronize()
