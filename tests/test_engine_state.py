"""The optimizer state dict is the unsharded one: equal to what DDP's optimizer holds, and loadable
across stages and world sizes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from zero_strategy import ZeroConfig, ZeroOptimizer, gathered_parameters
from zero_strategy.engine import shard_module

from .distributed import run_distributed
from .models import OddMLP, batch, make_optimizer, param_groups
from .test_engine_parity import TINY_BUCKET_MB


def _steps(model, opt, rank, start, stop):
    losses = []
    for step in range(start, stop):
        x, y = batch(step, rank)
        loss = F.mse_loss(model(x, step, 0), y)  # the same modules on every rank, as stage 3 needs
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _assert_state_equal(got: dict, want: dict) -> None:
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys(), (sorted(got["state"]), sorted(want["state"]))
    for index, entry in want["state"].items():
        assert got["state"][index].keys() == entry.keys(), index
        for key, value in entry.items():
            torch.testing.assert_close(got["state"][index][key], value, rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"param {index} {key}: {m}")


def _zero(model, optimizer, config):
    user_opt = make_optimizer(optimizer, param_groups(model))  # groups by p.dim(): before sharding
    sharder = shard_module(model, config) if config.stage == 3 else None
    return ZeroOptimizer(user_opt, config, sharder=sharder)


def _save_and_reload(rank, world_size, optimizer, save_stage, load_stage):
    torch.manual_seed(0)
    model = OddMLP()
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(reference, find_unused_parameters=True)
    ddp_opt = make_optimizer(optimizer, param_groups(reference))
    _steps(lambda x, s, r: ddp(x, s, r), ddp_opt, rank, 0, 5)

    units = dict(shard_modules=("Linear",), param_persistence_threshold=0)
    opt = _zero(model, optimizer, ZeroConfig(stage=save_stage, bucket_cap_mb=TINY_BUCKET_MB, **units))
    _steps(model, opt, rank, 0, 5)
    saved = opt.state_dict()
    _assert_state_equal(saved, ddp_opt.state_dict())  # step 5 skipped 'sometimes': state count differs

    # a fresh model and optimizer at another stage and bucket size load the state and go on like DDP
    resumed = OddMLP()
    with gathered_parameters(model):
        resumed.load_state_dict(model.state_dict())
    opt2 = _zero(resumed, optimizer, ZeroConfig(stage=load_stage, **units))
    opt2.load_state_dict(saved)
    ddp_losses = _steps(lambda x, s, r: ddp(x, s, r), ddp_opt, rank, 5, 9)
    zero_losses = _steps(resumed, opt2, rank, 5, 9)
    _assert_state_equal(opt2.state_dict(), ddp_opt.state_dict())
    return zero_losses, ddp_losses


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("save_stage, load_stage", [(2, 1), (1, 2), (3, 1), (2, 3)])
def test_state_dict_is_ddps_and_reloads_at_another_stage(optimizer, save_stage, load_stage):
    for zero_losses, ddp_losses in run_distributed(_save_and_reload, 2, optimizer, save_stage, load_stage):
        torch.testing.assert_close(torch.tensor(zero_losses), torch.tensor(ddp_losses), rtol=1e-5, atol=1e-7)


def _save_two_ranks(rank, world_size):
    torch.manual_seed(0)
    model = OddMLP()
    opt = ZeroOptimizer(make_optimizer("adamw", param_groups(model)), ZeroConfig(stage=2, bucket_cap_mb=TINY_BUCKET_MB))
    _steps(model, opt, rank, 0, 4)
    return {"model": model.state_dict(), "optim": opt.state_dict()}


@pytest.mark.timeout(120)
def test_two_rank_state_loads_in_one_process():
    saved = run_distributed(_save_two_ranks, 2)
    torch.testing.assert_close(saved[0]["optim"]["state"], saved[1]["optim"]["state"])  # every rank holds it whole
    model = OddMLP()
    model.load_state_dict(saved[0]["model"])
    opt = ZeroOptimizer(make_optimizer("adamw", param_groups(model)), ZeroConfig(stage=1))
    opt.load_state_dict(saved[0]["optim"])
    _assert_state_equal(opt.state_dict(), saved[0]["optim"])


def test_loading_a_state_for_another_model_names_the_problem():
    model = OddMLP()
    opt = ZeroOptimizer(make_optimizer("adam", param_groups(model)), ZeroConfig(stage=2))
    _steps(model, opt, 0, 0, 1)
    good = opt.state_dict()
    with pytest.raises(ValueError, match="1 param groups, this optimizer has 2"):
        opt.load_state_dict({**good, "param_groups": good["param_groups"][:1]})
    bad = copy.deepcopy(good)
    first = next(iter(bad["state"]))
    bad["state"][first]["exp_avg"] = torch.zeros(3)
    with pytest.raises(ValueError, match=f"'exp_avg' of parameter {first} has shape \\(3,\\)"):
        opt.load_state_dict(bad)
    with pytest.raises(ValueError, match="needs the keys 'state' and 'param_groups'"):
        opt.load_state_dict({"state": {}})
