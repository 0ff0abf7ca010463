"""A Fabric training loop on 2 CPU processes with ZeRO stage 3, launched as users launch it: by
``fabric.launch()`` (this script starts rank 1 itself) or by torchrun (which starts both). Each rank
writes what it saw to OUT/rank{r}.pt for tests/test_fabric_launch.py.

    python fabric_run.py --out DIR                          # fabric.launch() starts rank 1
    torchrun --nproc-per-node 2 fabric_run.py --out DIR     # torchrun started both: fabric.launch() joins
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning as L
import torch
import torch.nn.functional as F

import zero_strategy  # noqa: F401  (the import registers "zero_stage_3" with Fabric)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.test_fabric import Net, micro_batch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    fabric = L.Fabric(strategy="zero_stage_3", accelerator="cpu", devices=2, precision="bf16-mixed")
    fabric.launch()  # starts the other ranks, or (under torchrun, srun) finds them started
    fabric.seed_everything(0)
    with fabric.init_module(empty_init=True):  # on meta: each rank materialises and keeps its shards only
        model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    model, optimizer = fabric.setup(model, optimizer)
    losses = []
    for step in range(6):
        x, y = fabric.to_device(micro_batch(step, fabric.global_rank))
        boundary = step % 2 == 1
        with fabric.no_backward_sync(model, enabled=not boundary):
            loss = F.mse_loss(model(x), y)
            fabric.backward(loss / 2)
        losses.append(loss.item())
        if boundary:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
    fabric.save(os.path.join(args.out, "run.ckpt"), {"model": model, "optimizer": optimizer, "losses": losses})
    state = {"model": model, "optimizer": optimizer, "losses": []}
    fabric.load(os.path.join(args.out, "run.ckpt"), state)
    weights = {k: v.float() for k, v in fabric.strategy.full_state_dict(model.module).items()}
    mean = fabric.all_reduce(torch.tensor(float(fabric.global_rank)), reduce_op="mean")
    gathered = fabric.all_gather(torch.tensor([fabric.global_rank]))
    source = fabric.broadcast(f"from rank {fabric.global_rank}", src=1)
    fabric.barrier()
    torch.save({"world_size": fabric.world_size, "losses": losses, "reloaded_losses": state["losses"],
                "weights": weights, "mean": mean.item(), "gathered": gathered.flatten().tolist(), "source": source,
                "strategy": type(fabric.strategy).__name__},
               os.path.join(args.out, f"rank{fabric.global_rank}.pt"))
    torch.distributed.destroy_process_group()  # gloo's threads can abort an exiting interpreter


if __name__ == "__main__":
    main()
