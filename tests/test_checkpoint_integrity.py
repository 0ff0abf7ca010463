"""Checkpoints that say when they are damaged: checksums per part, a validated index, unfinished
saves refused, files that follow the umask, and zero-consolidate failing with ``error:`` and 2;
objects a safe load refuses kept beside the safe files, checked, and loaded only when asked.

The fault injection is real: bytes are flipped in a file a 2-rank save wrote, and the load is
attempted on both ranks as the strategy does it (``on_every_rank``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from zero_strategy.checkpoint import (CheckpointError, CheckpointReader, PickledObjectsWarning, consolidate_checkpoint,
                                      is_sharded_checkpoint, save_sharded)
from zero_strategy.checkpoint import store
from zero_strategy.checkpoint.sharded import flat_groups, load_model, load_optimizers, on_every_rank
from zero_strategy.cli.consolidate import main as consolidate_main
from zero_strategy.engine import Collectives
from zero_strategy.frontend.checkpoint import open_sharded

from .distributed import run_distributed
from .test_checkpoint import _build, _full_params, _load, _save, _train

FLIPPED = 16  # bytes
W = "model/fc1.weight"  # a tensor of OddMLP
R0 = store.rank_file(0)


def _flip(file: Path, offset: int) -> None:
    """XOR ``FLIPPED`` bytes of ``file`` from ``offset`` on: damage that keeps the size."""
    data = bytearray(file.read_bytes())
    data[offset : offset + FLIPPED] = bytes(b ^ 0xFF for b in data[offset : offset + FLIPPED])
    file.write_bytes(bytes(data))


def _flip_the_middle_tensor(file: Path) -> tuple[str, int]:
    """Flip bytes in the middle of the safetensors file ``file``, all inside the part whose bytes hold
    the file's middle (read from the file's own header); returns its key and the flipped bytes'
    offset inside the part."""
    data = file.read_bytes()
    header_len = struct.unpack("<Q", data[:8])[0]
    header, base = json.loads(data[8 : 8 + header_len]), 8 + header_len
    middle = len(data) // 2 - base
    assert middle >= 0, "the middle of the file is in its header: the model is too small for this test"
    key, (begin, end) = next((k, v["data_offsets"]) for k, v in header.items()
                             if k != "__metadata__" and v["data_offsets"][0] <= middle < v["data_offsets"][1])
    assert end - begin >= FLIPPED
    inside = (end - begin - FLIPPED) // 2
    _flip(file, base + begin + inside)
    return key, inside


def _state(model, opt) -> dict:
    return {"params": _full_params(model), "optim": opt.state_dict()}


def _try_load(path: Path, stage: int, verify: bool = True) -> tuple[str, dict]:
    """Load as the strategy does (each phase on every rank); the error message, or the state loaded."""
    model, opt, sharder = _build(stage, seed=1)
    comm = Collectives()
    try:
        reader = CheckpointReader(path, verify=verify)
        saved = reader.trainer_state()["zero_checkpoint"]
        on_every_rank(comm, lambda: load_model(reader, saved, model, flat_groups([opt], sharder)))
        on_every_rank(comm, lambda: load_optimizers(reader, saved, model, [opt]))
    except CheckpointError as err:
        return str(err), {}
    return "", _state(model, opt)


def _damaged_two_rank_checkpoint(rank: int, world_size: int, folder: str) -> dict:
    """Save at stage 3 on 2 ranks, keep an intact copy, flip bytes in rank 1's file, then load it at
    stages 3 and 1 (errors), with verify=False (loads) and the intact copy (the reference)."""
    folder = Path(folder)
    model, opt, sharder = _build(3)
    _train(model, opt, world_size, rank, 0, 3)
    _save(folder / "ckpt", model, opt, sharder, 3)
    flipped = {}
    if rank == 0:
        shutil.copytree(folder / "ckpt", folder / "intact")
        flipped["key"], _ = _flip_the_middle_tensor(folder / "ckpt" / store.rank_file(1))
    torch.distributed.barrier()
    out = {"flipped": flipped, "errors": {}}
    for stage in (3, 1):  # stage 3: only rank 1 reads rank 1's file; stage 1: both read its weights
        out["errors"][stage], _ = _try_load(folder / "ckpt", stage)
    torch.distributed.barrier()  # nobody was left waiting in a collective
    _, out["unverified"] = _try_load(folder / "ckpt", 3, verify=False)
    _, out["intact"] = _try_load(folder / "intact", 3)
    return out


def _equal_states(a: dict, b: dict) -> bool:
    same = all(torch.equal(a["params"][k], b["params"][k]) for k in b["params"])
    for index, entry in b["optim"]["state"].items():
        same &= all(torch.equal(a["optim"]["state"][index][k], v) for k, v in entry.items())
    return same


@pytest.mark.timeout(120)
def test_flipped_bytes_fail_the_load_on_every_rank_and_zero_consolidate_naming_file_and_tensor(tmp_path, capsys):
    results = run_distributed(_damaged_two_rank_checkpoint, 2, str(tmp_path))
    key = results[0]["flipped"]["key"]
    tensor = key.rsplit("@", 1)[0]
    for rank, result in enumerate(results):
        for stage, message in result["errors"].items():
            assert "rank_00001.safetensors is damaged" in message, (rank, stage, message)
            assert f"tensor {tensor!r}" in message and "checksum" in message, (rank, stage, message)
        assert result["unverified"], "verify=False must load the damaged checkpoint"
        assert not _equal_states(result["unverified"], result["intact"]), "the flipped bytes were not loaded"
    assert _equal_states(results[0]["intact"], results[1]["intact"])

    out = tmp_path / "model.ckpt"
    assert consolidate_main([str(tmp_path / "ckpt"), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zero-consolidate: error: ") and "rank_00001.safetensors is damaged" in err, err
    assert f"tensor {tensor!r}" in err and "Traceback" not in err, err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    # --no-verify writes it out, damage included: it differs from the intact checkpoint's consolidation
    assert consolidate_main([str(tmp_path / "ckpt"), str(out), "--no-verify"]) == 0
    assert consolidate_main([str(tmp_path / "intact"), str(tmp_path / "intact.ckpt")]) == 0
    damaged, intact = (torch.load(p, weights_only=True) for p in (out, tmp_path / "intact.ckpt"))
    assert damaged["state_dict"].keys() == intact["state_dict"].keys()
    differs = [k for k in intact["state_dict"] if not torch.equal(damaged["state_dict"][k], intact["state_dict"][k])]
    differs += [(i, k) for i, entry in intact["optimizer_states"][0]["state"].items() for k, v in entry.items()
                if not torch.equal(damaged["optimizer_states"][0]["state"][i][k], v)]
    assert len(differs) == 1, differs


# ---- one rank, in this process --------------------------------------------------------------


@pytest.fixture
def saved(tmp_path) -> Path:
    model, opt, sharder = _build(2)
    _train(model, opt, 1, 0, 0, 2)
    _save(tmp_path / "ckpt", model, opt, sharder, 2)
    return tmp_path / "ckpt"


def _edit_index(ckpt: Path, edit) -> None:
    index = json.loads((ckpt / store.INDEX).read_text())
    edit(index)
    (ckpt / store.INDEX).write_text(json.dumps(index))


def _strip_checksums(index: dict) -> None:
    """What the previous version wrote: no checksum, no trainer_state entry, sizes only."""
    del index["checksum"], index["trainer_state"]
    for entry in index["files"].values():
        del entry["checksums"]


def test_damaged_trainer_state_is_reported_by_name(saved, tmp_path, capsys):
    _flip(saved / store.TRAINER_STATE, (saved / store.TRAINER_STATE).stat().st_size // 2)
    with pytest.raises(CheckpointError, match=r"trainer_state\.pt is damaged: its bytes do not match the checksum"):
        CheckpointReader(saved).trainer_state()
    assert consolidate_main([str(saved), str(tmp_path / "out.ckpt")]) == 2
    assert "zero-consolidate: error: " in capsys.readouterr().err


def test_a_part_is_checked_whole_when_a_range_of_it_is_read(saved):
    key, inside = _flip_the_middle_tensor(saved / store.rank_file(0))
    name, start = key.rsplit("@", 1)
    assert inside >= 4  # the first element (fp32) is intact
    with pytest.raises(CheckpointError, match=f"rank_00000.safetensors is damaged: tensor {name!r}"):
        CheckpointReader(saved).read(name, int(start), int(start) + 1)
    assert torch.isfinite(CheckpointReader(saved, verify=False).read(name, int(start), int(start) + 1)).all()


def test_each_part_is_hashed_once_per_reader(saved, monkeypatch):
    hashed, real = [], store.checksum
    monkeypatch.setattr(store, "checksum", lambda data: hashed.append(len(data)) or real(data))
    reader = CheckpointReader(saved)
    reader.read(W), reader.read(W, 3, 9), reader.full(W)
    assert len(reader.tensors[W]["parts"]) == 1 and len(hashed) == 1  # three reads, one check
    reader.verify_all()  # every other part and the trainer state, once each
    assert len(hashed) == sum(len(info["parts"]) for info in reader.tensors.values()) + 1
    CheckpointReader(saved, verify=False).full(W)
    assert len(hashed) == sum(len(info["parts"]) for info in reader.tensors.values()) + 1


def test_an_index_without_checksums_loads_with_one_warning_and_verify_false_without(saved):
    model_before = _full_params(_load(saved, 2)[0])
    _edit_index(saved, _strip_checksums)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = _load(saved, 2)
    unverified = [w for w in caught if issubclass(w.category, store.UnverifiedCheckpointWarning)]
    assert len(unverified) == 1 and str(saved) in str(unverified[0].message), [str(w.message) for w in caught]
    assert "not verified" in str(unverified[0].message)
    for key, value in model_before.items():
        assert torch.equal(_full_params(model)[key], value), key
    with warnings.catch_warnings():
        warnings.simplefilter("error", store.UnverifiedCheckpointWarning)
        CheckpointReader(saved, verify=False).trainer_state()


def test_zero_consolidate_warns_about_an_unverified_checkpoint(saved, tmp_path, capsys):
    _edit_index(saved, _strip_checksums)
    assert consolidate_main([str(saved), str(tmp_path / "out.ckpt")]) == 0
    assert "zero-consolidate: warning: the checkpoint" in capsys.readouterr().err


def test_a_partial_directory_is_never_a_checkpoint(saved):
    partial = store.partial_dir(saved)
    shutil.copytree(saved, partial)  # even a complete one, as a crash just before the rename leaves it
    assert is_sharded_checkpoint(saved) and not is_sharded_checkpoint(partial)
    with pytest.raises(CheckpointError, match=r"\.ckpt\.partial is an unfinished save.*Load the finished checkpoint"):
        CheckpointReader(partial)


def test_a_cut_off_index_is_not_a_checkpoint_and_the_reader_says_so(saved, tmp_path, capsys):
    index = saved / store.INDEX
    index.write_bytes(index.read_bytes()[: index.stat().st_size // 2])
    assert not is_sharded_checkpoint(saved)
    with pytest.raises(CheckpointError, match=r"index\.json is cut off or is not valid JSON"):
        CheckpointReader(saved)
    assert consolidate_main([str(saved), str(tmp_path / "out.ckpt")]) == 2
    assert "zero-consolidate: error: " in capsys.readouterr().err


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_every_file_follows_the_umask(tmp_path, umask):
    previous = os.umask(umask)
    try:
        model, opt, sharder = _build(3)
        _save(tmp_path / "ckpt", model, opt, sharder, 3)
        consolidate_checkpoint(tmp_path / "ckpt", tmp_path / "out" / "model.ckpt", tmp_path / "out" / "w.safetensors")
    finally:
        os.umask(previous)
    files = [tmp_path / "ckpt" / n for n in (store.INDEX, store.TRAINER_STATE, store.rank_file(0))]
    files += [tmp_path / "out" / "model.ckpt", tmp_path / "out" / "w.safetensors"]
    for file in files:
        assert oct(file.stat().st_mode & 0o777) == oct(0o666 & ~umask), file
    assert oct((tmp_path / "ckpt").stat().st_mode & 0o777) == oct(0o777 & ~umask)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.ckpt", "w.safetensors"]


def test_the_rank_writer_stores_and_hashes_every_dtype_the_index_allows(tmp_path):
    writer = store.RankWriter(0)
    values = {name: torch.arange(6.0).to(dtype) for name, dtype in store.DTYPES.items()}
    for name, value in values.items():
        writer.add(name, value)
    writer.write(tmp_path)
    with safe_open(str(tmp_path / writer.file), framework="pt") as f:
        assert f.metadata() == {"format": store.FORMAT}
        for part in writer.parts:
            got, want = f.get_tensor(part.key), values[part.name]
            assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), part.name
            assert writer.checksums[part.key] == store.checksum(want.view(torch.uint8).numpy()), part.name


# ---- the index's fields are validated before use --------------------------------------------

def _set(path: str, value):
    def edit(index: dict) -> None:
        *parents, last = path
        target = index
        for p in parents:
            target = target[p]
        target[last] = value
    return edit


BAD_INDEXES = [
    (_set(("tensors", W, "dtype"), "float33"), r"tensors\['model/fc1.weight'\]\['dtype'\] is 'float33', expected one of"),
    (_set(("tensors", W, "dtype"), 7), r"\['dtype'\] is 7, expected one of .*float32"),
    (_set(("tensors", W, "dtype"), "Tensor"), r"\['dtype'\] is 'Tensor'"),
    (_set(("tensors", W, "shape"), [-3, 13]), r"\['shape'\] is \[-3, 13\], expected a list of non-negative integers"),
    (_set(("tensors", W, "shape"), "3"), r"\['shape'\] is '3'"),
    (_set(("tensors", W, "shape"), [2.5]), r"\['shape'\] is \[2.5\]"),
    (_set(("tensors", W, "shape"), [True, 3]), r"\['shape'\] is \[True, 3\]"),
    (_set(("tensors", W, "parts"), [["rank_00009.safetensors", W + "@0", 0, 5]]),
     r"\['parts'\]\[0\] file is 'rank_00009.safetensors', expected one of the index's files"),
    (_set(("tensors", W, "parts"), [[R0, 12, 0, 5]]), r"\['parts'\]\[0\] key is 12, expected a string"),
    (_set(("tensors", W, "parts"), [[R0, W + "@0", 0, 10**9]]), r"\['parts'\]\[0\] range is \[0, 1000000000\]"),
    (_set(("tensors", W, "parts"), [[R0, W + "@0", 4, 4]]), r"range is \[4, 4\], expected 0 <= start < end"),
    (_set(("tensors", W, "parts"), "all of it"), r"\['parts'\] is 'all of it'"),
    (_set(("tensors", W), None), r"tensors\['model/fc1.weight'\] is None"),
    (_set(("tensors",), []), r"tensors is \[\]"),
    (_set(("files", R0, "bytes"), -1), r"files\['rank_00000.safetensors'\] is \{'bytes': -1"),
    (_set(("files",), {"../../etc/passwd": {"bytes": 1}}), r"files is \['../../etc/passwd'\], expected one file per"),
    (_set(("files", R0, "checksums", W + "@0"), "not hex"), r"\['checksums'\] is .*expected \{key: <16 hex digits>"),
    (_set(("trainer_state",), {"bytes": 3}), r"trainer_state is \{'bytes': 3\}"),
    (_set(("pickled_objects",), {"bytes": 3}), r"pickled_objects is \{'bytes': 3\}, expected .*'checksum'"),
    (_set(("pickled_objects",), [3]), r"pickled_objects is \[3\]"),
    (_set(("world_size",), 0), r"world_size is 0, expected a positive integer"),
    (_set(("world_size",), "1"), r"world_size is '1'"),
    (_set(("world_size",), 2), r"files is \['rank_00000.safetensors'\], expected one file per rank of world_size 2"),
    (_set(("shard_group_size",), 3), r"shard_group_size is 3, expected null or a positive divisor of world_size 1"),
    (_set(("shard_group_size",), "node"), r"shard_group_size is 'node'"),
    (_set(("checksum",), "md5"), r"checksum is 'md5', expected 'xxh3_64'"),
    (_set(("format",), "other/9"), r"has format 'other/9'; this version of zero_strategy reads"),
]


@pytest.mark.parametrize("edit, message", BAD_INDEXES)
def test_a_bad_index_field_is_named_with_its_value(saved, edit, message):
    _edit_index(saved, edit)
    with pytest.raises(CheckpointError, match=message):
        CheckpointReader(saved)


def test_a_file_that_does_not_match_its_index_entry_is_refused(saved):
    _edit_index(saved, _set(("tensors", W, "dtype"), "int32"))  # a valid dtype, not the one stored
    with pytest.raises(CheckpointError, match=r"holds tensor 'model/fc1.weight' .* as F32 \[\d+\], the index says I32"):
        CheckpointReader(saved).full(W)


def test_zero_consolidate_on_a_garbage_index_exits_2_with_an_error_line(saved, tmp_path, capsys):
    original = (saved / store.INDEX).read_bytes()
    _edit_index(saved, _set(("tensors", W, "shape"), [-1]))
    assert consolidate_main([str(saved), str(tmp_path / "o.ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zero-consolidate: error: ") and "['shape'] is [-1]" in err and "Traceback" not in err
    # a real process for the case that was a raw TypeError traceback: the exit status a user's shell sees
    (saved / store.INDEX).write_bytes(original)
    _edit_index(saved, _set(("tensors", W, "dtype"), "float33"))
    proc = subprocess.run([sys.executable, "-m", "zero_strategy.cli.consolidate", str(saved), str(tmp_path / "o.ckpt")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("zero-consolidate: error: ") and "['dtype'] is 'float33'" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "o.ckpt").exists()


def test_zero_consolidate_refuses_a_directory_as_output_and_a_file_as_input(saved, tmp_path, capsys):
    assert consolidate_main([str(saved), str(tmp_path)]) == 2
    assert "is a directory; give the path of a file" in capsys.readouterr().err
    (tmp_path / "model.ckpt").write_bytes(b"not a directory")
    assert consolidate_main([str(tmp_path / "model.ckpt"), str(tmp_path / "o.ckpt")]) == 2
    assert "is a file, not a sharded checkpoint directory" in capsys.readouterr().err
    assert consolidate_main([str(tmp_path / "nowhere"), str(tmp_path / "o.ckpt")]) == 2
    assert "zero-consolidate: error: checkpoint " in capsys.readouterr().err


# ---- objects a safe load refuses: beside the safe files, checked, loaded only when asked -------------


@pytest.fixture
def with_pickled(tmp_path) -> Path:
    model, opt, sharder = _build(2)
    state = {"global_step": 3, "args": argparse.Namespace(lr=0.1), "optimizer_states": [{}],
             "hyper_parameters": {"seed": 3, "data_dir": Path("/data"), "sizes": [1, 2]}}
    save_sharded(tmp_path / "ckpt", state, model, [opt], sharder, Collectives(), 2)
    return tmp_path / "ckpt"


def _open(ckpt: Path, weights_only=None) -> tuple[dict, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, state, saved = open_sharded(ckpt, Collectives(), weights_only=weights_only, opt_in="load(..., opt-in)")
    return state, [str(w.message) for w in caught if w.category is PickledObjectsWarning]


def test_objects_a_safe_load_refuses_load_only_when_asked_and_are_checked(with_pickled, tmp_path):
    state = torch.load(with_pickled / store.TRAINER_STATE, weights_only=True)  # the main file stays safe
    assert state["hyper_parameters"] == {"seed": 3, "sizes": [1, 2]} and "args" not in state
    assert state["zero_checkpoint"]["pickled_objects"] == [["args"], ["hyper_parameters", "data_dir"]]
    index = json.loads((with_pickled / store.INDEX).read_text())
    assert index["pickled_objects"] == {"bytes": (with_pickled / store.PICKLED_OBJECTS).stat().st_size,
                                        "checksum": store.checksum((with_pickled / store.PICKLED_OBJECTS).read_bytes())}
    state, warned = _open(with_pickled)
    assert "args" not in state and state["hyper_parameters"] == {"seed": 3, "sizes": [1, 2]}
    [warning] = warned
    assert "'args', 'hyper_parameters.data_dir'" in warning and "restore them too with load(..., opt-in)" in warning
    state, warned = _open(with_pickled, weights_only=False)
    assert warned == [] and state["args"] == argparse.Namespace(lr=0.1)
    assert state["hyper_parameters"] == {"seed": 3, "data_dir": Path("/data"), "sizes": [1, 2]}
    # zero-consolidate leaves them out of its safe file, and says so
    with pytest.warns(PickledObjectsWarning, match=r"'args', 'hyper_parameters.data_dir'.* left out of"):
        consolidate_checkpoint(with_pickled, tmp_path / "one.ckpt")
    assert "args" not in torch.load(tmp_path / "one.ckpt", weights_only=True)
    # damage is found before anything is unpickled; without the opt-in the file is not even read
    _flip(with_pickled / store.PICKLED_OBJECTS, (with_pickled / store.PICKLED_OBJECTS).stat().st_size // 2)
    with pytest.raises(CheckpointError, match=r"pickled_objects\.pt is damaged: its bytes do not match the checksum"):
        _open(with_pickled, weights_only=False)
    assert _open(with_pickled)[0]["global_step"] == 3
    with pytest.raises(CheckpointError, match=r"pickled_objects\.pt is damaged"):
        CheckpointReader(with_pickled).verify_all()
    (with_pickled / store.PICKLED_OBJECTS).write_bytes(b"cut")
    with pytest.raises(CheckpointError, match=r"file .*pickled_objects\.pt has 3 bytes, the index says \d+"):
        CheckpointReader(with_pickled)


def test_what_pickle_cannot_write_fails_the_save_naming_it(tmp_path):
    model, opt, sharder = _build(2)
    state = {"callbacks": {"Probe": {"hook": lambda: 0}}}
    with pytest.raises(CheckpointError, match=r"entry 'callbacks.Probe.hook' \(a function\) can be saved neither in a "
                                              r"form that loads safely .* nor by pickle"):
        save_sharded(tmp_path / "ckpt", state, model, [opt], sharder, Collectives(), 2)
    assert not (tmp_path / "ckpt").exists() and not store.partial_dir(tmp_path / "ckpt").exists()
