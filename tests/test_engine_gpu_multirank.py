"""The engine at world size 2 on one GPU: two processes on cuda:0 over gloo (which takes CUDA tensors
in all_reduce, all_gather_into_tensor, reduce_scatter_tensor and broadcast), against a single-process
full-batch run of plain torch: the fused kernels in the step, bf16 and fp16 with loss scaling, stage
3's prefetch and release, offload, and a sharded checkpoint round trip.

Every test takes the device as a parameter: "cuda" skips without a GPU (benchmarks/gpu_check.sh runs
it where one is lent); "cpu" runs the same code on two gloo CPU processes, so the tests themselves
are checked on every machine.

[Note: the full-batch reference]
Rank r trains on batch(step, r); the reference, one process of plain torch, on both ranks' batches
at once. With equal halves and mean losses, the full batch's gradient is the average of the halves'
gradients, which is what the engine reduces, so both follow one trajectory apart from rounding.
Every rank runs rank 0's modules (``forward(x, step, 0)``), as the reference does, so stage 3 runs
the same units everywhere. In fp32 the tolerances are the other parity tests'. In bf16/fp16 each
half's gradient is rounded to 16 bits before the two are averaged, the full batch's once: they
differ by about one 16-bit ulp of a gradient. SGD turns that into master weights that differ by
lr times it, at most one ulp of the working weights once rounded (TOLERANCE); Adam would turn it
into the sign of near-zero elements' updates (a whole lr), so the mixed-precision runs use SGD with
momentum (Adam's mixed-precision step, fused against torch, is tests/test_engine_gpu.py's).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zero_strategy import ZeroConfig, ZeroOptimizer, gathered_parameters, kernels, memory_stats
from zero_strategy.checkpoint import CheckpointReader, load_model, load_optimizers, save_sharded
from zero_strategy.checkpoint.sharded import flat_groups
from zero_strategy.engine import Collectives, LossScaler, shard_module

from .distributed import run_distributed
from .models import OddMLP, batch, make_optimizer, param_groups
from .test_engine_parity import TINY_BUCKET_MB

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu_check.sh runs it on one)"))]
STEPS = 6
CLIP = 0.5
OVERFLOW_STEP = 2  # fp16 runs: rank 0's gradient of model.scale is inf at this step (the reference's too)
UNITS = dict(shard_modules=("Linear",), param_persistence_threshold=0)  # stage 3: every Linear a unit
# dtype: ((rtol, atol) of the losses, (rtol, atol) of the parameters): see [Note: the full-batch reference]
TOLERANCE = {
    torch.float32: ((1e-5, 1e-7), (1e-5, 1e-6)),
    torch.bfloat16: ((2e-2, 1e-3), (1e-2, 1e-3)),  # bf16: 8 significant bits, ulp 2**-8 to 2**-7 relative
    torch.float16: ((5e-3, 1e-4), (2e-3, 2e-4)),  # fp16: 11 significant bits
}
CASES = {
    # name: (stage, optimizer, dtype, loss scaling, more ZeroConfig fields)
    "s1-adamw": (1, "adamw", torch.float32, False, {}),
    "s2-adamw": (2, "adamw", torch.float32, False, {}),
    "s3-adamw": (3, "adamw", torch.float32, False, {}),
    "s1-sgd": (1, "sgd", torch.float32, False, {}),
    "s2-sgd": (2, "sgd", torch.float32, False, {}),
    "s3-sgd": (3, "sgd", torch.float32, False, {}),
    "s2-bf16": (2, "sgd", torch.bfloat16, False, {}),
    "s3-bf16": (3, "sgd", torch.bfloat16, False, {}),
    "s2-fp16-scaled": (2, "sgd", torch.float16, True, {}),
    "s3-fp16-scaled": (3, "sgd", torch.float16, True, {}),
    "s2-offload": (2, "adamw", torch.float32, False, dict(offload_optimizer=True)),
    "s3-offload": (3, "adamw", torch.float32, False, dict(offload_optimizer=True, offload_params=True)),
    "s3-bf16-offload": (3, "sgd", torch.bfloat16, False, dict(offload_optimizer=True, offload_params=True)),
}


def _device(name: str) -> torch.device:
    if name == "cuda":
        torch.cuda.set_device(0)  # both ranks on the one GPU
        return torch.device("cuda", 0)
    return torch.device("cpu")


def _full_batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    (x0, y0), (x1, y1) = batch(step, 0), batch(step, 1)
    return torch.cat([x0, x1]).to(device), torch.cat([y0, y1]).to(device)


def _poison_at(model: nn.Module, step_of: list[int], poisoned: bool) -> None:
    """Make the gradient of ``model.scale`` inf at OVERFLOW_STEP (where ``poisoned``): an fp16 overflow.
    ``scale`` has one element, so one rank owns it: the other learns of the overflow only from the
    engine's all-reduce of the overflow flag."""
    model.scale.register_hook(lambda g: g * float("inf") if poisoned and step_of[0] == OVERFLOW_STEP else g)


def _scaler(scaled: bool):
    return LossScaler(scale=2.0**10, window=2, hysteresis=1) if scaled else None  # moves within STEPS


def _engine_run(case: str, device: torch.device, rank: int) -> dict:
    stage, optimizer, dtype, scaled, options = CASES[case]
    torch.manual_seed(0)
    model = OddMLP().to(device, dtype)
    config = ZeroConfig(stage=stage, bucket_cap_mb=TINY_BUCKET_MB, **(UNITS if stage == 3 else {}), **options)
    user_opt = make_optimizer(optimizer, param_groups(model))
    sharder = shard_module(model, config) if stage == 3 else None
    scaler = _scaler(scaled)
    opt = ZeroOptimizer(user_opt, config, sharder=sharder, scaler=scaler)
    step_of = [0]
    _poison_at(model, step_of, poisoned=scaled and rank == 0)  # rank 1 learns of it only from the engine
    losses, scales = [], []
    for step in range(STEPS):
        step_of[0] = step
        x, y = (t.to(device) for t in batch(step, rank))
        opt.zero_grad()
        loss = F.mse_loss(model(x.to(dtype), step, 0).float(), y)
        (scaler.scale_loss(loss) if scaler else loss).backward()
        opt.reduce_gradients()
        if not opt.overflowed:  # an overflowing step is skipped: its norm is not a number
            opt.clip_grad_norm_(CLIP)
        opt.step()
        losses.append(loss.item())
        scales.append((scaler.scale, scaler.skipped_steps) if scaler else None)
    with gathered_parameters(model):
        params = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
    stats = memory_stats(model, [opt])
    opt.close()
    return {"losses": losses, "params": params, "scales": scales, "memory": stats}


def _reference_run(case: str, device: torch.device) -> dict:
    """One process, both ranks' batches, plain torch: see [Note: the full-batch reference]."""
    stage, optimizer, dtype, scaled, options = CASES[case]
    torch.manual_seed(0)
    model = OddMLP().to(device, dtype)
    trainable = [p for p in model.parameters() if p.requires_grad]
    mixed = dtype != torch.float32  # fp32 masters of the 16-bit weights, which the optimizer steps
    master = {p: p.detach().float().clone().requires_grad_() if mixed else p for p in trainable}
    groups = [{**g, "params": [master[p] for p in g["params"] if p in master]} for g in param_groups(model)]
    opt = make_optimizer(optimizer, groups)
    scaler = _scaler(scaled)
    step_of = [0]
    _poison_at(model, step_of, poisoned=scaled)
    losses, scales = [], []
    for step in range(STEPS):
        step_of[0] = step
        x, y = _full_batch(step, device)
        model.zero_grad()
        opt.zero_grad()
        loss = F.mse_loss(model(x.to(dtype), step, 0).float(), y)
        (scaler.scale_loss(loss) if scaler else loss).backward()
        if mixed:
            for p, m in master.items():
                m.grad = None if p.grad is None else p.grad.float() / (scaler.scale if scaler else 1.0)
        grads = [m.grad for m in master.values() if m.grad is not None]
        if scaler and not all(torch.isfinite(g).all() for g in grads):
            scaler.update(overflow=True)
        else:
            torch.nn.utils.clip_grad_norm_(list(master.values()), CLIP)
            opt.step()
            if scaler:
                scaler.update(overflow=False)
            with torch.no_grad():
                for p, m in master.items():
                    if m is not p:
                        p.copy_(m)  # rounded into the working weights, as the engine writes them back
        losses.append(loss.item())
        scales.append((scaler.scale, scaler.skipped_steps) if scaler else None)
    params = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "params": params, "scales": scales}


def _cases_vs_reference(rank: int, world_size: int, device_name: str, cases: list[str]) -> dict:
    device = _device(device_name)
    out = {"kernels": kernels.available(torch.empty(1, device=device))}
    for case in cases:
        before = kernels.launch_counts()
        got = _engine_run(case, device, rank)
        launched = {k: v - before.get(k, 0) for k, v in kernels.launch_counts().items() if v != before.get(k, 0)}
        out[case] = {**got, "launched": launched, "reference": _reference_run(case, device)}
    return out


def _assert_matches_reference(case: str, ranks: list[dict]) -> None:
    """Both ranks' runs of ``case`` against the reference each of them ran (the same run twice)."""
    (loss_rtol, loss_atol), (rtol, atol) = TOLERANCE[CASES[case][2]]
    mean_loss = torch.tensor([r[case]["losses"] for r in ranks]).mean(0)  # the full batch's loss
    for rank, out in enumerate(ranks):
        got, want = out[case], out[case]["reference"]
        torch.testing.assert_close(mean_loss, torch.tensor(want["losses"]), rtol=loss_rtol, atol=loss_atol,
                                   msg=lambda m: f"{case} losses: {m}")
        assert got["params"].keys() == want["params"].keys()
        for key, value in want["params"].items():
            torch.testing.assert_close(got["params"][key], value, rtol=rtol, atol=atol,
                                       msg=lambda m: f"{case} {key} on rank {rank}: {m}")
        assert got["scales"] == want["scales"], f"{case} on rank {rank}: loss scale and skipped steps per step"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("device", DEVICES)
def test_fused_step_at_two_ranks_matches_a_full_batch_run(device):
    if device == "cuda" and importlib.util.find_spec("cupy") is None:
        pytest.skip("the fused kernels need CuPy: pip install -e '.[cuda]' (or '.[cuda12]')")
    cases = ["s1-adamw", "s2-adamw", "s3-adamw", "s1-sgd", "s2-sgd", "s3-sgd"]
    ranks = run_distributed(_cases_vs_reference, 2, device, cases)
    for case in cases:
        _assert_matches_reference(case, ranks)
    for out in ranks:
        assert out["kernels"] == (device == "cuda")
        for case in cases:
            launched = out[case]["launched"]
            if device == "cuda":  # the step and the clipping norm ran in the CUDA kernels
                step_kernel = "fused_sgd" if "sgd" in case else "fused_adam"
                assert launched.get(step_kernel, 0) >= STEPS and launched.get("grad_norm", 0) >= STEPS, (case, launched)
            else:
                assert launched == {}, (case, launched)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("device", DEVICES)
def test_bf16_and_fp16_with_loss_scaling_match_a_full_batch_run(device):
    cases = ["s2-bf16", "s3-bf16", "s2-fp16-scaled", "s3-fp16-scaled"]
    ranks = run_distributed(_cases_vs_reference, 2, device, cases)
    for case in cases:
        _assert_matches_reference(case, ranks)
    for out in ranks:
        for case in ("s2-fp16-scaled", "s3-fp16-scaled"):  # the overflow skipped one step on both ranks
            scales = out[case]["scales"]
            assert [skipped for _, skipped in scales] == [0] * OVERFLOW_STEP + [1] * (STEPS - OVERFLOW_STEP), scales
            assert scales[OVERFLOW_STEP][0] == scales[OVERFLOW_STEP - 1][0] / 2, scales


@pytest.mark.timeout(300)
@pytest.mark.parametrize("device", DEVICES)
def test_offload_at_two_ranks_matches_a_full_batch_run(device):
    cases = ["s2-offload", "s3-offload", "s3-bf16-offload"]
    ranks = run_distributed(_cases_vs_reference, 2, device, cases)
    for case in cases:
        _assert_matches_reference(case, ranks)
        for out in ranks:
            stats = out[case]["memory"]  # the master weights and the optimizer state live in host memory
            assert stats["host"] >= stats["master_params"] + stats["optimizer_states"] > 0, (case, stats)


# ---- stage 3: prefetch and release ----------------------------------------------------------------

WIDTH, DEPTH = 32, 5


class Chain(nn.Module):
    """Linear layers one after another: each one a unit, run in a fixed order."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))  # (B, WIDTH)
        return x


def _chain_data(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, WIDTH, generator=g).to(device), torch.randn(8, WIDTH, generator=g).to(device)


def _prefetch_run(rank: int, device: torch.device, prefetch: bool) -> dict:
    torch.manual_seed(0)
    model = Chain().to(device)
    reference = Chain().to(device)
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    config = ZeroConfig(stage=3, prefetch=prefetch, **UNITS)
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), config,
                        sharder=shard_module(model, config))
    held: list[list[int]] = []  # per step, per layer: parameter bytes held as the layer's forward starts
    for i, layer in enumerate(model.layers):  # after the engine's own hook, which gathers (and prefetches)
        layer.register_forward_pre_hook(lambda module, args, i=i: held[-1].append(memory_stats(model)["params"]))
    losses, ref_losses, released = [], [], []
    for step in range(3):
        held.append([])
        x, y = _chain_data(step, rank, device)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        released.append([tuple(layer.weight.shape) for layer in model.layers])
        (x0, y0), (x1, y1) = _chain_data(step, 0, device), _chain_data(step, 1, device)
        ref_opt.zero_grad()
        ref_loss = F.mse_loss(reference(torch.cat([x0, x1])), torch.cat([y0, y1]))
        ref_loss.backward()
        ref_opt.step()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    with gathered_parameters(model):
        params = {k: (v.detach().cpu().clone(), reference.state_dict()[k].cpu()) for k, v in model.state_dict().items()}
    return {"held": held, "released": released, "losses": losses, "ref_losses": ref_losses, "params": params}


def _prefetch_runs(rank: int, world_size: int, device_name: str) -> dict:
    device = _device(device_name)
    return {prefetch: _prefetch_run(rank, device, prefetch) for prefetch in (True, False)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("device", DEVICES)
def test_stage3_prefetches_the_next_unit_and_releases_every_unit(device):
    unit_bytes = 4 * (WIDTH * WIDTH + WIDTH)  # a Linear's fp32 weight and bias, whole
    ranks = run_distributed(_prefetch_runs, 2, device)
    for prefetch in (True, False):  # the ranks' mean loss is the full batch's
        mean_loss = torch.tensor([runs[prefetch]["losses"] for runs in ranks]).mean(0)
        want = torch.tensor(ranks[0][prefetch]["ref_losses"])
        torch.testing.assert_close(mean_loss, want, rtol=1e-5, atol=1e-7, msg=lambda m: f"prefetch={prefetch}: {m}")
    for runs in ranks:
        for prefetch, run in runs.items():
            assert run["released"] == [[(0,)] * DEPTH] * 3, f"prefetch={prefetch}: units left gathered after a step"
            for key, (got, want) in run["params"].items():
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"prefetch={prefetch} {key}: {m}")
        for step, held in enumerate(runs[False]["held"]):  # units of one size: one at a time holds the same
            assert len(set(held)) == 1, f"step {step}: a unit outlived its forward: {held}"
        extra = [[a - b for a, b in zip(with_prefetch, without)]  # bytes held beyond the run without prefetch
                 for with_prefetch, without in zip(runs[True]["held"], runs[False]["held"])]
        assert extra[0] == [0] * DEPTH, f"the first step has no order to prefetch by: {extra}"
        for step_extra in extra[1:]:  # then each layer finds the next one gathered already, the last none
            assert all(e >= unit_bytes for e in step_extra[:-1]) and step_extra[-1] == 0, extra


# ---- a sharded checkpoint round trip ----------------------------------------------------------------

SAVE_AT, STOP = 3, 6


def _checkpointed_model(device: torch.device, stage: int, seed: int):
    torch.manual_seed(seed)
    model = OddMLP().to(device, torch.bfloat16)  # bf16 working weights, fp32 masters: both must round-trip
    config = ZeroConfig(stage=stage, bucket_cap_mb=TINY_BUCKET_MB, **(UNITS if stage == 3 else {}))
    user_opt = make_optimizer("adamw", param_groups(model))
    sharder = shard_module(model, config) if stage == 3 else None
    return model, ZeroOptimizer(user_opt, config, sharder=sharder), sharder


def _train(model, opt, rank: int, device: torch.device, start: int, stop: int) -> list[float]:
    losses = []
    for step in range(start, stop):
        x, y = (t.to(device) for t in batch(step, rank))
        opt.zero_grad()
        loss = F.mse_loss(model(x.to(torch.bfloat16), step, 0).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _snapshot(model, opt) -> dict:
    with gathered_parameters(model):
        params = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    state = {i: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for i, s in opt.state_dict()["state"].items()}
    return {"params": params, "state": state, "devices": sorted({p.device.type for p in model.parameters()})}


def _round_trip(rank: int, world_size: int, device_name: str, folder: str) -> dict:
    device = _device(device_name)
    path = Path(folder) / "ckpt"
    model, opt, sharder = _checkpointed_model(device, 3, seed=0)
    _train(model, opt, rank, device, 0, SAVE_AT)
    save_sharded(path, {"optimizer_states": [{}]}, model, [opt], sharder, Collectives(), 3)
    saved = _snapshot(model, opt)
    out = {"saved": saved, "losses": _train(model, opt, rank, device, SAVE_AT, STOP), "final": _snapshot(model, opt)}
    for stage in (3, 1):  # the same stage resumes bit for bit; another stage reads the same values
        model2, opt2, sharder2 = _checkpointed_model(device, stage, seed=1)  # other weights: all must be read
        reader = CheckpointReader(path)
        record = reader.trainer_state()["zero_checkpoint"]
        load_model(reader, record, model2, flat_groups([opt2], sharder2))
        load_optimizers(reader, record, model2, [opt2])
        loaded = _snapshot(model2, opt2)
        losses = _train(model2, opt2, rank, device, SAVE_AT, STOP) if stage == 3 else None
        out[stage] = {"loaded": loaded, "losses": losses, "final": _snapshot(model2, opt2) if stage == 3 else None}
    return out


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert got["params"].keys() == want["params"].keys() and got["state"].keys() == want["state"].keys(), what
    for key, value in want["params"].items():
        assert torch.equal(got["params"][key], value), f"{what}: {key}"
    for index, entry in want["state"].items():
        for key, value in entry.items():
            mine = got["state"][index][key]
            same = torch.equal(mine, value) if isinstance(value, torch.Tensor) else mine == value
            assert same, f"{what}: optimizer state {index}.{key}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("device", DEVICES)
def test_sharded_checkpoint_round_trip_at_two_ranks(device, tmp_path):
    for out in run_distributed(_round_trip, 2, device, str(tmp_path)):
        for stage in (3, 1):
            devices = out[stage]["loaded"]["devices"]
            assert devices == [device], f"loaded at stage {stage}: parameters on {devices}, not {device}"
            _assert_same(out[stage]["loaded"], out["saved"], f"loaded at stage {stage}")
        assert out[3]["losses"] == out["losses"], "the resumed run left the uninterrupted one"
        _assert_same(out[3]["final"], out["final"], "after resuming")
