"""Mixed precision in the engine: overflow on one rank skips the step everywhere, and memory at
bf16-mixed follows the ZeRO paper's formula (K = 12)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zero_strategy import ZeroConfig, ZeroOptimizer, estimate_memory, gathered_parameters, memory_stats
from zero_strategy.engine import LossScaler, shard_module

from .distributed import run_distributed


class Stack(nn.Module):
    def __init__(self, width: int = 128, depth: int = 40) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x


def _engine(model, stage, dtype, scaler=None, bucket_mb=25.0):
    model.to(dtype)
    config = ZeroConfig(stage=stage, bucket_cap_mb=bucket_mb, shard_modules=("Linear",), param_persistence_threshold=0)
    user_opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sharder = shard_module(model, config) if stage == 3 else None
    return ZeroOptimizer(user_opt, config, sharder=sharder, scaler=scaler)


def _snapshot(model, opt):
    with gathered_parameters(model):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, opt.state_dict()["state"]


def _overflow(rank, world_size, stage):
    torch.manual_seed(0)
    model = Stack(width=16, depth=3)
    scaler = LossScaler(scale=256.0, hysteresis=2)
    opt = _engine(model, stage, torch.float16, scaler)
    poison = model.layers[1].weight.register_hook(lambda g: g * float("inf") if rank == 0 and inject else g)
    log = []
    for step in range(6):
        inject = step in (2, 3)  # rank 0 only
        before = _snapshot(model, opt)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step + 10 * rank)).half()
        opt.zero_grad()
        (model(x).float().pow(2).mean() * scaler.scale).backward()
        opt.step()
        after = _snapshot(model, opt)
        unchanged = all(torch.equal(before[0][n], after[0][n]) for n in before[0]) and all(
            torch.equal(before[1][i][k], after[1][i][k]) for i in before[1] for k in before[1][i])
        log.append((opt.overflowed, unchanged, scaler.scale, scaler.overflows_left, scaler.skipped_steps))
    poison.remove()
    return log


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_overflow_on_one_rank_skips_the_step_on_every_rank(stage):
    for log in run_distributed(_overflow, 2, stage):
        overflowed = [entry[0] for entry in log]
        assert overflowed == [False, False, True, True, False, False]
        assert [entry[1] for entry in log] == [False, False, True, True, False, False]  # skipped: no change
        # first overflow: hysteresis 2 -> 1, scale kept; second: scale halves, and the hysteresis stays
        # spent until the scale grows again, as DeepSpeed's (see [Note: DeepSpeed's dynamic loss scale])
        assert [(entry[2], entry[3]) for entry in log[1:4]] == [(256.0, 2), (256.0, 1), (128.0, 1)]
        assert log[-1][4] == 2  # two steps skipped, then training went on


def _memory(rank, world_size, stage):
    torch.manual_seed(0)
    model = Stack()
    n = sum(p.numel() for p in model.parameters())
    opt = _engine(model, stage, torch.bfloat16, bucket_mb=0.05)
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(rank)).bfloat16()
    model(x).float().pow(2).mean().backward()
    opt.step()
    return memory_stats(model, [opt]), n


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_mixed_memory_follows_the_formula(stage):
    for stats, n in run_distributed(_memory, 2, stage):
        expected = estimate_memory(n, stage=stage, world_size=2, precision="bf16-mixed")
        assert stats["total"] == pytest.approx(expected["total"], rel=0.05), (stats, expected)
        assert stats["master_params"] == pytest.approx(expected["master_params"], rel=0.01)
        assert stats["params"] == pytest.approx(expected["params"], rel=0.01)
