"""Checkpoints saved in the background (``async_save``): what is written is the state at the save, a
resume from it is exact, a rank killed during the write leaves the previous checkpoint loadable,
and what must wait for a complete save (a removal, the next save) waits.

The engine runs without Lightning here (the helpers of test_checkpoint.py: OddMLP and Adam, 2 gloo
ranks); the front ends only pass their EngineModel's saver to the same ``save_sharded``.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from zero_strategy import ZeroConfig, ZeroOptimizer, estimate_memory, memory_stats
from zero_strategy.checkpoint import CheckpointError, is_sharded_checkpoint, save_sharded
from zero_strategy.checkpoint import store
from zero_strategy.checkpoint.background import BackgroundSaver
from zero_strategy.engine import Collectives, shard_module

from .distributed import run_distributed
from .test_checkpoint import SAVE_AT, STAGES, STOP, _assert_params, _build, _full_params, _load, _train


def _save(path: Path, model, opt, sharder, stage: int, saver: BackgroundSaver) -> None:
    save_sharded(path, {"global_step": SAVE_AT, "optimizer_states": [{}]}, model, [opt], sharder, Collectives(),
                 stage, background=saver)


def _resume_runs(rank: int, world_size: int, folder: str) -> dict:
    """Each stage: train, save in the background and train on at once while it is written; then load
    the checkpoint into a fresh model and train the same steps."""
    out = {}
    for stage in STAGES:
        model, opt, sharder = _build(stage)
        saver = BackgroundSaver(model)
        _train(model, opt, world_size, rank, 0, SAVE_AT)
        at_save = _full_params(model)
        path = Path(folder) / f"s{stage}"
        _save(path, model, opt, sharder, stage, saver)
        losses = _train(model, opt, world_size, rank, SAVE_AT, STOP)  # the write goes on meanwhile
        saver.wait()
        buffers = memory_stats(model, [opt])["checkpoint_buffers"]
        kept = {k: t.data_ptr() for k, t in saver.buffers.items()}
        _save(Path(folder) / f"s{stage}_again", model, opt, sharder, stage, saver)  # same sizes: same buffers
        saver.close()
        reused = all(saver_ptr == kept.get(k) for k, saver_ptr in kept.items())
        torch.distributed.barrier()
        loaded_model, loaded_opt = _load(path, stage)
        loaded = _full_params(loaded_model)
        resumed = _train(loaded_model, loaded_opt, world_size, rank, SAVE_AT, STOP)
        out[stage] = {"at_save": at_save, "loaded": loaded, "losses": losses, "resumed": resumed,
                      "final": _full_params(model), "final_resumed": _full_params(loaded_model),
                      "buffers": buffers, "file_bytes": _tensor_bytes(path, rank), "reused": reused}
    return out


def _tensor_bytes(path: Path, rank: int) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() * t.element_size() for t in load_file(path / store.rank_file(rank)).values())


@pytest.mark.timeout(240)
def test_a_background_save_holds_the_state_at_the_save_and_resumes_exactly(tmp_path):
    results = run_distributed(_resume_runs, 2, str(tmp_path))
    for rank, result in enumerate(results):
        for stage in STAGES:
            r = result[stage]
            _assert_params(r["loaded"], r["at_save"], exact=True)  # not the weights trained meanwhile
            assert r["resumed"] == r["losses"], (rank, stage)
            _assert_params(r["final_resumed"], r["final"], exact=True)
            # the host buffers are what memory_stats reports, one rank's share of the checkpoint, reused
            assert r["buffers"] == r["file_bytes"], (rank, stage)
            assert r["reused"], (rank, stage)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"s{s}{x}" for s in STAGES for x in ("", "_again"))


def _estimate_run(rank: int, world_size: int, stage: int, folder: str) -> int:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.Linear(64, 16, bias=False))  # 3072 elements, even shards
    config = ZeroConfig(stage=stage, async_save=True)
    sharder = shard_module(model, config) if stage == 3 else None
    opt = ZeroOptimizer(torch.optim.Adam(model.parameters()), config, sharder=sharder)
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    saver = BackgroundSaver(model)
    save_sharded(Path(folder) / "c", {"optimizer_states": [{}]}, model, [opt], sharder, Collectives(), stage,
                 background=saver)
    saver.wait()
    held = memory_stats(model, [opt])["checkpoint_buffers"]
    saver.close()
    assert memory_stats(model, [opt])["checkpoint_buffers"] == 0  # closing frees them
    return held


@pytest.mark.parametrize("stage", [1, 3])
def test_the_estimator_predicts_the_host_buffers(stage, tmp_path):
    got = run_distributed(_estimate_run, 2, stage, str(tmp_path))
    predicted = estimate_memory(32 * 64 + 64 * 16, stage=stage, world_size=2, async_save=True)["checkpoint_buffers"]
    assert got == [predicted, predicted]
    assert estimate_memory(3072, stage=stage, world_size=2)["checkpoint_buffers"] == 0


# ---- a rank killed during the background write -------------------------------------------


def _killed_during_write(rank: int, world_size: int, folder: str) -> None:
    model, opt, sharder = _build(2)
    saver = BackgroundSaver(model)
    _train(model, opt, world_size, rank, 0, SAVE_AT)
    path = Path(folder) / "ckpt"
    _save(path, model, opt, sharder, 2, saver)
    saver.wait()
    torch.save(_full_params(model), Path(folder) / f"before{rank}.pt")
    _train(model, opt, world_size, rank, SAVE_AT, STOP)
    if rank == 1:
        original = store.RankWriter.write

        def die_halfway(self, target_folder):
            size = original(self, target_folder)
            with open(Path(target_folder) / self.file, "r+b") as f:
                f.truncate(size // 2)  # the file half written
            os.kill(os.getpid(), signal.SIGKILL)

        store.RankWriter.write = die_halfway
    _save(path, model, opt, sharder, 2, saver)  # over the previous one, in the background
    try:
        saver.wait()
    except CheckpointError as err:
        (Path(folder) / "rank0_error.txt").write_text(str(err))


@pytest.mark.timeout(120)
def test_a_rank_killed_during_a_background_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    with pytest.raises(RuntimeError, match=r"rank 1.*died \(signal SIGKILL\)|died \(signal SIGKILL\)"):
        run_distributed(_killed_during_write, 2, str(tmp_path), alone=True)
    told = (tmp_path / "rank0_error.txt").read_text()  # rank 0 was told, not left waiting
    assert "could not agree that every file was written" in told and "Nothing was written over" in told
    path = tmp_path / "ckpt"
    assert is_sharded_checkpoint(path) and not store.partial_dir(path).exists()  # rank 0 removed the half-written one
    before = torch.load(tmp_path / "before0.pt", weights_only=True)
    model, _ = _load(path, 2)  # the previous checkpoint, verified against its checksums
    _assert_params(_full_params(model), before, exact=True)


# ---- waiting: removals, the next save, errors --------------------------------------------


class _HeldSnapshot:
    """A save whose write waits for ``release``, then fails if ``fail``."""

    def __init__(self, path: Path, fail: bool = False) -> None:
        self.path, self.fail, self.release = path, fail, threading.Event()

    def write(self, comm) -> None:
        assert self.release.wait(30)
        if self.fail:
            raise CheckpointError(f"no space left writing {self.path}")


def test_removals_wait_for_the_commit_and_a_failed_save_keeps_them_and_raises_at_the_next_save(tmp_path):
    saver, removed = BackgroundSaver(), []
    held = _HeldSnapshot(tmp_path / "new")
    saver.start(held, Collectives())
    saver.after_commit(lambda: removed.append("old"))
    assert saver.pending and removed == []  # the old checkpoint stays while the new one is written
    held.release.set()
    saver.wait()
    assert removed == ["old"]
    saver.after_commit(lambda: removed.append("now"))  # nothing in flight: at once
    assert removed == ["old", "now"]

    failing = _HeldSnapshot(tmp_path / "bad", fail=True)
    saver.start(failing, Collectives())
    saver.after_commit(lambda: removed.append("kept"))
    failing.release.set()
    with pytest.raises(CheckpointError, match=r"background save of the checkpoint .*bad failed: no space left"):
        saver.start(_HeldSnapshot(tmp_path / "next"), Collectives())  # the next save raises the last one's error
    assert removed == ["old", "now"]  # the older checkpoint was not removed after a failed save
    saver.wait()  # raised once, then clear
