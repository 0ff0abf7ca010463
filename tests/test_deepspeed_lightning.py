"""ZeroStrategy(config=...): a DeepSpeed config drives a Lightning fit as the same settings spelled out
for Lightning do, and whatever disagrees with the Trainer is an error before training."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from zero_strategy import ZeroStrategy
from zero_strategy.deepspeed.config import DeepSpeedConfigError

from .cli_runs import assert_succeeded, clean_env, run_at_once

SCRIPT = Path(__file__).parent / "scripts" / "deepspeed_config_run.py"
RESUME_SCRIPT = Path(__file__).parent / "scripts" / "deepspeed_resume_run.py"
DEEPSPEED_DATA = Path(__file__).parent / "data" / "deepspeed"
RESUMED_CASE = "stage2_fp32"


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """The two Lightning launches of this file, at once (each imports Lightning on one core while the
    other runs): name -> (the finished process, the folder its ranks wrote to)."""
    out = {name: tmp_path_factory.mktemp(name) for name in ("config", "resume")}
    runs = run_at_once({
        "config": ([sys.executable, str(SCRIPT), "--out", str(out["config"])], clean_env(), None, 2),
        "resume": ([sys.executable, str(RESUME_SCRIPT), "--case", RESUMED_CASE, "--stage", "3", "--out",
                    str(out["resume"])], clean_env(), None, 2),
    }, timeout=280)
    return {name: (proc, out[name]) for name, (proc, _) in runs.items()}


@pytest.mark.timeout(300)
def test_a_deepspeed_config_trains_as_its_settings_spelled_out(launches):
    proc, tmp_path = launches["config"]
    assert_succeeded(proc)
    for rank in range(2):
        ran = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        config, spelled = ran["config"], ran["spelled_out"]
        assert config["accumulate"] == 2 and config["clip"] == 0.05  # from the config's batch numbers and clipping
        assert len(config["losses"]) == len(spelled["losses"]) == 12  # 6 steps of 2 micro-batches
        assert config["losses"] == spelled["losses"]  # the same run, bit for bit
        assert config["lrs"] == spelled["lrs"] and config["lrs"][0] < config["lrs"][-1]  # the warm-up ran
        for name, value in spelled["params"].items():
            assert torch.equal(config["params"][name], value), name


def _trainer(**kwargs) -> L.Trainer:
    defaults = dict(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
    return L.Trainer(**{**defaults, **kwargs})


def test_the_trainer_and_the_config_must_agree():
    config = {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 2, "fp16": {"enabled": True}}
    with pytest.raises(DeepSpeedConfigError, match=r"gradient_accumulation_steps=2 in the DeepSpeed config, but "
                                                   r"Trainer\(accumulate_grad_batches=3\)"):
        _trainer(strategy=ZeroStrategy(config=config), accumulate_grad_batches=3).fit(BoringModel())
    with pytest.raises(DeepSpeedConfigError, match=r"precision '16-mixed' from the DeepSpeed config's fp16/bf16 "
                                                   r"sections, but Trainer\(precision='bf16-mixed'\)"):
        _trainer(strategy=ZeroStrategy(config=config), precision="bf16-mixed").fit(BoringModel())


def test_an_optimizer_in_both_places_is_refused():
    config = {"zero_optimization": {"stage": 1}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with pytest.raises(DeepSpeedConfigError, match=r"both the DeepSpeed config \(optimizer SGD\) and "
                                                   r"BoringModel.configure_optimizers \(SGD\) give an optimizer"):
        _trainer(strategy=ZeroStrategy(config=config)).fit(BoringModel())


def test_config_and_arguments_that_disagree_or_have_no_stage_are_refused():
    with pytest.raises(DeepSpeedConfigError, match=r"bucket_cap_mb=50.0 given to ZeroStrategy, "
                                                   r"bucket_cap_mb=4.0 from the config"):
        ZeroStrategy(bucket_cap_mb=50.0, config={"zero_optimization": {"stage": 2, "reduce_bucket_size": 2**20}})
    with pytest.raises(DeepSpeedConfigError, match=r"no zero_optimization stage .* add \"zero_optimization\""):
        ZeroStrategy(config={"train_batch_size": 8})
    strategy = ZeroStrategy(bucket_cap_mb=25.0, config={"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}})
    assert strategy.config.stage == 3 and strategy.precision_plugin.precision == "bf16-mixed"


@pytest.mark.timeout(300)
def test_fit_resumes_from_a_deepspeed_checkpoint_as_deepspeed_continued(launches):
    # DeepSpeed trained the bare model at stage 2 on 2 ranks; here a LightningModule holds it as
    # self.model (the names gain a prefix) and resumes at stage 3, its optimizer over every
    # parameter (the frozen one included, as DeepSpeed users build it)
    from safetensors.torch import load_file

    proc, tmp_path = launches["resume"]
    assert_succeeded(proc)
    case = RESUMED_CASE
    reference = json.loads((DEEPSPEED_DATA / case / "reference.json").read_text())
    continued = {k.removeprefix("continued/"): v for k, v in
                 load_file(DEEPSPEED_DATA / case / "reference.safetensors").items() if k.startswith("continued/")}
    for rank in range(2):
        ran = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        torch.testing.assert_close(torch.tensor(ran["losses"]), torch.tensor(reference["losses"][rank]),
                                   rtol=1e-5, atol=1e-6)
        for name, value in continued.items():
            torch.testing.assert_close(ran["weights"][name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_zero_consolidate_reads_a_deepspeed_checkpoint(tmp_path):
    from safetensors.torch import load_file

    from zero_strategy.cli.consolidate import main as consolidate

    out = tmp_path / "model.ckpt"
    assert consolidate([str(DEEPSPEED_DATA / "stage3_bf16"), str(out)]) == 0
    state = torch.load(out, weights_only=True)
    reference = load_file(DEEPSPEED_DATA / "stage3_bf16" / "reference.safetensors")
    for name, value in state["state_dict"].items():
        assert torch.equal(value, reference[f"zero_to_fp32/{name}"]), name  # DeepSpeed's own reading
    assert consolidate([str(DEEPSPEED_DATA / "stage3_bf16"), str(tmp_path / "x.ckpt"), "--tag", "nope"]) == 2
