"""``offload_activations`` is applied by the engine's setup, so Fabric (which has no step wrapper of
its own) gets it too: see [Note: activation offload in every front end].

On a CPU the offload keeps tensors where they are, but it takes over every tensor autograd saves
inside the forward, so a meter around the call (the outer hooks) sees only what the loss saves.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from .distributed import run_distributed
from .test_fabric import Net, fabric_for, micro_batch, zero


def _storage_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def _saved_by_fabric(rank: int, world_size: int) -> dict:
    from zero_strategy import SavedActivationMeter

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # processes exist already, as under torchrun
    out = {}
    for stage in (2, 3):
        for offload in (False, True):
            fabric = fabric_for(zero(stage, offload_activations=offload), world_size)
            torch.manual_seed(0)
            net = Net()
            model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
            losses, saved = [], []
            for step in range(2):
                x, y = micro_batch(step, rank)
                with SavedActivationMeter() as meter:
                    prediction = model(x)
                    loss = F.mse_loss(prediction, y)
                saved.append((meter.bytes, _storage_bytes(prediction, y)))  # mse_loss saves its input and target
                fabric.backward(loss)
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            out[(stage, offload)] = {"saved": saved, "losses": losses}
    return out


@pytest.mark.timeout(120)
def test_fabric_offloads_what_the_forward_saves():
    for runs in run_distributed(_saved_by_fabric, 2):
        for stage in (2, 3):
            kept, offloaded = runs[(stage, False)], runs[(stage, True)]
            for (kept_bytes, loss_bytes), (left_bytes, loss_bytes_too) in zip(kept["saved"], offloaded["saved"]):
                assert left_bytes == loss_bytes_too, f"stage {stage}: the forward's activations were not offloaded"
                assert kept_bytes > 4 * loss_bytes, f"stage {stage}: without offload the forward saves activations"
            assert kept["losses"] == offloaded["losses"]  # on a CPU the offload moves nothing
