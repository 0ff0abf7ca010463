"""The engine on one CUDA device (skips without CUDA): the fused kernels in ZeroOptimizer's step
against torch's own optimizer code (ZERO_STRATEGY_KERNELS=torch), and a sharded checkpoint of CUDA
tensors. Run it wherever a GPU is available (benchmarks/gpu_check.sh does); world size 2 on the
GPU is tests/test_engine_gpu_multirank.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from zero_strategy import ZeroConfig, ZeroOptimizer, gathered_parameters, kernels
from zero_strategy.checkpoint import CheckpointReader, load_model, load_optimizers, save_sharded
from zero_strategy.checkpoint.sharded import flat_groups
from zero_strategy.engine import Collectives, LossScaler, shard_module

from .models import OddMLP, batch, make_optimizer, param_groups

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_cupy = pytest.mark.skipif(importlib.util.find_spec("cupy") is None,
                                reason="the fused kernels need CuPy: pip install -e '.[cuda]' (or '.[cuda12]')")


def _run(stage: int, optimizer: str, dtype: torch.dtype, backend: str, steps: int = 6, clip: float = 0.0):
    kernels.set_backend(backend)
    try:
        torch.manual_seed(0)
        model = OddMLP().cuda().to(dtype)
        config = ZeroConfig(stage=stage, shard_modules=("Linear",), param_persistence_threshold=0)
        user_opt = make_optimizer(optimizer, param_groups(model))
        sharder = shard_module(model, config) if stage == 3 else None
        scaler = LossScaler(scale=2.0**8) if dtype != torch.float32 else None
        opt = ZeroOptimizer(user_opt, config, sharder=sharder, scaler=scaler)
        losses = []
        before = kernels.launch_counts()
        for step in range(steps):
            x, y = (t.cuda().to(dtype) for t in batch(step, 0))
            loss = F.mse_loss(model(x, step, 0).float(), y.float())
            opt.zero_grad()
            (loss * scaler.scale if scaler else loss).backward()
            if clip:
                opt.clip_grad_norm_(clip)
            opt.step()
            losses.append(loss.item())
        launched = {k: n - before.get(k, 0) for k, n in kernels.launch_counts().items() if n != before.get(k, 0)}
        with gathered_parameters(model):
            params = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
        return losses, params, launched
    finally:
        kernels.set_backend(None)


def _assert_kernels_ran(fused_launched: dict, torch_launched: dict, optimizer: str) -> None:
    step_kernel = "fused_sgd" if optimizer == "sgd" else "fused_adam"
    assert fused_launched.get(step_kernel, 0) >= 6 and fused_launched.get("grad_norm", 0) >= 6, fused_launched
    assert torch_launched == {}, torch_launched


@needs_cupy
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("optimizer", ["adam", "adamw", "sgd"])
def test_fused_step_matches_torch_in_fp32(stage, optimizer):
    fused_losses, fused, fused_launched = _run(stage, optimizer, torch.float32, "auto", clip=0.5)
    torch_losses, reference, torch_launched = _run(stage, optimizer, torch.float32, "torch", clip=0.5)
    _assert_kernels_ran(fused_launched, torch_launched, optimizer)
    torch.testing.assert_close(torch.tensor(fused_losses), torch.tensor(torch_losses), rtol=1e-5, atol=1e-6)
    for key, value in reference.items():
        torch.testing.assert_close(fused[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


@needs_cupy
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_step_matches_torch_with_fp32_masters(dtype):
    fused_losses, fused, fused_launched = _run(2, "adamw", dtype, "auto", clip=0.5)
    torch_losses, reference, torch_launched = _run(2, "adamw", dtype, "torch", clip=0.5)
    _assert_kernels_ran(fused_launched, torch_launched, "adamw")
    torch.testing.assert_close(torch.tensor(fused_losses), torch.tensor(torch_losses), rtol=1e-3, atol=1e-4)
    for key, value in reference.items():  # the masters agree to fp32 rounding; the weights to one 16-bit ulp
        torch.testing.assert_close(fused[key], value, rtol=1e-2, atol=1e-3, msg=lambda m: f"{key}: {m}")


def test_sharded_checkpoint_of_cuda_tensors_round_trips(tmp_path):
    torch.manual_seed(0)
    model = OddMLP().cuda()
    config = ZeroConfig(stage=3, shard_modules=("Linear",), param_persistence_threshold=0)
    sharder = shard_module(model, config)
    opt = ZeroOptimizer(make_optimizer("adam", param_groups(model)), config, sharder=sharder)
    for step in range(3):
        x, y = (t.cuda() for t in batch(step, 0))
        opt.zero_grad()
        F.mse_loss(model(x, step, 0), y).backward()
        opt.step()
    save_sharded(tmp_path / "ckpt", {"optimizer_states": [{}]}, model, [opt], sharder, Collectives(), 3)
    torch.manual_seed(1)
    model2 = OddMLP().cuda()
    sharder2 = shard_module(model2, config)
    opt2 = ZeroOptimizer(make_optimizer("adam", param_groups(model2)), config, sharder=sharder2)
    reader = CheckpointReader(tmp_path / "ckpt")
    saved = reader.trainer_state()["zero_checkpoint"]
    load_model(reader, saved, model2, flat_groups([opt2], sharder2))
    load_optimizers(reader, saved, model2, [opt2])
    with gathered_parameters(model), gathered_parameters(model2):
        for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
            assert b.is_cuda and torch.equal(a, b), k
    want, got = opt.state_dict(), opt2.state_dict()
    for index, entry in want["state"].items():
        for key, value in entry.items():
            assert torch.equal(got["state"][index][key].cpu(), value.cpu()), (index, key)


def _offload_run(stage: int, dtype: torch.dtype, overlap: bool, clip: float) -> tuple:
    """Optimizer offload on CUDA (pinned host shards, events after the gradients' copies), with or
    without offload_overlap: the weights and the overlap's counts after a few steps."""
    torch.manual_seed(0)
    model = OddMLP().cuda().to(dtype)
    config = ZeroConfig(stage=stage, shard_modules=("Linear",), param_persistence_threshold=8, bucket_cap_mb=1e-3,
                        offload_optimizer=True, offload_params=stage == 3, offload_overlap=overlap)
    user_opt = torch.optim.AdamW(param_groups(model), lr=0.01)
    sharder = shard_module(model, config) if stage == 3 else None
    scaler = LossScaler(scale=2.0**8) if dtype == torch.float16 else None
    opt = ZeroOptimizer(user_opt, config, sharder=sharder, scaler=scaler)
    for step in range(5):
        x, y = (t.cuda().to(dtype) for t in batch(step, 0))
        opt.zero_grad()
        loss = F.mse_loss(model(x, step, 0).float(), y.float())
        (scaler.scale_loss(loss) if scaler is not None else loss).backward()
        opt.clip_grad_norm_(clip)
        opt.step()
    with gathered_parameters(model):
        params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    stats = opt.offload_overlap_stats()
    opt.close()
    return params, stats


@pytest.mark.parametrize("stage, dtype", [(2, torch.float32), (2, torch.bfloat16), (3, torch.float32),
                                          (3, torch.float16)])
@pytest.mark.parametrize("clip", [1e3, 0.05])  # never cuts, cuts at every step
def test_offload_overlap_on_cuda_is_the_step_without_it(stage, dtype, clip):
    want, _ = _offload_run(stage, dtype, False, clip)
    got, stats = _offload_run(stage, dtype, True, clip)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    assert (stats["committed"] > 0) == (clip > 1), stats
