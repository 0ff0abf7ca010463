"""The on-disk format of a sharded checkpoint: files, index, atomic commit, and reading ranges back.

Nothing here knows about flat groups or optimizers: a checkpoint is a set of named tensors, each
stored as one or more *parts* (a contiguous range of the tensor's flattened elements) spread over
the rank files. The engine side (``sharded.py``) decides what the names are.

[Note: checkpoint layout]
A checkpoint is a directory (Lightning's ``*.ckpt`` name, as DeepSpeed's are)::

    index.json               rank 0: every tensor's full shape and dtype, and which file holds
                             which range of it; the files' sizes; the world size and stage
    trainer_state.pt         rank 0: Lightning's loops, callbacks, schedulers, loss scale,
                             hyper-parameters, and the optimizers' non-tensor state, loaded
                             with torch.load(weights_only=True): never arbitrary unpickling
    rank_00000.safetensors   what rank 0 owns: its pieces of the weights, master weights and
    rank_00001.safetensors   optimizer state, each a range of a flattened full tensor

Parts are ranges of the *parameter*, not of a flat buffer, so the files describe the model and
not the layout that wrote them: any world size and stage reads exactly the ranges it needs
(``CheckpointReader.read``), and safetensors reads them without loading the rest of the file.

[Note: atomic save]
Every rank writes into ``.<name>.partial`` beside the target; the ranks then agree (one
all-gather) that all files were written; rank 0 writes trainer_state.pt and index.json last
(the index is what makes a directory a checkpoint) and swaps the directory into place. A failure
anywhere leaves the previous checkpoint untouched and removes the partial one on every rank's
word. Replacing an existing directory takes two renames (POSIX cannot swap a non-empty directory
in one): old to ``.<name>.old``, partial to the name, then the old one is deleted. A crash between
the two renames leaves the previous checkpoint whole under ``.<name>.old``; the reader says so.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

FORMAT = "zero_strategy.sharded/1"
INDEX = "index.json"
TRAINER_STATE = "trainer_state.pt"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def partial_dir(path: Path) -> Path:
    return path.parent / f".{path.name}.partial"


def old_dir(path: Path) -> Path:
    return path.parent / f".{path.name}.old"


def is_sharded_checkpoint(path: Any) -> bool:
    """True when ``path`` is a directory written by this package (it has an index.json)."""
    return Path(path).is_dir() and (Path(path) / INDEX).is_file()


# ---- writing -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """Elements ``[start, end)`` of the flattened tensor ``name``, stored in ``file`` as ``key``."""

    name: str
    start: int
    end: int
    file: str
    key: str


class RankWriter:
    """Collects one rank's ranges of named tensors and writes them as one safetensors file."""

    def __init__(self, rank: int) -> None:
        self.file = rank_file(rank)
        self.tensors: dict[str, torch.Tensor] = {}
        self.parts: list[Part] = []

    def add(self, name: str, values: torch.Tensor, start: int = 0) -> None:
        """Store ``values`` (any shape; flattened) as elements ``start...`` of tensor ``name``."""
        if values.numel() == 0:
            return
        key = f"{name}@{start}"
        self.tensors[key] = values.detach().reshape(-1).to("cpu", copy=True).contiguous()
        self.parts.append(Part(name, start, start + values.numel(), self.file, key))

    def write(self, folder: Path) -> int:
        """Write the file (an empty one when the rank owns nothing); returns its size in bytes."""
        target = folder / self.file
        save_file(self.tensors, str(target), metadata={"format": FORMAT})
        return target.stat().st_size


def write_index(folder: Path, index: dict[str, Any]) -> None:
    _write_durably(folder / INDEX, json.dumps(index, indent=1, sort_keys=True).encode())


def write_trainer_state(folder: Path, state: dict[str, Any]) -> None:
    torch.save(state, folder / TRAINER_STATE)


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def prepare_partial(path: Path) -> Path:
    """Rank 0: an empty ``.<name>.partial`` beside ``path`` (a leftover from a crash is removed)."""
    tmp = partial_dir(path)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(path: Path) -> None:
    """Rank 0: move the finished partial directory to ``path`` (see [Note: atomic save])."""
    tmp, old = partial_dir(path), old_dir(path)
    if old.exists():
        shutil.rmtree(old)
    if path.is_file() or path.is_symlink():
        path.unlink()
    elif path.exists():
        os.rename(path, old)
    os.rename(tmp, path)
    if old.exists():
        shutil.rmtree(old)


def discard(path: Path) -> None:
    shutil.rmtree(partial_dir(path), ignore_errors=True)


# ---- reading -------------------------------------------------------------------------------


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, incomplete, corrupt, or for another model."""


class CheckpointReader:
    """Reads ranges of a sharded checkpoint's tensors, checking the files against the index first."""

    def __init__(self, path: Any) -> None:
        self.path = Path(path)
        if not self.path.exists():
            hint = ""
            if (old_dir(self.path) / INDEX).is_file():
                hint = (f" A save was interrupted while replacing it; the previous checkpoint is intact at "
                        f"{old_dir(self.path)}: rename it to {self.path.name} to use it.")
            raise FileNotFoundError(f"checkpoint {self.path} does not exist.{hint}")
        index_file = self.path / INDEX
        if not index_file.is_file():
            raise CheckpointError(f"{self.path} is not a complete sharded checkpoint: it has no {INDEX} (a save that "
                                  "did not finish, or a directory that is not a checkpoint).")
        try:
            self.index: dict[str, Any] = json.loads(index_file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{index_file} cannot be read as JSON ({err}); the checkpoint is corrupt.") from err
        if self.index.get("format") != FORMAT:
            raise CheckpointError(f"{index_file} has format {self.index.get('format')!r}; this version of "
                                  f"zero_strategy reads {FORMAT!r}.")
        for name, info in self.index["files"].items():
            file = self.path / name
            if not file.is_file():
                raise CheckpointError(f"shard file {file} is missing: the checkpoint is incomplete.")
            size = file.stat().st_size
            if size != info["bytes"]:
                raise CheckpointError(f"shard file {file} has {size} bytes, the index says {info['bytes']}: the file "
                                      "is truncated or was replaced; the checkpoint is corrupt.")
        self.tensors: dict[str, dict[str, Any]] = self.index["tensors"]
        self._open: dict[str, Any] = {}

    @property
    def world_size(self) -> int:
        return int(self.index["world_size"])

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> torch.Size:
        return torch.Size(self.tensors[name]["shape"])

    def trainer_state(self) -> dict[str, Any]:
        """Lightning's state, unpickled with ``weights_only=True`` (tensors, containers, numbers only)."""
        file = self.path / TRAINER_STATE
        if not file.is_file():
            raise CheckpointError(f"{file} is missing: the checkpoint is incomplete.")
        try:
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as err:  # torch raises UnpicklingError, RuntimeError or EOFError here
            raise CheckpointError(
                f"{file} cannot be loaded safely (torch.load with weights_only=True): {err}. If it holds objects of "
                "your own classes (in hyper-parameters or callback state) and you trust the checkpoint, allow them "
                "with torch.serialization.add_safe_globals([...]).") from err

    def _file(self, name: str):
        if name not in self._open:
            try:
                self._open[name] = safe_open(str(self.path / name), framework="pt", device="cpu")
            except (SafetensorError, OSError) as err:
                raise CheckpointError(f"shard file {self.path / name} is corrupt: {err}") from err
        return self._open[name]

    def read(self, name: str, start: int = 0, end: Optional[int] = None) -> torch.Tensor:
        """Elements ``[start, end)`` of the flattened tensor ``name``, in its stored dtype (a CPU tensor)."""
        if name not in self.tensors:
            raise CheckpointError(f"the checkpoint at {self.path} has no tensor {name!r}.")
        info = self.tensors[name]
        numel = torch.Size(info["shape"]).numel()
        end = numel if end is None else end
        out = torch.empty(end - start, dtype=getattr(torch, info["dtype"]))
        filled = 0
        for file, key, lo, hi in info["parts"]:
            a, b = max(lo, start), min(hi, end)
            if a >= b:
                continue
            try:
                values = self._file(file).get_slice(key)[a - lo : b - lo]
            except SafetensorError as err:
                raise CheckpointError(f"shard file {self.path / file} is corrupt: cannot read {key!r} ({err}).") from err
            out[a - start : b - start] = values
            filled += b - a
        if filled != end - start:
            raise CheckpointError(f"the checkpoint at {self.path} holds only {filled} of elements [{start}, {end}) of "
                                  f"{name!r}: its index is inconsistent.")
        return out

    def full(self, name: str) -> torch.Tensor:
        """The whole tensor ``name``, shaped."""
        return self.read(name).view(self.shape(name))
