"""DeepSpeed's Muon config (``"optimizer": {"type": "Muon"}``) through ``zero_strategy.initialize``.

On 2 gloo ranks, for each case of tests/deepspeed_muon_model.py (ZeRO stages 0-3, a model built
inside ``zero.Init`` at stage 3, DeepSpeed's default clipping of 1.0 (of the gradients at stage 0, of
the updates at stages 1-3) and none, and two param groups with the "standard" Newton-Schulz
iteration, L2 decay and clipping at 0.5), ``MuonNet``
trains for 6 steps of 2 micro-batches, and

- each rank's losses equal DeepSpeed 0.19's on the same script within 1e-6: the ones recorded in
  tests/data/deepspeed_muon/reference.json (tests/scripts/make_deepspeed_muon.py) where this CPU
  runs Newton-Schulz in the dtype they were made with, and a fresh DeepSpeed run where DeepSpeed is
  installed (its update run eagerly: see the script);
- they equal a single-process run of ``DeepSpeedMuon`` (grouped by the same door) on both ranks'
  batches within 1e-6, also where the iterations run in bf16 ("standard"; "gram" runs in fp32 on a
  CPU without oneDNN fp16): the engine's gradients differ from the reference's in the last bits at
  most, which no bf16 rounding here turned into more (the largest difference found: 5e-7, fp32's
  rounding of a loss near 3.5);
- the parameters are tagged and grouped as DeepSpeed tags and groups them, also inside ``zero.Init``
  (DeepSpeed's bug #8438: there every parameter looked 1-D), and tagging again after stage 3 has
  sharded them reads the whole shapes still;
- every parameter is stepped whole by one rank (the state is spread over the ranks);
- where DeepSpeed is installed, ``DeepSpeedMuon``'s update is DeepSpeed's ``muon_update`` bit for
  bit, in each dtype its Newton-Schulz iterations run in on some device (fp16 forced on the CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zero_strategy as deepspeed
from zero_strategy.deepspeed.config import map_deepspeed_config
from zero_strategy.deepspeed.engine_parts import muon_clipping
from zero_strategy.deepspeed.keys import DeepSpeedConfigError
from zero_strategy.optimizers import DeepSpeedMuon, ns_compute_dtype

from .deepspeed_muon_model import CASES, GAS, STEPS, MuonNet, batch, config, model_parameters
from .distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "tests" / "data" / "deepspeed_muon" / "reference.json"


def _train(rank: int, name: str) -> dict:
    from zero_strategy.deepspeed.muon import tag_parameters

    torch.manual_seed(0)
    cfg = config(name)
    if CASES[name][1]:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = MuonNet()
    else:
        model = MuonNet()
    on_meta = all(p.is_meta for p in model.parameters())
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=cfg,
                                                   model_parameters=model_parameters(model, name))
    tags = {n: p.use_muon for n, p in model.named_parameters()}
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    tag_parameters(model)  # again, on the parameters as the engine holds them now
    retagged = {n: p.use_muon for n, p in model.named_parameters()}
    losses = []
    for micro in range(STEPS * GAS):
        loss = engine(*batch(micro, rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    backend = optimizer.step_backend
    out = {"losses": losses, "comm": engine.comm_stats(), "tags": tags, "retagged": retagged, "on_meta": on_meta, "shapes": shapes,
           "groups": [(g["name"], g["use_muon"]) for g in optimizer.param_groups], "whole": backend.whole_parameters,
           "owned": len(backend.plan.owned), "params": len(backend.plan.params)}
    engine.destroy()
    return out


def _client_mismatch(rank: int) -> str:
    torch.manual_seed(0)
    model = MuonNet()
    opt = DeepSpeedMuon([{"params": [model.fc1.weight], "use_muon": True},
                         {"params": [p for p in model.parameters() if p is not model.fc1.weight], "use_muon": False}])
    try:
        deepspeed.initialize(model=model, optimizer=opt, config=config("stage2"))
    except ValueError as err:
        return str(err)
    return "no error"


def _all(rank: int, world_size: int) -> dict:
    return {"cases": {name: _train(rank, name) for name in CASES}, "mismatch": _client_mismatch(rank)}


@pytest.fixture(scope="module")
def ours() -> list[dict]:
    return run_distributed(_all, 2)


def _reference(name: str) -> list[list[float]]:
    """``DeepSpeedMuon`` in one process, grouped by the door, on both ranks' micro-batches: each rank's losses."""
    torch.manual_seed(0)
    model = MuonNet()
    settings = map_deepspeed_config(config(name))
    opt = settings.optimizer(model_parameters(model, name), module=model, gradient_clipping=muon_clipping(settings))
    losses: list[list[float]] = [[], []]
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(step * GAS, (step + 1) * GAS):
            for rank in (0, 1):
                loss = model(*batch(micro, rank))
                losses[rank].append(loss.item())
                (loss / (2 * GAS)).backward()  # the mean over both ranks' micro-batches
        if CASES[name][0] == 0:  # DeepSpeed's stage 0 clips the gradients (stages 1-3: the optimizer its updates)
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.clipping())
        opt.step()
    return losses


def _close(ours: list[dict], theirs: dict, what: str, tolerance: float) -> None:
    for name in CASES:
        for rank, run in enumerate(ours):
            torch.testing.assert_close(torch.tensor(run["cases"][name]["losses"]), torch.tensor(theirs[name][rank]),
                                       rtol=0, atol=tolerance, msg=lambda m: f"{what}, {name} rank {rank}: {m}")


@pytest.mark.timeout(120)
def test_muon_config_trains_as_deepspeeds_recorded_run_and_as_one_process(ours):
    _close(ours, {name: _reference(name) for name in CASES}, "against one process", 1e-6)
    recorded = json.loads(RECORDED.read_text())
    for name in CASES:
        for rank, run in enumerate(ours):
            case = run["cases"][name]
            assert case["tags"] == case["retagged"] == recorded["cases"][name]["use_muon"], (name, case["tags"])
            assert [tuple(g) for g in recorded["cases"][name]["groups"]] == case["groups"], name
            assert case["whole"] and 0 < case["owned"] < case["params"], (name, case["owned"], case["params"])
        assert ours[0]["cases"][name]["owned"] + ours[1]["cases"][name]["owned"] == ours[0]["cases"][name]["params"]
    init = ours[0]["cases"]["stage3_zero_init"]
    assert init["on_meta"] and init["tags"]["fc1.weight"] and init["shapes"]["fc1.weight"] != (20, 12)  # sharded
    assert "pass gradient_clipping=1.0 to DeepSpeedMuon" in ours[0]["mismatch"]
    mine = {m: str(ns_compute_dtype(m, torch.device("cpu"))).removeprefix("torch.") for m in ("gram", "standard")}
    if mine != recorded["ns_dtype"]:
        pytest.skip(f"this CPU runs Newton-Schulz in {mine}, the recorded DeepSpeed run in {recorded['ns_dtype']}")
    _close(ours, {name: case["losses"] for name, case in recorded["cases"].items()}, "against DeepSpeed (recorded)",
           1e-6)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["stage0", "stage2", "stage3"])
def test_the_communication_model_predicts_the_muon_steps_bytes(ours, name):
    """The last step's bytes (two micro-batches, the whole step's all-to-alls and, with clipping at stages
    1-3, the all-reduce of the updates' norm beside the gradients') as the communication model has them."""
    from zero_strategy.comm_model import predict_step_bytes
    from zero_strategy.config import ZeroConfig

    settings = map_deepspeed_config(config(name))
    zero = ZeroConfig(**{**settings.strategy, "stage": max(CASES[name][0], 1), "broadcast_buffers": False})
    with torch.device("meta"):
        model = MuonNet()
    for rank, run in enumerate(ours):
        predicted = predict_step_bytes(model, zero, 2, 2, clipping=True, accumulation_steps=GAS, backend="gloo",
                                       whole_parameters=True, rank=rank, update_norm=CASES[name][0] >= 1)
        assert run["cases"][name]["comm"] == predicted, (name, rank)
        assert predicted["all_to_all"] > 0


@pytest.mark.timeout(600)
def test_muon_config_trains_as_deepspeed_runs_it_now(ours, tmp_path):
    pytest.importorskip("deepspeed", reason="compare with DeepSpeed where it is installed")
    out = tmp_path / "reference.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TORCHDYNAMO_DISABLE": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "make_deepspeed_muon.py"), "--out",
                           str(out)], env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-4000:]
    _close(ours, {name: case["losses"] for name, case in json.loads(out.read_text())["cases"].items()},
           "against DeepSpeed", 1e-6)


def test_the_update_is_deepspeeds_bit_for_bit(monkeypatch):
    """``deepspeed_muon_update`` against DeepSpeed's ``muon_update`` (run eagerly), for tall, wide, square and
    batched matrices, each Newton-Schulz method in each compute dtype DeepSpeed picks on some device (forced
    on both sides: fp16 is what "gram" runs in on CUDA)."""
    original = pytest.importorskip("deepspeed.runtime.zero.muon.original_muon",
                                   reason="compare with DeepSpeed where it is installed")
    import torch._dynamo

    from zero_strategy import optimizers

    for gram_dtype in (torch.float16, torch.float32):
        monkeypatch.setattr(original, "ns_compute_dtype", lambda m="gram": gram_dtype if m == "gram" else torch.bfloat16)
        monkeypatch.setattr(optimizers, "ns_compute_dtype", lambda m, d: gram_dtype if m == "gram" else torch.bfloat16)
        for shape in [(20, 12), (12, 20), (12, 12), (3, 8, 16), (64, 256)]:
            for method in ("gram", "standard"):
                grad = torch.randn(*shape)
                theirs = torch.randn(*shape)  # the momentum
                mine = theirs.clone()
                with torch._dynamo.config.patch(disable=True):  # DeepSpeed wraps it in torch.compile
                    expected = original.muon_update(grad.clone(), theirs, beta=0.9, ns_method=method)
                got = optimizers.deepspeed_muon_update(grad.clone(), mine, 0.9, method)
                assert torch.equal(got, expected) and torch.equal(mine, theirs), (gram_dtype, shape, method)


@pytest.mark.parametrize(("params", "named"), [
    ({"per_head_muon": True}, "per_head_muon=true"),
    ({"nesterov": False}, "optimizer.params.nesterov: DeepSpeed's Muon reads no such key"),
    ({"muon_lrr": 0.1}, "did you mean 'muon_lr'?"),
    ({"ns_method": "svd"}, "ns_method='svd': use one of ['gram', 'standard']"),
    ({"fp32_optimizer_states": False}, "fp32_optimizer_states=false"),
])
def test_muon_keys_deepspeed_would_ignore_or_we_cannot_honour_are_named(params, named):
    with pytest.raises(DeepSpeedConfigError, match=named.replace("[", r"\[").replace("?", r"\?")):
        map_deepspeed_config({"optimizer": {"type": "Muon", "params": params}})


def test_muon_settings_and_refusals_of_the_class():
    settings = map_deepspeed_config({"optimizer": {"type": "Muon", "params": {"lr": 0.01, "adam_lr": 0.001,
                                                                             "torch_adam": True, "betas": [0.8, 0.9]}}})
    assert "optimizer.params.torch_adam" in settings.ignored
    model = MuonNet()
    opt = settings.optimizer(model.parameters(), module=model)
    muon, adam = opt.param_groups
    assert (muon["lr"], muon["momentum"], muon["ns_method"], muon["weight_decay"]) == (0.01, 0.95, "gram", 0.0)
    assert (adam["lr"], adam["betas"], adam["eps"], adam["weight_decay"]) == (0.001, (0.8, 0.9), 1e-10, 0.0)
    with pytest.raises(ValueError, match=r"use_muon=True group holds a parameter of shape \(20,\)"):
        DeepSpeedMuon([{"params": [model.fc1.bias], "use_muon": True}])
    with pytest.raises(ValueError, match="has use_muon=None"):
        DeepSpeedMuon([{"params": [model.fc1.bias]}])
    with pytest.raises(ValueError, match="needs the model"):
        settings.optimizer(model.parameters())
