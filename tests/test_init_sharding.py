"""Stage 3 init-time sharding: a model built on the meta device never exists whole on a rank, and
its initial values do not depend on the world size."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero_strategy import ZeroConfig
from zero_strategy.engine import Collectives, shard_module

from .distributed import run_distributed


class Tower(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(self.blocks(x))


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def _build_sharded(width: int, depth: int, seed: int = 0):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Tower(width, depth)
    config = ZeroConfig(stage=3, shard_modules=(nn.Linear,), param_persistence_threshold=0)
    return model, shard_module(model, config, Collectives(),
                               torch.device("cpu"))


def _peak_while_sharding(rank, world_size):
    before = _rss_kib("VmRSS:")
    assert _rss_kib("VmHWM:") - before < 50 * 1024, "the process peaked before: the measurement would hide it"
    model, sharder = _build_sharded(width=2048, depth=24)  # 100.7M parameters, 403 MB in fp32
    peak = (_rss_kib("VmHWM:") - before) * 1024
    full = sum(g.layout.numel for g in sharder.groups) * 4
    held = sum(t.numel() * t.element_size() for t in sharder.held_tensors())
    return peak, full, held


@pytest.mark.timeout(240)
def test_a_100m_model_never_exists_whole_on_a_rank(monkeypatch):
    # glibc otherwise raises its mmap threshold after the first large free and keeps later freed
    # buffers in its heap, so the resident set would count memory the program has released
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    # fresh: the peak resident set and $MALLOC_MMAP_THRESHOLD_ belong to a process, not to a call
    for peak, full, held in run_distributed(_peak_while_sharding, 2, fresh=True):
        assert full > 400e6
        assert held == pytest.approx(full / 2, rel=0.01)  # each rank keeps half
        unit = 2048 * 2049 * 4  # one Linear: 16.8 MB
        # the peak is this rank's half plus a couple of units being built, far below the whole model
        assert peak < full / 2 + 3 * unit, f"peak {peak / 1e6:.0f} MB for a {full / 1e6:.0f} MB model"


def _state_at(rank, world_size):
    _, sharder = _build_sharded(width=64, depth=5)
    return sharder.full_state_dict()


@pytest.mark.timeout(120)
def test_initial_values_do_not_depend_on_world_size():
    two = run_distributed(_state_at, 2)
    _, sharder = _build_sharded(width=64, depth=5)  # one process, world size 1
    one = sharder.full_state_dict()
    assert one.keys() == two[0].keys() == two[1].keys()
    for key in one:
        assert torch.equal(one[key], two[0][key]) and torch.equal(one[key], two[1][key]), key
    assert not torch.equal(one["blocks.0.weight"], one["blocks.1.weight"])  # really initialised
