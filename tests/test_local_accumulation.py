"""Local accumulation (issue 32, [Note: local accumulation] in zero_strategy/engine/grads/accumulation.py): at
stages 2 and 3, four micro-batches accumulated locally equal the reduce-every-micro-batch run
(fp32: within 1e-6), reduce once per optimizer step (reduce-scatter calls and comm_stats() bytes),
and hold the full-size buffer memory_stats() and estimate_memory() count. One launch of 2 gloo
ranks covers the engine (no_sync, a step inside it, bf16 with an fp32 buffer) and initialize."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zero_strategy.config import ZeroConfig
from zero_strategy.engine import Collectives, ZeroOptimizer, shard_module
from zero_strategy.memory import estimate_memory, memory_stats

from .distributed import run_distributed
from .models import BlockNet, block_net_config

WORLD, ACCUM, STEPS = 2, 4, 2


def _batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def _count_reduce_scatters(comm: Collectives) -> list[int]:
    calls = [0]
    original = comm.reduce_scatter

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    comm.reduce_scatter = counted
    return calls


def _engine_run(rank: int, stage: int, local: bool, how: str = "no_sync", dtype=torch.float32, **options) -> dict:
    """STEPS optimizer steps of ACCUM micro-batches each; ``how``: "no_sync" (the micro-batches
    before the last inside ``no_sync``) or "all" (all of them inside it: the step reduces)."""
    torch.manual_seed(0)
    model = BlockNet().to(dtype)
    config = block_net_config(stage, local_accumulation=local, **options)
    comm = Collectives()
    calls = _count_reduce_scatters(comm)
    sharder = shard_module(model, config, comm) if stage == 3 else None
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), config, comm, sharder=sharder)
    per_step, losses, grads_bytes = [], [], 0
    for step in range(STEPS):
        before = calls[0]
        for micro in range(ACCUM):
            x, y = _batch(rank, step, micro)
            deferred = how == "all" or micro < ACCUM - 1
            with opt.no_sync() if deferred else torch.enable_grad():
                loss = F.mse_loss(model(x.to(dtype)).float(), y) / ACCUM
                loss.backward()
            losses.append(loss.item())
            if micro == ACCUM - 2:  # the local buffers are full-size now
                grads_bytes = memory_stats(model, [opt])["grads"]
        opt.step()
        opt.zero_grad()
        per_step.append(calls[0] - before)
    from zero_strategy import gathered_parameters

    with gathered_parameters(model):
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    numel = sum(p.numel() for p in params.values())
    return {"params": params, "losses": losses, "calls": per_step, "stats": opt.comm_stats(),
            "grads_bytes": grads_bytes, "numel": numel}


OFFLOAD = {"offload_optimizer": True, "offload_overlap": True}  # the host step started as segments arrive
CASES = {  # name: (stage, local, how, dtype[, options])
    "s2": (2, False, "no_sync", torch.float32),
    "s2-local": (2, True, "no_sync", torch.float32),
    "s2-local-all": (2, True, "all", torch.float32),
    "s3": (3, False, "no_sync", torch.float32),
    "s3-local": (3, True, "no_sync", torch.float32),
    "s3-bf16": (3, False, "no_sync", torch.bfloat16),
    "s3-local-bf16": (3, True, "no_sync", torch.bfloat16),
    "s2-local-overlap": (2, True, "no_sync", torch.float32, OFFLOAD),
    "s3-local-offload": (3, True, "no_sync", torch.float32, {"offload_optimizer": True, "offload_params": True}),
}


def _initialize_run(rank: int, stage: int, local: bool) -> dict:
    import zero_strategy as deepspeed

    torch.manual_seed(0)
    model = BlockNet()
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": ACCUM, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 500,
                                    **({"local_accumulation": True} if local else {})}}
    engine, opt, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    calls = _count_reduce_scatters(engine.comm)
    per_step = []
    for step in range(STEPS):
        before = calls[0]
        for micro in range(ACCUM):
            x, y = _batch(rank, step, micro)
            engine.backward(F.mse_loss(engine(x), y))
            engine.step()
        per_step.append(calls[0] - before)
    from zero_strategy import gathered_parameters

    with gathered_parameters(engine.module):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"params": params, "calls": per_step, "stats": engine.comm_stats()}


def _all(rank: int, world_size: int) -> dict:
    out = {name: _engine_run(rank, *case[:4], **(case[4] if len(case) > 4 else {})) for name, case in CASES.items()}
    for stage in (2, 3):
        for local in (False, True):
            out[f"init-s{stage}{'-local' if local else ''}"] = _initialize_run(rank, stage, local)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_all, WORLD)


def _close(a: dict, b: dict, atol: float) -> None:
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("stage", [2, 3])
def test_local_accumulation_equals_reducing_every_micro_batch_and_reduces_once_per_step(runs, stage):
    for rank in range(WORLD):
        usual, local = runs[rank][f"s{stage}"], runs[rank][f"s{stage}-local"]
        _close(local["params"], usual["params"], 1e-6)
        assert local["losses"] == pytest.approx(usual["losses"], abs=1e-6)
        segments = local["calls"][0]
        assert segments > 1  # several segments per group: the count is per segment
        assert usual["calls"] == [ACCUM * segments] * STEPS and local["calls"] == [segments] * STEPS
        assert local["stats"]["reduce_scatter"] * ACCUM == usual["stats"]["reduce_scatter"] > 0
        assert local["stats"]["all_gather"] == usual["stats"]["all_gather"]  # stage 3 still gathers every unit
    _close(runs[0][f"s{stage}-local"]["params"], runs[1][f"s{stage}-local"]["params"], 0)


def test_a_step_after_deferring_every_micro_batch_reduces_what_was_accumulated(runs):
    for rank in range(WORLD):
        _close(runs[rank]["s2-local-all"]["params"], runs[rank]["s2"]["params"], 1e-6)
        assert runs[rank]["s2-local-all"]["calls"] == runs[rank]["s2-local"]["calls"]


@pytest.mark.parametrize("name, usual", [("s2-local-overlap", "s2"), ("s3-local-offload", "s3")])
def test_local_accumulation_with_optimizer_offload(runs, name, usual):
    for rank in range(WORLD):
        _close(runs[rank][name]["params"], runs[rank][usual]["params"], 1e-6)
        assert runs[rank][name]["calls"] == runs[rank][f"{usual}-local"]["calls"]


def test_bf16_accumulates_in_an_fp32_buffer(runs):
    """bf16 weights: the fp32 local sum is rounded once, the usual run's bf16 shard after each of the
    four micro-batches; both stay near each other (bf16's resolution), and the buffer is fp32."""
    for rank in range(WORLD):
        usual, local = runs[rank]["s3-bf16"], runs[rank]["s3-local-bf16"]
        _close(local["params"], usual["params"], 2e-2)
        assert local["calls"] == [local["calls"][0]] * STEPS and usual["calls"][0] == ACCUM * local["calls"][0]
        # 4 bytes per parameter of the local buffer besides the bf16 shards (2 bytes / world size)
        assert local["grads_bytes"] >= 4 * local["numel"] > usual["grads_bytes"]


def test_memory_stats_count_the_full_size_buffer_and_the_estimate_predicts_it(runs):
    for stage in (2, 3):
        local, usual = runs[0][f"s{stage}-local"], runs[0][f"s{stage}"]
        numel = local["numel"]
        assert local["grads_bytes"] - usual["grads_bytes"] >= 4 * numel  # fp32, unsharded, alignment aside
        assert local["grads_bytes"] - usual["grads_bytes"] <= 4 * numel + 4 * 64 * 16
        plain = estimate_memory(numel, stage, WORLD)
        with_buffer = estimate_memory(numel, stage, WORLD, local_accumulation=True)
        assert with_buffer["grads"] - plain["grads"] == 4 * numel
        assert estimate_memory(numel, stage, WORLD, "bf16-mixed", local_accumulation=True,
                               grad_accum_dtype="working")["grads"] - \
            estimate_memory(numel, stage, WORLD, "bf16-mixed")["grads"] == 2 * numel


@pytest.mark.parametrize("stage", [2, 3])
def test_initialize_reduces_once_per_boundary(runs, stage):
    for rank in range(WORLD):
        usual, local = runs[rank][f"init-s{stage}"], runs[rank][f"init-s{stage}-local"]
        _close(local["params"], usual["params"], 1e-6)
        segments = local["calls"][0]
        assert usual["calls"] == [ACCUM * segments] * STEPS and local["calls"] == [segments] * STEPS
        assert local["stats"]["reduce_scatter"] * ACCUM == usual["stats"]["reduce_scatter"] > 0


@pytest.mark.parametrize("options, message", [
    (dict(stage=1, local_accumulation=True), "stage 1 keeps whole gradients"),
    (dict(stage=2, local_accumulation="yes"), "must be True or False"),
    (dict(stage=2, local_accumulation=True, grad_accum_dtype="bf16"), r"grad_accum_dtype='bf16' is not one of"),
])
def test_bad_settings_are_refused_with_what_to_do(options, message):
    with pytest.raises(ValueError, match=message):
        ZeroConfig(**options)


def test_deepspeed_config_maps_local_accumulation_and_grad_accum_dtype():
    from zero_strategy.deepspeed.config import DeepSpeedConfigError, map_deepspeed_config

    settings = map_deepspeed_config({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"},
                                     "zero_optimization": {"stage": 3, "local_accumulation": True}})
    assert settings.strategy["local_accumulation"] is True and settings.strategy["grad_accum_dtype"] == "working"
    settings = map_deepspeed_config({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
                                     "zero_optimization": {"stage": 2}})
    assert settings.strategy["grad_accum_dtype"] == "fp32" and "local_accumulation" not in settings.strategy
    assert any("without local_accumulation" in note for note in settings.notes)  # said, not silent
    with pytest.raises(DeepSpeedConfigError, match=r"data_types.grad_accum_dtype=\"fp16\".*\"fp32\" or \"bf16\""):
        map_deepspeed_config({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp16"},
                              "zero_optimization": {"stage": 2}})


def test_join_refuses_local_accumulation():
    from zero_strategy import Join

    model = BlockNet()
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), block_net_config(2, local_accumulation=True))
    with pytest.raises(ValueError, match="Join with local_accumulation=True"):
        Join(model, opt)
