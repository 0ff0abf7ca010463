"""Sharded checkpoints through Lightning on 2 CPU processes: ModelCheckpoint (top-k, last) with
checkpoint directories, exact resume, resharding, consolidation to one file, and a DDP file loaded
into a ZeRO run. Against Lightning's DDP on the same seed and data (tests/scripts/checkpoint_run.py)."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from zero_strategy import consolidate_checkpoint
from zero_strategy.checkpoint import CheckpointReader, is_sharded_checkpoint

from .test_lightning import launch_cases

SCRIPT = Path(__file__).parent / "scripts" / "checkpoint_run.py"
sys.path.insert(0, str(SCRIPT.parent))
from checkpoint_run import TinyLM  # noqa: E402  (the script's LightningModule, for load_from_checkpoint)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


def _cases(root: Path) -> dict[str, tuple[str, ...]]:
    """Every run the tests read, in an order where a resume follows the run that wrote its checkpoint."""
    zero3, ddp = root / "all" / "zero3" / "epochs" / "epoch=0.ckpt", root / "all" / "ddp" / "epochs" / "epoch=0.ckpt"
    return {"zero3": ("--strategy", "zero3"), "ddp": ("--strategy", "ddp"),
            "zero3-async": ("--strategy", "zero3", "--async-save"),
            "zero3-from-zero3": ("--strategy", "zero3", "--resume", str(zero3)),
            "zero2-from-zero3": ("--strategy", "zero2", "--resume", str(zero3)),
            "zero1-from-ddp": ("--strategy", "zero1", "--resume", str(ddp)),
            "zero3-from-ddp": ("--strategy", "zero3", "--resume", str(ddp))}


@functools.lru_cache(maxsize=None)
def _all_runs(root: Path) -> dict[str, list[dict]]:
    """One launch running every case in turn (see [Note: one launch per strategy] in tests/test_lightning.py)."""
    return launch_cases(root / "all", "ddp", _cases(root), script=SCRIPT)


def run(root: Path, strategy: str, resume: str = "") -> tuple[Path, list[dict]]:
    """(the run's folder, each rank's results) of ``strategy``, resumed from ``resume`` when given."""
    name = f"{strategy}-from-{Path(resume).parent.parent.name}" if resume else strategy
    return root / "all" / name, _all_runs(root)[name]


def assert_close_params(got: dict, want: dict, exact: bool = False) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        if exact:
            assert torch.equal(got[name], value), name
        else:
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.timeout(600)
def test_model_checkpoint_writes_directories_and_keeps_top_k_and_last(root):
    out, ranks = run(root, "zero3")
    epochs = sorted(p.name for p in (out / "epochs").iterdir())
    assert epochs == ["epoch=0.ckpt", "epoch=1.ckpt", "last.ckpt"]
    best = [p.name for p in (out / "best").iterdir()]
    assert best == [Path(ranks[0]["best"]).name]  # top-1: every older best was removed
    for ckpt in [*(out / "epochs").iterdir(), *(out / "best").iterdir()]:
        assert is_sharded_checkpoint(ckpt), ckpt
        assert sorted(p.name for p in ckpt.iterdir()) == [
            "index.json", "rank_00000.safetensors", "rank_00001.safetensors", "trainer_state.pt"]
    assert not [p for p in out.rglob(".*")], "a partial or old directory was left behind"
    assert ranks[0]["scheduler_on"]  # Lightning pairs the (sharded) optimizer with its scheduler
    assert ranks[0]["optimizer_name"] == "AdamW"  # what LearningRateMonitor names it after: lr-AdamW
    ddp_out, ddp = run(root, "ddp")
    for z, d in zip(ranks, ddp):
        torch.testing.assert_close(torch.tensor(z["losses"]), torch.tensor(d["losses"]), rtol=1e-5, atol=1e-7)
        assert_close_params(z["params"], d["params"])


@pytest.mark.timeout(600)
def test_async_save_writes_the_same_checkpoints_and_keeps_top_k(root):
    """ModelCheckpoint with async_save: the same directories as a synchronous save, holding the same
    tensors, older best ones removed only after their successor was committed, and training as without."""
    out, ranks = run(root, "zero3")
    async_out = root / "all" / "zero3-async"
    async_ranks = _all_runs(root)["zero3-async"]
    assert sorted(p.name for p in (async_out / "epochs").iterdir()) == ["epoch=0.ckpt", "epoch=1.ckpt", "last.ckpt"]
    assert [p.name for p in (async_out / "best").iterdir()] == [Path(async_ranks[0]["best"]).name]
    assert not [p for p in async_out.rglob(".*")], "a partial or old directory was left behind"
    for z, a in zip(ranks, async_ranks):
        assert a["losses"] == z["losses"]
        assert_close_params(a["params"], z["params"], exact=True)
    for name in ("epoch=0.ckpt", "epoch=1.ckpt"):
        sync, background = CheckpointReader(out / "epochs" / name), CheckpointReader(async_out / "epochs" / name)
        names = [n for n in sync.index["tensors"]]
        assert names == [n for n in background.index["tensors"]]
        for tensor in names:
            assert torch.equal(sync.full(tensor), background.full(tensor)), (name, tensor)


@pytest.mark.timeout(600)
def test_resume_at_the_same_stage_is_exact_and_at_another_stage_close(root):
    out, full = run(root, "zero3")
    ckpt = str(out / "epochs" / "epoch=0.ckpt")
    _, same = run(root, "zero3", ckpt)
    for r in range(2):
        assert len(same[r]["losses"]) == 4
        assert same[r]["losses"] == full[r]["losses"][4:]  # bit for bit
        assert_close_params(same[r]["params"], full[r]["params"], exact=True)
        assert same[r]["optim"]["param_groups"] == full[r]["optim"]["param_groups"]
        for index, entry in full[r]["optim"]["state"].items():
            assert_close_params(same[r]["optim"]["state"][index], entry, exact=True)
    _, other = run(root, "zero2", ckpt)  # saved at stage 3, resumed at stage 2
    for r in range(2):
        torch.testing.assert_close(torch.tensor(other[r]["losses"]), torch.tensor(full[r]["losses"][4:]),
                                   rtol=1e-6, atol=1e-6)
        assert_close_params(other[r]["params"], full[r]["params"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_a_ddp_checkpoint_file_resumes_in_a_zero_run(root, strategy):
    ddp_out, ddp = run(root, "ddp")
    ckpt = ddp_out / "epochs" / "epoch=0.ckpt"
    assert ckpt.is_file()  # DDP writes one file
    _, zero = run(root, strategy, str(ckpt))
    for r in range(2):
        torch.testing.assert_close(torch.tensor(zero[r]["losses"]), torch.tensor(ddp[r]["losses"][4:]),
                                   rtol=1e-5, atol=1e-7)
        assert_close_params(zero[r]["params"], ddp[r]["params"])


@pytest.mark.timeout(600)
def test_consolidated_file_equals_ddps_state_and_loads_anywhere(root, tmp_path):
    out, zero = run(root, "zero3")
    _, ddp = run(root, "ddp")
    target, weights = tmp_path / "model.ckpt", tmp_path / "model.safetensors"
    proc = subprocess.run(["zero-consolidate", str(out / "epochs" / "last.ckpt"), str(target),
                           "--safetensors", str(weights)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout
    checkpoint = torch.load(target, weights_only=True)
    state = checkpoint["state_dict"]
    want = ddp[0]["params"]
    assert list(state) == list(want)  # every key, in the module's order
    assert "embed.weight" in state and "head.weight" in state  # tied: under both names
    assert "frozen.weight" in state
    assert_close_params(state, want)
    assert all(v.dtype == torch.float32 for v in state.values())
    assert checkpoint["global_step"] == 8 and checkpoint["epoch"] == 1
    # the optimizer state in torch's own layout, as DDP's optimizer holds it
    ddp_optim = ddp[0]["optim"]
    assert checkpoint["optimizer_states"][0]["param_groups"] == ddp_optim["param_groups"]
    for index, entry in ddp_optim["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(checkpoint["optimizer_states"][0]["state"][index][key], value,
                                       rtol=1e-5, atol=1e-6)
    model = TinyLM.load_from_checkpoint(target)
    assert_close_params(model.state_dict(), want)
    assert model.head.weight is model.embed.weight
    assert_close_params(load_file(weights), want)
    # the same through the Python API, without the optimizer
    lean = consolidate_checkpoint(out / "epochs" / "last.ckpt", tmp_path / "lean.ckpt", weights_only=True)
    assert "optimizer_states" not in torch.load(lean, weights_only=True)
