"""Sharded checkpoints through the engine: resharding across world sizes and stages, exact resume,
atomic saves, and clear errors for damaged checkpoints or another model's.

Every run trains OddMLP (a frozen layer, a layer used every third step, a numel-1 and a numel-0
parameter) with Adam; a 1-rank run sees both ranks' batches, so all runs follow one trajectory.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from zero_strategy import ZeroConfig, ZeroOptimizer, gathered_parameters
from zero_strategy.checkpoint import CheckpointError, CheckpointReader, load_model, load_optimizers, save_sharded
from zero_strategy.checkpoint import store
from zero_strategy.checkpoint.sharded import flat_groups, on_every_rank
from zero_strategy.engine import Collectives, shard_module

from .distributed import run_distributed
from .models import OddMLP, batch, make_optimizer, param_groups
from .test_engine_parity import TINY_BUCKET_MB

SAVE_AT, STOP = 5, 9
STAGES = (1, 2, 3)


def _data(step: int, world_size: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    if world_size == 1:  # both ranks' batches: the same mean gradient as 2 ranks averaging theirs
        (x0, y0), (x1, y1) = batch(step, 0), batch(step, 1)
        return torch.cat([x0, x1]), torch.cat([y0, y1])
    return batch(step, rank)


def _build(stage: int, seed: int = 0, dtype: torch.dtype = torch.float32):
    torch.manual_seed(seed)
    model = OddMLP().to(dtype)
    config = ZeroConfig(stage=stage, bucket_cap_mb=TINY_BUCKET_MB, shard_modules=("Linear",),
                        param_persistence_threshold=0)  # master_weights: fp32 masters of bf16 weights
    user_opt = make_optimizer("adam", param_groups(model))
    sharder = shard_module(model, config) if stage == 3 else None
    return model, ZeroOptimizer(user_opt, config, sharder=sharder), sharder


def _train(model, opt, world_size: int, rank: int, start: int, stop: int) -> list[float]:
    losses = []
    dtype = next(model.parameters()).dtype
    for step in range(start, stop):
        x, y = (t.to(dtype) for t in _data(step, world_size, rank))
        loss = F.mse_loss(model(x, step, 0), y)  # rank 0's modules on every rank: the same units run
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _full_params(model) -> dict[str, torch.Tensor]:
    with gathered_parameters(model):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _save(path: Path, model, opt, sharder, stage: int) -> None:
    save_sharded(path, {"global_step": SAVE_AT, "optimizer_states": [{}]}, model, [opt], sharder, Collectives(), stage)


def _load(path: Path, stage: int, dtype: torch.dtype = torch.float32):
    model, opt, sharder = _build(stage, seed=1, dtype=dtype)  # other weights: all must come from the checkpoint
    reader = CheckpointReader(path)
    saved = reader.trainer_state()["zero_checkpoint"]
    load_model(reader, saved, model, flat_groups([opt], sharder))
    load_optimizers(reader, saved, model, [opt])
    return model, opt


def _save_runs(folder: Path, world_size: int, rank: int) -> dict:
    """At each stage: train, save, and go on uninterrupted; returns what a resume must reproduce."""
    out = {}
    for stage in STAGES:
        model, opt, sharder = _build(stage)
        _train(model, opt, world_size, rank, 0, SAVE_AT)
        _save(folder / f"w{world_size}s{stage}", model, opt, sharder, stage)
        saved = {"params": _full_params(model), "optim": opt.state_dict()}
        losses = _train(model, opt, world_size, rank, SAVE_AT, STOP)
        out[stage] = {**saved, "losses": losses, "final": _full_params(model)}
    return out


def _load_runs(folder: Path, world_size: int, rank: int) -> dict:
    """Every checkpoint in ``folder`` loaded at every stage, then trained to the end."""
    out = {}
    for ckpt in sorted(p for p in folder.iterdir() if not p.name.startswith(".")):
        for stage in STAGES:
            model, opt = _load(ckpt, stage)
            loaded = {"params": _full_params(model), "optim": opt.state_dict()}
            losses = _train(model, opt, world_size, rank, SAVE_AT, STOP)
            out[(ckpt.name, stage)] = {**loaded, "losses": losses, "final": _full_params(model)}
    return out


def _two_rank_runs(rank: int, world_size: int, folder: str) -> dict:
    saves = _save_runs(Path(folder), world_size, rank)
    torch.distributed.barrier()
    return {"saves": saves, "loads": _load_runs(Path(folder), world_size, rank)}


def _assert_optim_equal(got: dict, want: dict) -> None:
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for index, entry in want["state"].items():
        assert got["state"][index].keys() == entry.keys()
        for key, value in entry.items():
            assert torch.equal(got["state"][index][key], value), (index, key)


def _assert_params(got: dict, want: dict, exact: bool) -> None:
    assert got.keys() == want.keys()
    for key in want:
        if exact:
            assert torch.equal(got[key], want[key]), key
        else:
            torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-6, msg=lambda m: f"{key}: {m}")


@pytest.mark.timeout(240)
def test_any_world_size_and_stage_loads_any_other(tmp_path):
    # 1-rank checkpoints (this process) and 2-rank ones (two processes), each loaded at stages 1-3 by
    # 1 rank and by 2 ranks: weights and optimizer state load exactly, and training goes on as the
    # saving run did without the interruption.
    one_rank_saves = _save_runs(tmp_path, 1, 0)
    two_ranks = run_distributed(_two_rank_runs, 2, str(tmp_path))
    one_rank_loads = _load_runs(tmp_path, 1, 0)
    for loads, world_size, rank in ((one_rank_loads, 1, 0), (two_ranks[0]["loads"], 2, 0), (two_ranks[1]["loads"], 2, 1)):
        # losses are over the rank's own batch: compare with the same rank's run
        saves = {f"w1s{s}": one_rank_saves[s] for s in STAGES} | {f"w2s{s}": two_ranks[rank]["saves"][s] for s in STAGES}
        assert len(loads) == len(saves) * len(STAGES)
        for (name, stage), run in loads.items():
            saved = saves[name]
            _assert_params(run["params"], saved["params"], exact=True)
            _assert_optim_equal(run["optim"], saved["optim"])
            same_run = name == f"w{world_size}s{stage}"  # the same world and stage resume bit for bit
            _assert_params(run["final"], saved["final"], exact=same_run)
            if same_run:
                assert run["losses"] == saved["losses"]
            elif name.startswith(f"w{world_size}"):  # a 1-rank loss is over both ranks' batches
                torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(saved["losses"]),
                                           rtol=1e-6, atol=1e-6)


def _mixed_precision_resume(rank: int, world_size: int, folder: str) -> dict:
    out = {}
    for stage in (2, 3):
        path = Path(folder) / f"bf16-s{stage}"
        model, opt, sharder = _build(stage, dtype=torch.bfloat16)
        _train(model, opt, world_size, rank, 0, SAVE_AT)
        _save(path, model, opt, sharder, stage)
        masters = [g.master_shard.clone() for g in opt.groups]
        uninterrupted = _train(model, opt, world_size, rank, SAVE_AT, STOP)
        model2, opt2 = _load(path, stage, dtype=torch.bfloat16)
        out[stage] = {"masters": masters, "loaded_masters": [g.master_shard.clone() for g in opt2.groups],
                      "losses": uninterrupted, "resumed": _train(model2, opt2, world_size, rank, SAVE_AT, STOP)}
    return out


@pytest.mark.timeout(120)
def test_mixed_precision_resume_restores_the_fp32_masters_exactly(tmp_path):
    # the masters are saved beside the bf16 weights, so a resume does not round them to bf16
    for result in run_distributed(_mixed_precision_resume, 2, str(tmp_path)):
        for stage, run in result.items():
            assert all(m.dtype == torch.float32 for m in run["masters"])
            for got, want in zip(run["loaded_masters"], run["masters"]):
                assert torch.equal(got, want), stage
            assert run["resumed"] == run["losses"], stage


def _failing_save(rank: int, world_size: int, folder: str) -> dict:
    path = Path(folder) / "ckpt"
    model, opt, sharder = _build(3)
    _train(model, opt, world_size, rank, 0, 2)
    _save(path, model, opt, sharder, 3)
    before = _full_params(model)
    _train(model, opt, world_size, rank, 2, 4)
    original = store.RankWriter.write

    def write(self, folder):  # rank 1's disk fails half-way through the second save
        if rank == 1:
            (folder / self.file).write_bytes(b"half a file")
            raise OSError(28, "No space left on device")
        return original(self, folder)

    store.RankWriter.write = write
    try:
        with pytest.raises(CheckpointError, match="failed on rank 1.*No space left on device"):
            _save(path, model, opt, sharder, 3)
    finally:
        store.RankWriter.write = original
    torch.distributed.barrier()
    leftovers = sorted(p.name for p in Path(folder).iterdir())
    model2, _ = _load(path, 3)
    return {"before": before, "loaded": _full_params(model2), "leftovers": leftovers}


@pytest.mark.timeout(120)
def test_a_failed_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    for result in run_distributed(_failing_save, 2, str(tmp_path)):
        assert result["leftovers"] == ["ckpt"]  # no partial directory left behind
        _assert_params(result["loaded"], result["before"], exact=True)


# ---- damaged checkpoints and another model's: one rank, in this process ---------------------


@pytest.fixture
def saved_checkpoint(tmp_path) -> Path:
    model, opt, sharder = _build(2)
    _train(model, opt, 1, 0, 0, 2)
    _save(tmp_path / "ckpt", model, opt, sharder, 2)
    return tmp_path / "ckpt"


def test_a_truncated_shard_file_is_reported_by_name(saved_checkpoint):
    shard = saved_checkpoint / store.rank_file(0)
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"rank_00000\.safetensors has \d+ bytes, the index says"):
        _load(saved_checkpoint, 2)


def test_a_missing_shard_file_is_reported_by_name(saved_checkpoint):
    (saved_checkpoint / store.rank_file(0)).unlink()
    with pytest.raises(CheckpointError, match=r"rank_00000\.safetensors is missing"):
        _load(saved_checkpoint, 2)


def test_a_corrupt_shard_header_is_reported_by_name(saved_checkpoint):
    shard = saved_checkpoint / store.rank_file(0)
    data = bytearray(shard.read_bytes())
    data[8:16] = b"\xff" * 8  # the JSON header's first bytes
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank_00000\.safetensors is corrupt"):
        _load(saved_checkpoint, 2)


def test_an_incomplete_directory_and_a_missing_path_are_refused(saved_checkpoint, tmp_path):
    (saved_checkpoint / store.INDEX).unlink()
    with pytest.raises(CheckpointError, match="no index.json"):
        CheckpointReader(saved_checkpoint)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        CheckpointReader(tmp_path / "nowhere")


def test_an_interrupted_replacement_points_at_the_previous_checkpoint(saved_checkpoint):
    saved_checkpoint.rename(store.old_dir(saved_checkpoint))  # the crash came between the two renames
    with pytest.raises(FileNotFoundError, match=r"previous checkpoint is intact at .*\.ckpt\.old"):
        CheckpointReader(saved_checkpoint)


class Widened(OddMLP):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(13, 6)


class Extended(OddMLP):
    def __init__(self) -> None:
        super().__init__()
        self.extra = torch.nn.Linear(2, 2)


@pytest.mark.parametrize("model_class, message", [
    (Widened, r"'head.weight' has shape \(5, 13\), the model's has \(6, 13\)"),
    (Extended, r"missing keys \['extra.weight', 'extra.bias'\]"),
])
def test_a_checkpoint_for_another_model_is_refused(saved_checkpoint, model_class, message):
    reader = CheckpointReader(saved_checkpoint)
    saved = reader.trainer_state()["zero_checkpoint"]
    with pytest.raises(CheckpointError, match=message):
        load_model(reader, saved, model_class(), [])


def test_trainer_state_is_never_unpickled_unsafely(saved_checkpoint):
    state = torch.load(saved_checkpoint / store.TRAINER_STATE, weights_only=True)
    state["hyper_parameters"] = {"path": Path("/tmp")}  # an object torch's safe loader refuses
    torch.save(state, saved_checkpoint / store.TRAINER_STATE)
    index = json.loads((saved_checkpoint / store.INDEX).read_text())  # recorded as if the save had written it
    data = (saved_checkpoint / store.TRAINER_STATE).read_bytes()
    index["trainer_state"] = {"bytes": len(data), "checksum": store.checksum(data)}
    (saved_checkpoint / store.INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"(?s)trainer_state\.pt cannot be loaded safely.*weights_only=False"):
        CheckpointReader(saved_checkpoint).trainer_state()
    # a checkpoint you trust (a network in the hyper-parameters), as trainer.fit(..., weights_only=False) passes it
    assert CheckpointReader(saved_checkpoint).trainer_state(weights_only=False)["hyper_parameters"] == {
        "path": Path("/tmp")}


def test_stale_partial_directories_are_replaced(saved_checkpoint):
    partial = store.partial_dir(saved_checkpoint)
    partial.mkdir()
    (partial / "junk").write_text("from a crashed save")
    model, opt, sharder = _build(2)
    _save(saved_checkpoint, model, opt, sharder, 2)
    assert not partial.exists()
    assert sorted(p.name for p in saved_checkpoint.iterdir()) == [store.INDEX, store.rank_file(0), store.TRAINER_STATE]
    loaded, _ = _load(saved_checkpoint, 2)
    _assert_params(_full_params(loaded), _full_params(model), exact=True)


class TiedFrozen(torch.nn.Module):
    """A frozen embedding tied to the output layer (as in LoRA fine-tuning of GPT-2): at stages 1
    and 2 no flat group holds it, so it is saved whole, once, under its first name."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight
        self.embed.requires_grad_(False)

    def forward(self, tokens):
        return self.head(torch.tanh(self.body(self.embed(tokens))))


def _tied_run(stage: int, seed: int = 0):
    torch.manual_seed(seed)
    model = TiedFrozen()
    config = ZeroConfig(stage=stage, shard_modules=("Linear", "Embedding"), param_persistence_threshold=0)
    sharder = shard_module(model, config) if stage == 3 else None
    opt = ZeroOptimizer(torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01), config,
                        sharder=sharder)
    return model, opt, sharder


@pytest.mark.parametrize("save_stage, load_stage", [(2, 2), (1, 3), (3, 1)])
def test_a_frozen_tied_weight_saves_once_and_loads_at_any_stage(tmp_path, save_stage, load_stage):
    model, opt, sharder = _tied_run(save_stage)
    tokens = torch.randint(0, 10, (4, 5))
    opt.zero_grad()
    model(tokens).sum().backward()
    opt.step()
    _save(tmp_path / "ckpt", model, opt, sharder, save_stage)
    loaded, opt2, sharder2 = _tied_run(load_stage, seed=1)
    reader = CheckpointReader(tmp_path / "ckpt")
    saved = reader.trainer_state()["zero_checkpoint"]
    load_model(reader, saved, loaded, flat_groups([opt2], sharder2))
    load_optimizers(reader, saved, loaded, [opt2])
    _assert_params(_full_params(loaded), _full_params(model), exact=True)
    assert loaded.head.weight is loaded.embed.weight


def _one_rank_cannot_read(rank: int, world_size: int, folder: str) -> str:
    path = Path(folder) / "ckpt"
    model, opt, sharder = _build(3)
    _save(path, model, opt, sharder, 3)
    torch.distributed.barrier()
    if rank == 0:  # rank 1's file: the same size (the index check passes), a broken header
        with open(path / store.rank_file(1), "r+b") as f:
            f.write(b"\xff" * 8)
    torch.distributed.barrier()
    model2, opt2, sharder2 = _build(3, seed=1)
    reader = CheckpointReader(path)
    saved = reader.trainer_state()["zero_checkpoint"]
    with pytest.raises(CheckpointError) as caught:  # on every rank, not only the one that read the file
        on_every_rank(Collectives(), lambda: load_model(reader, saved, model2, flat_groups([opt2], sharder2)))
    torch.distributed.barrier()  # and nobody is left waiting
    return str(caught.value)


@pytest.mark.timeout(120)
def test_a_rank_that_cannot_read_its_part_fails_the_load_on_every_rank(tmp_path):
    for message in run_distributed(_one_rank_cannot_read, 2, str(tmp_path)):
        assert re.search(r"failed on rank 1: CheckpointError: shard file .*rank_00001\.safetensors is corrupt", message)
