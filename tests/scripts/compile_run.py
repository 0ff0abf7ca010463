"""A LightningModule whose network is compiled in configure_model, fit with ZeroStrategy at stage 3
on 2 CPU processes (popen: this script runs once per rank), against the same fit without compile
in the same processes. Each rank writes both runs' losses to OUT/rank{r}.pt.

    python compile_run.py --out DIR
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zero_strategy import ZeroStrategy


class Block(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(L.LightningModule):
    def __init__(self, compiled: bool) -> None:
        super().__init__()
        self.compiled = compiled
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if hasattr(self, "net"):
            return
        torch.manual_seed(0)
        net = nn.Sequential(*[Block() for _ in range(4)], nn.Linear(32, 1))
        self.net = torch.compile(net) if self.compiled else net  # the network, not the LightningModule

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit(compiled: bool) -> tuple[list[float], int]:
    L.seed_everything(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 32, generator=g), torch.randn(64, 1, generator=g))
    model = Net(compiled)
    trainer = L.Trainer(strategy=ZeroStrategy(stage=3, shard_modules=["Block"], param_persistence_threshold=0),
                        accelerator="cpu", devices=2, max_steps=5, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=4))
    return model.losses, trainer.global_rank


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    eager, rank = fit(compiled=False)
    compiled, _ = fit(compiled=True)
    graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    torch.save({"eager": eager, "compiled": compiled, "graphs": graphs}, os.path.join(args.out, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
