"""Small models and data shared by the tests."""

from __future__ import annotations

import torch
from torch import nn

from zero_strategy.config import ZeroConfig


class Block(nn.Module):
    """A residual MLP block: a stage-3 unit of ``BlockNet`` (``shard_modules=("Block",)``)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.proj(torch.tanh(self.fc(x)))


class BlockNet(nn.Module):
    """An input layer of 8 features (the root unit at stage 3), three blocks (units), a head of 1."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(3))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def block_net_config(stage: int, **options) -> ZeroConfig:
    """BlockNet's settings: each Block a unit at stage 3, nothing resident, several segments per group."""
    stage3 = dict(shard_modules=("Block",), param_persistence_threshold=0) if stage == 3 else {}
    return ZeroConfig(stage=stage, bucket_cap_mb=0.002, **stage3, **options)


class OddMLP(nn.Module):
    """Odd sizes, a frozen layer, a layer used only in some steps, and one used on rank 0 only.

    ``forward(x, step, rank)``: ``sometimes`` runs every third step on every rank (so in the other
    steps no rank gives it a gradient); ``rank0_only`` runs on rank 0 only (so it is reduced with a
    zero contribution from the other ranks).
    """

    def __init__(self, d_in: int = 7, hidden: int = 13, d_out: int = 5) -> None:
        super().__init__()
        self.frozen = nn.Linear(d_in, d_in)
        self.frozen.requires_grad_(False)
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.sometimes = nn.Linear(hidden, hidden)
        self.rank0_only = nn.Linear(hidden, hidden, bias=False)
        self.head = nn.Linear(hidden, d_out)
        self.scale = nn.Parameter(torch.ones(1))  # numel 1: smaller than the world size
        self.empty = nn.Parameter(torch.zeros(0))  # numel 0

    def forward(self, x: torch.Tensor, step: int = 0, rank: int = 0) -> torch.Tensor:
        h = torch.tanh(self.fc1(torch.tanh(self.frozen(x))))
        h = torch.tanh(self.fc2(h))
        if step % 3 == 0:
            h = h + torch.tanh(self.sometimes(h))
        if rank == 0:
            h = h + 0.5 * self.rank0_only(h)
        return self.head(h) * self.scale + self.empty.sum()


def param_groups(model: OddMLP) -> list[dict]:
    """Two groups with different hyperparameters: matrices with weight decay, the rest without."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 0.02}]


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=0.01)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    raise ValueError(name)


def batch(step: int, rank: int, n: int = 8, d_in: int = 7, d_out: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)
