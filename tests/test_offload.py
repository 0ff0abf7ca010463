"""Optimizer, parameter and disk offload against the same run without offload: fp32, 2 gloo ranks.

On CPU the host and the device are the same memory, so these check correctness: the same copies
(master to working weights, gradients to the host shard) and the same tiled host step run as on
a GPU. Equal within 1e-6 at every stage.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from zero_strategy import ZeroConfig, ZeroOptimizer, estimate_memory, gathered_parameters, memory_stats
from zero_strategy.engine import shard_module
from zero_strategy.engine.optim.step.disk import DiskState
from zero_strategy.engine.optim.step.host import host_optimizer_kwargs
from zero_strategy.engine.optim.step.disk import DiskStep
from zero_strategy.engine.optim.tiles import TilePart, plan_tiles

from .distributed import run_distributed
from .models import OddMLP, batch, param_groups
from .test_engine_parity import TINY_BUCKET_MB

STEPS = 7
TINY_TILE_MB = 50 * 4 / 2**20  # 50 fp32 elements: pieces split across tiles, several tiles per group
UNITS = dict(shard_modules=("Linear",), param_persistence_threshold=8)  # stage 3: biases stay whole


def _run(rank, stage, options, accumulate=False, round_trip=False):
    """Train OddMLP for STEPS steps (AdamW, two param groups, LR schedule, clipping)."""
    torch.manual_seed(0)
    model = OddMLP()
    config = ZeroConfig(stage=stage, bucket_cap_mb=TINY_BUCKET_MB, **(UNITS if stage == 3 else {}), **options)
    user_opt = torch.optim.AdamW(param_groups(model), lr=0.01)
    sharder = shard_module(model, config) if stage == 3 else None
    opt = ZeroOptimizer(user_opt, config, sharder=sharder)
    sched = torch.optim.lr_scheduler.LambdaLR(user_opt, lambda s: 1.0 / (1 + 0.1 * s))
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(2 if accumulate else 1):
            x, y = batch(10 * step + micro, rank)
            loss = F.mse_loss(model(x, step, 0), y)  # the same modules on every rank (stage 3)
            loss.backward()
            losses.append(loss.item())
        opt.clip_grad_norm_(0.5)
        opt.step()
        sched.step()
        if round_trip and step == 2:  # state out of the files and back in: see [Note: offloaded step] in
                                      # zero_strategy/engine/optim/step/host.py
            opt.load_state_dict(opt.state_dict())
    state = opt.state_dict()
    with gathered_parameters(model):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats = memory_stats(model, [opt])
    files = sorted(os.listdir(opt.step_backend.disk.folder)) if isinstance(opt.step_backend, DiskStep) else []
    opt.close()
    return losses, params, state, stats, files


def _variants(rank, world_size, stage, folder, accumulate):
    runs = {"plain": {}, "optimizer": dict(offload_optimizer=True),
            "disk": dict(offload_optimizer=True, offload_dir=folder, offload_tile_mb=TINY_TILE_MB)}
    if stage == 3:
        runs["params"] = dict(offload_params=True)
        runs["disk+params"] = dict(offload_params=True, **runs.pop("disk"))
        runs["optimizer+params"] = dict(offload_params=True, **runs.pop("optimizer"))
    return {name: _run(rank, stage, opts, accumulate, round_trip="disk" in name) for name, opts in runs.items()}


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what}: {m}")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage, accumulate", [(1, True), (2, False), (3, True)])
def test_every_offload_mode_matches_the_run_without_it(stage, accumulate, tmp_path):
    for rank_runs in run_distributed(_variants, 2, stage, str(tmp_path), accumulate):
        losses, params, state, _, _ = rank_runs.pop("plain")
        for name, (got_losses, got_params, got_state, stats, files) in rank_runs.items():
            _close(torch.tensor(got_losses), torch.tensor(losses), f"{name} losses")
            for key, value in params.items():
                _close(got_params[key], value, f"{name} {key}")
            assert got_state["param_groups"] == state["param_groups"]
            assert got_state["state"].keys() == state["state"].keys()
            for index, entry in state["state"].items():
                for key, value in entry.items():
                    _close(got_state["state"][index][key], value, f"{name} state {index} {key}")
            assert stats["host"] > 0 and stats["total"] == stats["device"] + stats["host"] + stats["disk"]
            if "disk" in name:
                assert {f.split("-", 1)[1] for f in files} == {"exp_avg.bin", "exp_avg_sq.bin"}
                assert stats["disk"] > 0 and stats["disk"] >= stats["optimizer_states"] - 100  # steps: in memory
    assert os.listdir(tmp_path) == []  # close() removed each run's folder


def test_sgd_momentum_on_disk(tmp_path):
    """SGD's momentum buffer is made by the first step (a clone, not an in-place update): it must
    reach the files all the same. One process: the disk path does not depend on the world size."""
    out = {}
    for name, options in (("plain", {}), ("disk", dict(offload_optimizer=True, offload_dir=str(tmp_path),
                                                        offload_tile_mb=TINY_TILE_MB))):
        torch.manual_seed(0)
        model = OddMLP()
        opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), ZeroConfig(stage=2, **options))
        for step in range(4):
            x, y = batch(step, 0)
            opt.zero_grad()
            F.mse_loss(model(x, step, 0), y).backward()
            opt.step()
        out[name] = ({n: p.detach().clone() for n, p in model.named_parameters()}, opt.state_dict())
        opt.close()
    (plain, plain_state), (disk, disk_state) = out["plain"], out["disk"]
    for key in plain:
        _close(disk[key], plain[key], key)
    assert disk_state["state"].keys() == plain_state["state"].keys()
    for index, entry in plain_state["state"].items():
        _close(disk_state["state"][index]["momentum_buffer"], entry["momentum_buffer"], f"momentum {index}")


def test_tiles_cover_every_element_once():
    ranges = [[(0, 5), (8, 20), (20, 20)], [(0, 3)]]
    for split in (True, False):
        tiles = plan_tiles(ranges, 6, split)
        covered = sorted((p.group, p.start, p.end) for t in tiles for p in t)
        if split:
            assert all(sum(p.end - p.start for p in t) <= 6 for t in tiles)
            merged = {}
            for g, a, b in covered:
                merged.setdefault(g, []).extend(range(a, b))
            assert merged == {0: [*range(0, 5), *range(8, 20)], 1: [0, 1, 2]}
        else:
            assert covered == [(0, 0, 5), (0, 8, 20), (0, 20, 20), (1, 0, 3)]
    assert plan_tiles(ranges, 6, True)[0] == [TilePart(0, 0, 0, 5), TilePart(0, 1, 8, 9)]


def test_host_step_is_fused_unless_the_user_chose():
    assert host_optimizer_kwargs(torch.optim.AdamW, {"foreach": None, "fused": None})["fused"] is True
    assert host_optimizer_kwargs(torch.optim.SGD, {"foreach": None, "fused": None}, [torch.float32])["fused"] is True
    bf16 = host_optimizer_kwargs(torch.optim.SGD, {"foreach": None, "fused": None}, [torch.bfloat16])
    assert bf16["foreach"] is True and not bf16["fused"]  # torch's fused CPU SGD does not repeat there
    assert host_optimizer_kwargs(torch.optim.AdamW, {"foreach": False, "fused": None}) == {"foreach": False,
                                                                                          "fused": None}
    assert host_optimizer_kwargs(torch.optim.RMSprop, {"foreach": None})["foreach"] is True


def test_disk_state_round_trips_and_refuses_a_file_as_folder(tmp_path):
    disk = DiskState(str(tmp_path), 0, [10])
    disk.write(0, "exp_avg", 3, torch.arange(4, dtype=torch.float32))
    assert torch.equal(disk.read(0, "exp_avg", 4, torch.empty(3)), torch.tensor([1.0, 2.0, 3.0]))
    assert disk.nbytes() == 40
    disk.close()
    assert os.listdir(tmp_path) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="offload_dir=.*file.*writable folder"):
        DiskState(str(tmp_path / "file"), 0, [10])


def test_single_process_offload_matches_and_counts_host_bytes(tmp_path):
    def run(**options):
        torch.manual_seed(0)
        model = OddMLP()
        opt = ZeroOptimizer(torch.optim.Adam(param_groups(model), lr=0.01), ZeroConfig(stage=2, **options))
        for step in range(3):
            x, y = batch(step, 0)
            opt.zero_grad()
            F.mse_loss(model(x, step, 0), y).backward()
            opt.step()
        stats = memory_stats(model, [opt])
        stats["host_grads"] = sum(t.untyped_storage().nbytes() for t in opt.reducer.host_tensors())
        opt.close()
        return [p.detach().clone() for p in model.parameters()], stats

    plain, plain_stats = run()
    host, host_stats = run(offload_optimizer=True)
    disk, disk_stats = run(offload_optimizer=True, offload_dir=str(tmp_path))
    for a, b, c in zip(plain, host, disk):
        _close(b, a, "host")
        _close(c, a, "disk")
    assert plain_stats["host"] == 0 and plain_stats["disk"] == 0
    # host: the fp32 master copy, the gradient shard and the optimizer state; the device keeps the
    # working weights and the reused staging buffers of the reductions
    assert host_stats["host_grads"] > 0
    assert host_stats["host"] == host_stats["master_params"] + host_stats["optimizer_states"] + host_stats["host_grads"]
    assert host_stats["device"] == host_stats["params"] + host_stats["grads"] - host_stats["host_grads"]
    assert plain_stats["master_params"] == 0 < host_stats["master_params"]  # fp32 gets a host master copy
    # disk: Adam's moments in files, only the step counts in memory
    assert disk_stats["disk"] > 0 and disk_stats["host"] < host_stats["host"]
    assert disk_stats["optimizer_states"] - disk_stats["disk"] < 100


def test_estimate_places_offloaded_bytes():
    est = estimate_memory(1000, stage=3, world_size=2, precision="bf16-mixed", offload_optimizer=True,
                          offload_params=True, offload_disk=True)
    assert est["disk"] == est["optimizer_states"] == 4000
    assert est["device"] == 0  # everything sharded lives off the device between uses
    assert est["total"] == est["device"] + est["host"] + est["disk"]


@pytest.mark.timeout(900)  # may wait for DDP's launch of every case test_lightning.py needs
@pytest.mark.parametrize("strategy", ["zero_stage_3_offload"])  # optimizer and parameter offload; ~40 s
def test_registered_offload_strategies_match_ddp_through_the_trainer(tmp_root, strategy):
    # tests/scripts/lightning_run.py: fit with validation, a scheduler, a frozen layer, two param groups
    from .test_lightning import assert_same_run, ddp_run, zero_runs

    zero = zero_runs(tmp_root, strategy)["plain"]  # from test_lightning.py's one launch of every ZeRO case
    assert all(z["memory"]["host"] > 0 for z in zero)
    assert_same_run(zero, ddp_run(tmp_root))  # the DDP launch test_lightning.py's tests share


@pytest.mark.parametrize("sharder_offloads", [True, False])
def test_sharder_and_optimizer_must_agree_on_offload(sharder_offloads):
    model = OddMLP()
    user_opt = torch.optim.Adam(model.parameters())
    sharder = shard_module(model, ZeroConfig(stage=3, offload_optimizer=sharder_offloads, **UNITS))
    with pytest.raises(ValueError, match=f"offload_optimizer={not sharder_offloads} here, {sharder_offloads} in the "
                                         "sharder's"):
        ZeroOptimizer(user_opt, ZeroConfig(stage=3, offload_optimizer=not sharder_offloads, **UNITS), sharder=sharder)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_weights_with_a_host_master_match_and_skip_overflow(dtype):
    """Mixed precision: the fp32 master and gradients on the host, half working weights; an fp16
    loss scale divides the host gradients, and an inf skips the step as without offload."""
    from zero_strategy.engine import LossScaler

    def run(**options):
        torch.manual_seed(0)
        model = OddMLP().to(dtype)
        scaler = LossScaler(scale=2.0**8, hysteresis=1) if dtype == torch.float16 else None
        opt = ZeroOptimizer(torch.optim.AdamW(param_groups(model), lr=0.01), ZeroConfig(stage=2, **options),
                            scaler=scaler)
        for step in range(4):
            x, y = batch(step, 0)
            if step == 2 and scaler:
                y[0, 0] = float("inf")  # an overflow on the way: this step is skipped
            opt.zero_grad()
            loss = F.mse_loss(model(x.to(dtype), step, 0).float(), y)
            (loss * (scaler.scale if scaler else 1.0)).backward()
            opt.step()
        masters = [g.master_shard for g in opt.groups]
        rounded = all(torch.equal(g.weights(piece), g.shard_slice(g.master_shard, piece).to(dtype))
                      for g in opt.groups for piece in g.pieces)  # the write-back: each weight its master, rounded
        return masters, opt.state_dict()["state"], rounded, opt

    plain, plain_state, plain_rounded, _ = run()
    host, host_state, host_rounded, opt = run(offload_optimizer=True)
    assert all(m.dtype == torch.float32 and m.device.type == "cpu" for m in host)
    assert plain_rounded and host_rounded
    if dtype == torch.float16:
        assert opt.scaler.scale < 2.0**8  # the overflow halved it
    assert len(plain) == len(host) > 0
    for i, (a, b) in enumerate(zip(plain, host)):  # the fp32 masters: a step skipped or taken twice moves them by lr
        _close(b, a, f"master {i}")
    assert host_state.keys() == plain_state.keys()
    for index, entry in plain_state.items():
        for key, value in entry.items():
            _close(host_state[index][key], value, f"state {index} {key}")



def test_offloaded_sgd_on_bf16_masters_repeats():
    """master_weights=False with offload: SGD with momentum steps bf16 host tensors. Stepped all at
    once (one tile) or segment by segment (offload_overlap), the results agree bit for bit."""
    runs = []
    for overlap in (False, True):
        torch.manual_seed(0)
        model = OddMLP().to(torch.bfloat16)
        opt = ZeroOptimizer(torch.optim.SGD(param_groups(model), lr=0.05, momentum=0.9),
                            ZeroConfig(stage=2, bucket_cap_mb=TINY_BUCKET_MB, offload_optimizer=True,
                                       master_weights=False, offload_overlap=overlap))
        for step in range(4):
            x, y = batch(step, 0)
            opt.zero_grad()
            F.mse_loss(model(x.to(torch.bfloat16), step, 0).float(), y).backward()
            opt.step()
        state = opt.state_dict()["state"]
        runs.append([p.detach().clone() for p in model.parameters()] +
                    [state[i]["momentum_buffer"] for i in sorted(state)])
        opt.close()
    assert len(runs[0]) == len(runs[1]) > 10 and all(torch.equal(a, b) for a, b in zip(*runs))
