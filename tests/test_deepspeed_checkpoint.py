"""DeepSpeed checkpoints read without DeepSpeed: weights and Adam moments equal to what DeepSpeed itself
reads from them, training resumed at any world size and stage equal to DeepSpeed's own continuation,
and damaged, incomplete or unsafe files refused by name.

The checkpoints and references in tests/data/deepspeed/ were written by DeepSpeed 0.19.8 on 2 gloo
ranks (tests/scripts/make_deepspeed_checkpoints.py, model and data in tests/deepspeed_model.py):
``zero_to_fp32/*`` is DeepSpeed's get_fp32_state_dict_from_zero_checkpoint, ``exp_avg/*`` and
``exp_avg_sq/*`` its safe_get_full_optimizer_state, ``continued/*`` and the losses what DeepSpeed
reached in ``CONTINUE`` more steps after the save.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from zero_strategy import ZeroConfig, ZeroOptimizer, gathered_parameters
from zero_strategy.checkpoint import CheckpointError
from zero_strategy.checkpoint.deepspeed import (align_optimizer_state, consolidate_deepspeed_checkpoint,
                                                is_deepspeed_checkpoint, read_deepspeed_checkpoint)
from zero_strategy.checkpoint.deepspeed_files import load_safely
from zero_strategy.checkpoint.sharded import parameter_names
from zero_strategy.engine import shard_module
from zero_strategy.engine.grads.scaler import LossScaler

from .deepspeed_model import (BETAS, CASES, CONTINUE, EPS, LR, SAVE_AT, batch_for, build_model, loss_of,
                              param_groups)
from .distributed import run_distributed

DATA = Path(__file__).parent / "data" / "deepspeed"
FP32_CASES = [name for name, (_, precision, _, _) in CASES.items() if precision == "fp32"]


def _reference(case: str) -> tuple[dict[str, torch.Tensor], dict]:
    return load_file(DATA / case / "reference.safetensors"), json.loads((DATA / case / "reference.json").read_text())


def _section(ref: dict[str, torch.Tensor], section: str) -> dict[str, torch.Tensor]:
    return {k.split("/", 1)[1]: v for k, v in ref.items() if k.startswith(section + "/")}


@pytest.mark.parametrize("case", list(CASES))
def test_weights_and_moments_equal_deepspeeds_reading(case, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` fails: nothing may need it
    checkpoint = read_deepspeed_checkpoint(DATA / case)
    ref, info = _reference(case)
    state_dict = checkpoint["state_dict"]
    assert list(state_dict) == list(build_model().state_dict())  # every key: tied, frozen, buffers
    assert state_dict["head.weight"] is state_dict["embed.weight"]  # tied: one tensor under both names
    assert all(v.dtype == torch.float32 for v in state_dict.values())
    for name, value in _section(ref, "zero_to_fp32").items():  # fp32 masters: bit-equal
        assert torch.equal(state_dict[name], value.float()), name
    for name in ("frozen.weight", "frozen.bias"):  # stage 1: not in zero_to_fp32's result, kept here
        assert torch.equal(state_dict[name], _section(ref, "continued")[name]), name  # frozen: never changes

    trained = [n for n, p in build_model().named_parameters() if p.requires_grad]
    names = checkpoint["deepspeed"]["param_names"]
    assert sorted(n for group in names for n in group) == sorted(trained)
    optimizer = checkpoint["optimizer_states"][0]
    assert [g["params"] for g in optimizer["param_groups"]] == [
        list(range(sum(map(len, names[:i])), sum(map(len, names[: i + 1])))) for i in range(len(names))]
    moments = {key: _section(ref, key) for key in ("exp_avg", "exp_avg_sq")}
    for index, name in enumerate(n for group in names for n in group):
        state = optimizer["state"][index]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        assert state["step"].item() == info["save_at"]
        for key in moments:
            assert torch.equal(state[key], moments[key][name]), (name, key)
    for group in optimizer["param_groups"]:
        assert (group["lr"], tuple(group["betas"]), group["eps"]) == (LR, BETAS, EPS)
    assert [g["weight_decay"] for g in optimizer["param_groups"]] == [g["weight_decay"] for g in
                                                                      param_groups(build_model())]
    source = checkpoint["deepspeed"]
    assert (source["stage"], source["world_size"], source["dtype"], source["tag"], source["version"]) == (
        info["stage"], info["world_size"], info["model_dtype"], info["tag"], info["deepspeed_version"])
    torch.save(checkpoint, "/dev/null")  # plain data only: stand-ins became dicts
    assert "lr_schedulers" in checkpoint and "pytorch-lightning_version" in checkpoint  # Lightning can resume


def test_lightning_client_state_is_kept():
    case = next(name for name, (_, _, _, client) in CASES.items() if client == "lightning")
    checkpoint = read_deepspeed_checkpoint(DATA / case)
    _, info = _reference(case)
    for key, value in info["client_state"].items():
        assert checkpoint[key] == value, key
    for key in ("callbacks", "lr_schedulers", "hyper_parameters", "pytorch-lightning_version"):
        assert key in checkpoint, key
    assert checkpoint["deepspeed"]["tag"] == "checkpoint"
    assert checkpoint["lr_schedulers"][0]["step_size"] == 1000  # Lightning's, not replaced by a default


def test_fp16_loss_scale_goes_on_as_deepspeeds():
    checkpoint = read_deepspeed_checkpoint(DATA / "stage2_fp16")
    scaler = LossScaler(**checkpoint["ZeroPrecision"]["loss_scaler"])  # this package's scaler takes it as is
    assert scaler.scale == checkpoint["deepspeed"]["loss_scaler"]["cur_scale"]
    _, info = _reference("stage2_fp16")
    skipped = checkpoint["deepspeed"]["skipped_steps"]
    for deepspeed_scale, deepspeed_skipped in info["loss_scale_and_skipped_steps"]:  # after each step DeepSpeed took
        scaler.update(overflow=deepspeed_skipped > skipped)
        skipped = deepspeed_skipped
        assert scaler.scale == deepspeed_scale
    assert len({scale for scale, _ in info["loss_scale_and_skipped_steps"]}) > 1  # the scale did change meanwhile
    assert "ZeroPrecision" not in read_deepspeed_checkpoint(DATA / "stage3_bf16")


def test_tag_folder_and_tag_argument_read_the_same_save():
    whole = read_deepspeed_checkpoint(DATA / "stage3_fp32")
    tag = whole["deepspeed"]["tag"]
    for other in (read_deepspeed_checkpoint(DATA / "stage3_fp32" / tag), read_deepspeed_checkpoint(DATA / "stage3_fp32",
                                                                                                   tag=tag)):
        assert all(torch.equal(other["state_dict"][k], v) for k, v in whole["state_dict"].items())
    assert is_deepspeed_checkpoint(DATA / "stage3_fp32") and is_deepspeed_checkpoint(DATA / "stage3_fp32" / tag)
    assert not is_deepspeed_checkpoint(DATA) and not is_deepspeed_checkpoint(DATA / "stage3_fp32" / "latest")


def test_this_packages_sharded_checkpoints_are_not_taken_for_deepspeeds(tmp_path):
    (tmp_path / "index.json").write_text("{}")
    (tmp_path / "rank_00000.safetensors").write_bytes(b"")
    assert not is_deepspeed_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="is not a DeepSpeed checkpoint"):
        read_deepspeed_checkpoint(tmp_path)


def test_consolidated_file_is_a_regular_checkpoint(tmp_path):
    out = consolidate_deepspeed_checkpoint(DATA / "lightning_stage2_bf16", tmp_path / "model.ckpt")
    loaded = torch.load(out, weights_only=True)  # Lightning's state included
    read = read_deepspeed_checkpoint(DATA / "lightning_stage2_bf16")
    assert loaded.keys() == read.keys() and loaded["loops"] == read["loops"]
    model = build_model(seed=1)
    model.load_state_dict(loaded["state_dict"])  # strict: every key there
    assert loaded["state_dict"]["head.weight"].data_ptr() == loaded["state_dict"]["embed.weight"].data_ptr()
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask
    assert [p.name for p in tmp_path.iterdir()] == ["model.ckpt"]  # no temporary file left
    with pytest.raises(IsADirectoryError, match="give the path of the file"):
        consolidate_deepspeed_checkpoint(DATA / "stage3_fp32", tmp_path)

    small = consolidate_deepspeed_checkpoint(DATA / "stage3_fp32", tmp_path / "weights.ckpt",
                                             safetensors_path=tmp_path / "weights.safetensors", weights_only=True)
    loaded = torch.load(small, weights_only=True)
    assert "optimizer_states" not in loaded and "lr_schedulers" not in loaded
    tensors = load_file(tmp_path / "weights.safetensors")
    assert tensors.keys() == loaded["state_dict"].keys()  # the tied weight under both names, as a copy
    assert all(torch.equal(tensors[k], v) for k, v in loaded["state_dict"].items())
    assert (tmp_path / "weights.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


def _resume(model, optimizer, world_size: int, rank: int) -> list[float]:
    losses = []
    for step in range(SAVE_AT, SAVE_AT + CONTINUE):
        loss = loss_of(model, *batch_for(step, world_size, rank))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _names(model, groups: list[dict]) -> list[list[str]]:
    names = parameter_names(model)
    return [[names[p] for p in g["params"]] for g in groups]


def test_a_plain_torch_run_resumes_like_deepspeed():
    # the single-process reference: no ZeRO, torch's AdamW over model.parameters() (frozen included)
    for case in FP32_CASES:
        checkpoint = read_deepspeed_checkpoint(DATA / case)
        model = build_model(seed=1)
        model.load_state_dict(checkpoint["state_dict"])
        optimizer = torch.optim.AdamW(param_groups(model), lr=LR)
        optimizer.load_state_dict(align_optimizer_state(checkpoint, _names(model, optimizer.param_groups)))
        _check_continuation(case, _resume(model, optimizer, 1, 0), dict(model.named_parameters()), 1, 0)


def _check_continuation(case: str, losses: list[float], params: dict, world_size: int, rank: int) -> None:
    ref, info = _reference(case)
    deepspeed_losses = torch.tensor(info["losses"])  # (ranks, steps)
    want = deepspeed_losses.mean(0) if world_size == 1 else deepspeed_losses[rank]  # 1 rank: both batches
    torch.testing.assert_close(torch.tensor(losses), want, rtol=0, atol=1e-5, msg=lambda m: f"{case}: {m}")
    for name, value in _section(ref, "continued").items():
        torch.testing.assert_close(params[name].detach(), value, rtol=0, atol=1e-5, msg=lambda m: f"{case} {name}: {m}")


def _engine_runs(rank: int, world_size: int) -> dict:
    """Every fp32 checkpoint loaded at stages 1-3 and trained on; at the checkpoint's own stage through
    an optimizer of the trainable parameters only (the torch layout as read), else through one over
    model.parameters() (frozen included), aligned by name."""
    out = {}
    for case in FP32_CASES:
        for stage in (1, 2, 3):
            checkpoint = read_deepspeed_checkpoint(DATA / case)  # afresh: torch's optimizers step loaded state in place
            model = build_model(seed=1)  # other weights: everything must come from the checkpoint
            direct = stage == checkpoint["deepspeed"]["stage"]
            groups = param_groups(model)
            if direct:
                groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in groups]
            user_optimizer = torch.optim.AdamW(groups, lr=LR)
            config = ZeroConfig(stage=stage, bucket_cap_mb=200 * 4 / 2**20, shard_modules=("Linear", "Embedding"),
                                param_persistence_threshold=0)
            sharder = shard_module(model, config) if stage == 3 else None
            optimizer = ZeroOptimizer(user_optimizer, config, sharder=sharder)
            if sharder is not None:
                sharder.load_full_state_dict(checkpoint["state_dict"])
            else:
                model.load_state_dict(checkpoint["state_dict"])
            state = checkpoint["optimizer_states"][0] if direct else align_optimizer_state(
                checkpoint, _names(model, optimizer.param_groups))
            optimizer.load_state_dict(state)
            losses = _resume(model, optimizer, world_size, rank)
            with gathered_parameters(model):
                params = {n: p.detach().clone() for n, p in model.named_parameters()}
            out[(case, stage)] = (losses, params)
    return out


@pytest.mark.timeout(240)
def test_the_engine_resumes_like_deepspeed_at_any_world_size_and_stage():
    for world_size, runs_by_rank in ((1, [_engine_runs(0, 1)]), (2, run_distributed(_engine_runs, 2))):
        for rank, runs in enumerate(runs_by_rank):
            assert len(runs) == len(FP32_CASES) * 3
            for (case, stage), (losses, params) in runs.items():
                try:
                    _check_continuation(case, losses, params, world_size, rank)
                except AssertionError as err:
                    raise AssertionError(f"resumed at stage {stage} on {world_size} ranks: {err}") from None


# ---- damaged, incomplete, unsupported and unsafe checkpoints --------------------------------


@pytest.fixture
def copy(tmp_path):
    """A copy of a checkpoint, to damage; and its tag folder."""

    def make(case: str = "stage2_fp32") -> tuple[Path, Path]:
        target = tmp_path / case
        shutil.copytree(DATA / case, target)
        return target, target / (target / "latest").read_text().strip()

    return make


def test_a_truncated_file_is_named(copy):
    root, folder = copy()
    victim = folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt.*damaged"):
        read_deepspeed_checkpoint(root)


def test_a_flipped_byte_is_detected_before_loading(copy):
    root, folder = copy()
    victim = folder / "mp_rank_00_model_states.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the tensor data: unpickling alone would not notice
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="mp_rank_00_model_states.pt is damaged.*CRC"):
        read_deepspeed_checkpoint(root)


def test_missing_files_are_named(copy):
    root, folder = copy("stage3_fp32")
    (folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"saved by 2 ranks but lacks .*zero_pp_rank_1_mp_rank_00_optim_states"):
        read_deepspeed_checkpoint(root)
    root, folder = copy("stage1_fp32")
    (folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"lacks the optimizer files \['zero_pp_rank_0_mp_rank_00_optim"):
        read_deepspeed_checkpoint(root)
    (root / "latest").write_text("global_step99")
    with pytest.raises(CheckpointError, match="names the tag 'global_step99'"):
        read_deepspeed_checkpoint(root)
    with pytest.raises(CheckpointError, match="tag 'nope' is not in"):
        read_deepspeed_checkpoint(root, tag="nope")


def test_files_of_different_saves_are_refused(copy):
    root, folder = copy("stage2_fp32")
    other = DATA / "stage1_fp32" / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(other, folder / other.name)
    with pytest.raises(CheckpointError, match="zero_pp_rank_1.*different saves"):
        read_deepspeed_checkpoint(root)


@pytest.mark.parametrize("extra", ["mp_rank_01_model_states.pt", "layer_01-model_states.pt"])
def test_pipeline_and_tensor_parallel_layouts_are_refused(copy, extra):
    root, folder = copy()
    shutil.copy(folder / "mp_rank_00_model_states.pt", folder / extra)
    with pytest.raises(CheckpointError, match=f"{extra}.*pipeline- or tensor-parallel"):
        read_deepspeed_checkpoint(root)


UNPICKLED: list = []


class Mystery:
    """A type no allowlist has; unpickling it would run its __setstate__."""

    def __setstate__(self, state):
        UNPICKLED.append(state)


def test_an_unknown_pickled_type_is_named_and_never_built(copy):
    root, folder = copy()
    victim = folder / "mp_rank_00_model_states.pt"
    state = load_safely(victim)
    state["mystery"] = Mystery()
    torch.save(state, victim)
    with pytest.raises(CheckpointError, match=f"{victim.name} holds objects of types .*{__name__}.Mystery"):
        read_deepspeed_checkpoint(root)
    assert UNPICKLED == []
