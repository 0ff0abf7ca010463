"""The engine against DDP (and a single process), same seed and data, fp32: losses and parameters."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from zero_strategy.config import ZeroConfig
from zero_strategy.engine import ZeroOptimizer

from .distributed import run_distributed
from .models import OddMLP, batch, make_optimizer, param_groups

STEPS = 12
TINY_BUCKET_MB = 200 * 4 / 2**20  # ~200 fp32 elements: several segments, some parameters alone


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 0.1 * step))


def _train(model, opt, sched, rank, forward_rank, steps=STEPS):
    losses = []
    for step in range(steps):
        x, y = batch(step, rank)
        loss = F.mse_loss(model(x, step, forward_rank), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def _ddp_vs_zero(rank, world_size, stage, optimizer, bucket_mb):
    torch.manual_seed(0)
    model = OddMLP()
    reference = copy.deepcopy(model)

    ddp = DistributedDataParallel(reference, find_unused_parameters=True)
    ddp_opt = make_optimizer(optimizer, param_groups(reference))
    ddp_losses = _train(lambda x, s, r: ddp(x, s, r), ddp_opt, _schedule(ddp_opt), rank, rank)

    opt = ZeroOptimizer(make_optimizer(optimizer, param_groups(model)), ZeroConfig(stage=stage, bucket_cap_mb=bucket_mb))
    zero_losses = _train(model, opt, _schedule(opt.optim), rank, rank)
    params = {n: (p.detach().clone(), q.detach().clone())
              for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters())}
    return zero_losses, ddp_losses, params


def _assert_parity(zero_losses, ref_losses, params):
    torch.testing.assert_close(torch.tensor(zero_losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
    for name, (p, q) in params.items():
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("bucket_mb", [TINY_BUCKET_MB, 25.0], ids=["many-buckets", "one-bucket"])
def test_two_ranks_match_ddp(stage, optimizer, bucket_mb):
    for rank_result in run_distributed(_ddp_vs_zero, 2, stage, optimizer, bucket_mb):
        _assert_parity(*rank_result)


@pytest.mark.parametrize("stage", [1, 2])
def test_world_size_one_matches_plain_training(stage):
    torch.manual_seed(0)
    model = OddMLP()
    reference = copy.deepcopy(model)
    ref_opt = make_optimizer("adamw", param_groups(reference))
    ref_losses = _train(reference, ref_opt, _schedule(ref_opt), 0, 0)
    opt = ZeroOptimizer(make_optimizer("adamw", param_groups(model)), ZeroConfig(stage=stage, bucket_cap_mb=TINY_BUCKET_MB))
    zero_losses = _train(model, opt, _schedule(opt.optim), 0, 0)
    params = {n: (p.detach(), q.detach()) for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters())}
    _assert_parity(zero_losses, ref_losses, params)


class SharedInsideCheckpoint(torch.nn.Module):
    """``shared`` runs inside a reentrant checkpoint and again outside it, so it gets two gradients
    in one backward, the second after its segment may have been reduced already."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 9)
        self.shared = torch.nn.Linear(9, 9)
        self.out = torch.nn.Linear(9, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.shared(t)), h, use_reentrant=True)
        return self.out(torch.tanh(self.shared(h)))


REENTRANT_BUCKET_MB = 40 * 4 / 2**20  # each weight in a segment of its own


@pytest.mark.parametrize("stage", [1, 2])
def test_an_fp64_model_is_stepped_in_fp64(stage):
    """fp64 weights are their own master copy, as fp32 weights are: an fp32 copy (the bf16/fp16 one)
    would round every step to fp32's 1e-8 and drift from plain training."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = OddMLP()
        reference = copy.deepcopy(model)
        ref_opt = make_optimizer("adamw", param_groups(reference))
        ref_losses = _train(reference, ref_opt, _schedule(ref_opt), 0, 0)
        opt = ZeroOptimizer(make_optimizer("adamw", param_groups(model)), ZeroConfig(stage=stage))
        zero_losses = _train(model, opt, _schedule(opt.optim), 0, 0)
    finally:
        torch.set_default_dtype(default)
    assert all(g.master_shard is None for g in opt.groups)
    torch.testing.assert_close(torch.tensor(zero_losses), torch.tensor(ref_losses), rtol=1e-13, atol=1e-13)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.dtype == torch.float64
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-13, atol=1e-13, msg=lambda m: f"{name}: {m}")


def _reentrant(rank, world_size, stage):
    import torch.distributed as dist

    torch.manual_seed(0)
    model = SharedInsideCheckpoint()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    opt = ZeroOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), ZeroConfig(stage=stage, bucket_cap_mb=REENTRANT_BUCKET_MB))
    losses = []
    for step in range(6):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(5, 6, generator=g, requires_grad=True), torch.randn(5, 3, generator=g)
        for m, o in ((reference, ref_opt), (model, opt)):
            o.zero_grad()
            loss = F.mse_loss(m(x), y)
            loss.backward()
            if o is ref_opt:  # data parallel by hand: average every gradient, as DDP would
                for p in reference.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world_size
            o.step()
            losses.append(loss.item())
    params = {n: (p.detach().clone(), q.detach().clone())
              for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters())}
    return losses[1::2], losses[0::2], params


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2])
def test_reentrant_checkpoint_gradients_are_all_reduced(stage):
    for rank_result in run_distributed(_reentrant, 2, stage):
        _assert_parity(*rank_result)
