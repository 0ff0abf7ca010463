"""The on-disk format of a sharded checkpoint: files, index, atomic commit, and reading ranges back.

Nothing here knows about flat groups or optimizers: a checkpoint is a set of named tensors, each
stored as one or more *parts* (a contiguous range of the tensor's flattened elements) spread over
the rank files. The engine side (``sharded.py``) decides what the names are.

[Note: checkpoint layout]
A checkpoint is a directory (Lightning's ``*.ckpt`` name, as DeepSpeed's are)::

    index.json               rank 0: every tensor's full shape and dtype, and which file holds
                             which range of it; the files' sizes and checksums; the world size,
                             stage and shard group size (hybrid sharding: only the first shard
                             group writes pieces, the other ranks' files are empty)
    trainer_state.pt         rank 0: Lightning's loops, callbacks, schedulers, loss scale,
                             hyper-parameters, and the optimizers' non-tensor state, loaded
                             with torch.load(weights_only=True): never arbitrary unpickling
    pickled_objects.pt       rank 0, only when the state holds objects such a load refuses:
                             those, loaded only with weights_only=False (see [Note: pickled
                             objects] in checkpoint/pickled.py)
    rank_00000.safetensors   what rank 0 owns: its pieces of the weights, master weights and
    rank_00001.safetensors   optimizer state, each a range of a flattened full tensor

Parts are ranges of the *parameter*, not of a flat buffer, so the files describe the model and
not the layout that wrote them: any world size and stage reads exactly the ranges it needs
(``CheckpointReader.read``), and safetensors reads them without loading the rest of the file.

[Note: checksums]
Each rank hashes every part (safetensors key) of its file as it copies the part out of the
engine's buffers, a few megabytes at a time, so the hash reads each chunk from the cache the copy
has just written it into instead of making a second pass over memory. A thread hashing beside
safetensors' write cost more with 2 ranks on 2 cores, where no core is free for it (figures in
benchmarks/RESULTS.md, "Checksummed checkpoints"). Rank 0 hashes the bytes
of trainer_state.pt; the index records them (``files[f]["checksums"][key]``,
``trainer_state["checksum"]``). A part is the grain because it is what a reader reads anyway: a
rank that loads at another world size reads whole parts, never whole files, so it checks exactly
what it uses, each part once per reader. ``verify_all`` checks the rest (zero-consolidate does,
before it writes anything). Damage is reported as a ``CheckpointError`` naming the file and the
tensor, never loaded. An index without checksums (from an earlier version, format unchanged)
loads with one ``UnverifiedCheckpointWarning``; ``verify=False`` skips the checks on purpose.
Every field of the index is validated before it is used (``validate_index``).

[Note: atomic save]
Every rank writes into ``.<name>.partial`` beside the target; the ranks then agree (one
all-gather) that all files were written; rank 0 writes trainer_state.pt and index.json last
(the index is what makes a directory a checkpoint) and swaps the directory into place. A failure
anywhere leaves the previous checkpoint untouched and removes the partial one on every rank's
word. Replacing an existing directory takes two renames (POSIX cannot swap a non-empty directory
in one): old to ``.<name>.old``, partial to the name, then the old one is deleted. A crash between
the two renames leaves the previous checkpoint whole under ``.<name>.old``; the reader says so.
A ``.<name>.partial`` directory is never a checkpoint, even with an index in it. Every file is
created with a plain ``open()``, so its mode follows the umask (0o666 & ~umask) as the user's
other files do, which a shared cluster file system needs.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError, safe_open

from .files import write_durably
from .format import (_SAFETENSORS_CODE, CHECKSUM, DTYPES, FORMAT, INDEX, PICKLED_OBJECTS, TRAINER_STATE,
                     CheckpointError, UnverifiedCheckpointWarning, checksum, checksummer, is_partial,
                     is_sharded_checkpoint, old_dir, partial_dir, rank_file)
from .index import validate_index

__all__ = ["CHECKSUM", "CheckpointError", "CheckpointReader", "DTYPES", "FORMAT", "INDEX", "PICKLED_OBJECTS", "Part",
           "RankWriter", "TRAINER_STATE", "UnverifiedCheckpointWarning", "commit", "discard", "is_partial",
           "is_sharded_checkpoint", "old_dir", "partial_dir", "prepare_partial", "rank_file", "write_index",
           "write_trainer_state"]


# ---- writing -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """Elements ``[start, end)`` of the flattened tensor ``name``, stored in ``file`` as ``key``."""

    name: str
    start: int
    end: int
    file: str
    key: str


def _bytes_of(tensor: torch.Tensor) -> Any:
    """A contiguous CPU tensor's bytes, without a copy (a uint8 numpy view works for every dtype)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


# Bytes copied (and hashed) at a time by RankWriter.add: small enough that the hash reads the chunk
# from the cache the copy just wrote it into, large enough that the Python loop costs nothing
# (576 MiB alone on this machine: the copy 0.048 s; copy and hash in chunks of 64 KiB 0.146 s, 256 KiB
# 0.083, 1 MiB 0.068, 4 MiB 0.063; the hash after the whole copy 0.071).
_HASH_CHUNK_BYTES = 4 << 20


def _host_copy(values: torch.Tensor, hasher: Any = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A flat contiguous CPU copy of ``values``, fed to ``hasher`` (a ``checksummer()``) a chunk at a
    time right after the chunk is copied, so the hash makes no second pass over memory (see [Note:
    checksums]). ``out``: a host tensor of the same size and dtype to copy into, else a new one."""
    flat = values.detach().reshape(-1)
    source: Optional[torch.Tensor] = flat
    if flat.device.type != "cpu":  # from a device: one copy, then hashed
        out = flat.to("cpu") if out is None else out.copy_(flat)
        source = None
    elif out is None:
        out = torch.empty_like(flat)
    if hasher is None:
        if source is not None:
            out.copy_(source)
        return out
    step = max(1, _HASH_CHUNK_BYTES // out.element_size())
    for a in range(0, out.numel(), step):
        chunk = out[a:a + step]
        if source is not None:
            chunk.copy_(source[a:a + step])
        hasher.update(_bytes_of(chunk))
    return out


class RankWriter:
    """Collects one rank's ranges of named tensors and writes them as one safetensors file."""

    def __init__(self, rank: int, with_checksums: bool = True,
                 buffers: Optional[dict[str, torch.Tensor]] = None) -> None:
        self.file = rank_file(rank)
        self.with_checksums = with_checksums
        self.buffers = buffers  # key -> host tensor kept from the last save, reused when it fits
        self.tensors: dict[str, torch.Tensor] = {}
        self.parts: list[Part] = []
        self.checksums: dict[str, str] = {}  # key -> checksum of the part's bytes

    def add(self, name: str, values: torch.Tensor, start: int = 0) -> None:
        """Store a copy of ``values`` (any shape; flattened) as elements ``start...`` of tensor
        ``name``, hashing it as it is copied (see [Note: checksums])."""
        if values.numel() == 0:
            return
        key = f"{name}@{start}"
        hasher = checksummer() if self.with_checksums else None
        self.tensors[key] = _host_copy(values, hasher, self._buffer(key, values))
        if hasher is not None:
            self.checksums[key] = hasher.hexdigest()
        self.parts.append(Part(name, start, start + values.numel(), self.file, key))

    def _buffer(self, key: str, values: torch.Tensor) -> Optional[torch.Tensor]:
        if self.buffers is None:
            return None
        kept = self.buffers.get(key)
        if kept is None or kept.numel() != values.numel() or kept.dtype != values.dtype:
            pin = values.device.type == "cuda"  # copies from the device go at full speed into pinned pages
            kept = self.buffers[key] = torch.empty(values.numel(), dtype=values.dtype, pin_memory=pin)
        return kept

    def write(self, folder: Path) -> int:
        """Write the file (an empty one when the rank owns nothing); returns its size in bytes."""
        target = folder / self.file
        write_safetensors(target, self.tensors, {"format": FORMAT})
        return target.stat().st_size


def write_safetensors(target: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """``tensors`` (contiguous CPU tensors) as a safetensors file, written straight from their memory.

    safetensors' own ``save_file`` first copies every tensor into a Python ``bytes`` object: a second
    copy of the rank's share of the checkpoint in memory, and CPU time under the GIL that a training
    thread beside a background save would wait for. The format is a little-endian u64 header length,
    the JSON header (each tensor's dtype, shape and byte range; padded with spaces to 8 bytes), then
    the tensors' bytes in that order; ``safe_open`` reads it as any other. The file is created with a
    plain ``open()``, so its mode follows the umask."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": _SAFETENSORS_CODE[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(target, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for t in tensors.values():
            if t.numel():
                f.write(_bytes_of(t))  # a view of the tensor's memory: no copy, the GIL released while it writes


def write_index(folder: Path, index: dict[str, Any]) -> None:
    write_durably(folder / INDEX, json.dumps(index, indent=1, sort_keys=True).encode())


def write_trainer_state(folder: Path, state: dict[str, Any]) -> dict[str, Any]:
    """Write Lightning's state; returns its index entry (bytes and checksum)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    write_durably(folder / TRAINER_STATE, data)
    return {"bytes": len(data), "checksum": checksum(data)}


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


class CheckpointReader:
    """Reads ranges of a sharded checkpoint's tensors, checking the files against the index first
    and each part against its checksum the first time it is read (see [Note: checksums]).

    ``verify=False`` skips the checksums (for a huge checkpoint you trust: the bytes are then
    loaded whatever they hold); the index, the files' sizes and the parts' dtypes and shapes are
    checked either way.
    """

    def __init__(self, path: Any, verify: bool = True) -> None:
        self.path = Path(path)
        self.verify = verify
        if is_partial(self.path):
            raise CheckpointError(
                f"{self.path} is an unfinished save: a '.NAME.partial' directory is where a save writes before it "
                "moves the result into place, so it was interrupted (or is still running). Load the finished "
                f"checkpoint {self.path.parent / self.path.name[1:].removesuffix('.partial')} or an earlier one.")
        if not self.path.exists():
            hint = ""
            if (old_dir(self.path) / INDEX).is_file():
                hint = (f" A save was interrupted while replacing it; the previous checkpoint is intact at "
                        f"{old_dir(self.path)}: rename it to {self.path.name} to use it.")
            raise FileNotFoundError(f"checkpoint {self.path} does not exist.{hint}")
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path} is a file, not a sharded checkpoint directory: a regular checkpoint "
                                  "loads with torch.load or Trainer(ckpt_path=...), and needs no consolidation.")
        index_file = self.path / INDEX
        if not index_file.is_file():
            raise CheckpointError(f"{self.path} is not a complete sharded checkpoint: it has no {INDEX} (a save that "
                                  "did not finish, or a directory that is not a checkpoint).")
        try:
            self.index: dict[str, Any] = json.loads(index_file.read_bytes())
        except (OSError, ValueError) as err:  # ValueError: cut off, not JSON, not UTF-8
            raise CheckpointError(f"{index_file} is cut off or is not valid JSON ({err}): the checkpoint is damaged "
                                  "(a disk or copy error); load an earlier checkpoint.") from err
        validate_index(self.index, index_file)
        sized = dict(self.index["files"])
        for name, entry in _SIDE_FILES.items():
            if entry in self.index:
                sized[name] = self.index[entry]
        for name, info in sized.items():
            file = self.path / name
            kind = "file" if name in _SIDE_FILES else "shard file"
            if not file.is_file():
                raise CheckpointError(f"{kind} {file} is missing: the checkpoint is incomplete.")
            size = file.stat().st_size
            if size != info["bytes"]:
                raise CheckpointError(f"{kind} {file} has {size} bytes, the index says {info['bytes']}: the file "
                                      "is truncated or was replaced; the checkpoint is corrupt.")
        self.has_checksums = "checksum" in self.index
        if verify and not self.has_checksums:
            warnings.warn(f"the checkpoint {self.path} has no checksums (it was written by an earlier version of "
                          "zero_strategy), so its files are not verified: damaged bytes would load silently. Save "
                          "it again to add them.", UnverifiedCheckpointWarning, stacklevel=2)
        self.tensors: dict[str, dict[str, Any]] = self.index["tensors"]
        self._open: dict[str, Any] = {}
        self._verified: set[tuple[str, str]] = set()  # (file, key) of the parts checked so far

    @property
    def world_size(self) -> int:
        return int(self.index["world_size"])

    @property
    def shard_group_size(self) -> Optional[int]:
        """Hybrid sharding's K in the run that wrote it (None: sharded over all its ranks)."""
        return self.index.get("shard_group_size")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> torch.Size:
        return torch.Size(self.tensors[name]["shape"])

    @property
    def _checking(self) -> bool:
        return self.verify and self.has_checksums

    def checked_bytes(self, name: str = TRAINER_STATE) -> bytes:
        """The bytes of rank 0's file ``name`` (trainer_state.pt, pickled_objects.pt), checked against the
        checksum the index records for it."""
        file = self.path / name
        if not file.is_file() or (name != TRAINER_STATE and _SIDE_FILES[name] not in self.index):
            raise CheckpointError(f"{file} is missing: the checkpoint is incomplete.")
        data = file.read_bytes()
        if self._checking and checksum(data) != self.index[_SIDE_FILES[name]]["checksum"]:
            raise CheckpointError(f"{file} is damaged: its bytes do not match the checksum the save recorded. "
                                  f"{_DAMAGED}")
        return data

    def trainer_state(self, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Lightning's state, unpickled with ``weights_only=True`` (tensors, containers, numbers only)
        unless ``weights_only=False`` is passed for a checkpoint you trust (one whose hyper-parameters hold
        a module, say), as ``torch.load`` and Lightning's own loading take it."""
        data = self.checked_bytes()
        safe = True if weights_only is None else weights_only
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=safe)
        except Exception as err:  # torch raises UnpicklingError, RuntimeError or EOFError here
            if not safe:
                raise CheckpointError(f"{self.path / TRAINER_STATE} cannot be unpickled: {err}") from err
            raise CheckpointError(
                f"{self.path / TRAINER_STATE} cannot be loaded safely (torch.load with weights_only=True): {err}. If "
                "it holds objects of your own classes (in hyper-parameters, such as a network passed to __init__, or "
                "in callback state) and you trust the checkpoint, pass weights_only=False (trainer.fit(..., "
                "ckpt_path=..., weights_only=False), fabric.load(..., weights_only=False)), or allow the classes with "
                "torch.serialization.add_safe_globals([...]).") from err

    def close(self) -> None:
        """Unmap the rank files (they reopen on the next read). safetensors reads them through a memory
        map, and the pages read stay in this process's resident set while it is open: a reader that goes
        through a whole checkpoint (``zero-consolidate --hf``) closes after each tensor, or its resident
        set grows to the checkpoint's size."""
        self._open.clear()

    def _file(self, name: str):
        if name not in self._open:
            try:
                self._open[name] = safe_open(str(self.path / name), framework="pt", device="cpu")
            except (SafetensorError, OSError) as err:
                raise CheckpointError(f"shard file {self.path / name} is corrupt: {err}") from err
        return self._open[name]

    def _read_part(self, name: str, part: list, a: int, b: int) -> torch.Tensor:
        """Elements ``[a, b)`` of tensor ``name`` from ``part`` (``[file, key, lo, hi]``, holding
        ``[lo, hi)``): the whole part is read and checked against its checksum the first time."""
        file, key, lo, hi = part
        dtype = DTYPES[self.tensors[name]["dtype"]]
        check = self._checking and (file, key) not in self._verified
        try:
            stored = self._file(file).get_slice(key)
            shape, code = stored.get_shape(), stored.get_dtype()
            if shape != [hi - lo] or code != _SAFETENSORS_CODE[dtype]:
                raise CheckpointError(
                    f"shard file {self.path / file} holds tensor {name!r} (key {key!r}) as {code} {shape}, the index "
                    f"says {_SAFETENSORS_CODE[dtype]} [{hi - lo}]: the file does not belong to this index. {_DAMAGED}")
            values = stored[:] if check else stored[a - lo : b - lo]
        except SafetensorError as err:
            raise CheckpointError(f"shard file {self.path / file} is corrupt: cannot read {key!r} ({err}).") from err
        if check:
            if checksum(_bytes_of(values)) != self.index["files"][file]["checksums"][key]:
                raise CheckpointError(
                    f"shard file {self.path / file} is damaged: tensor {name!r} (elements [{lo}, {hi}), key {key!r}) "
                    f"does not match the checksum the save recorded. {_DAMAGED}")
            self._verified.add((file, key))
            values = values[a - lo : b - lo]
        return values

    def read(self, name: str, start: int = 0, end: Optional[int] = None) -> torch.Tensor:
        """Elements ``[start, end)`` of the flattened tensor ``name``, in its stored dtype (a CPU tensor)."""
        if name not in self.tensors:
            raise CheckpointError(f"the checkpoint at {self.path} has no tensor {name!r}.")
        info = self.tensors[name]
        numel = torch.Size(info["shape"]).numel()
        end = numel if end is None else end
        if not 0 <= start <= end <= numel:
            raise CheckpointError(f"elements [{start}, {end}) are outside tensor {name!r} of {numel} elements in the "
                                  f"checkpoint at {self.path}: it is for a different model.")
        out = torch.empty(end - start, dtype=DTYPES[info["dtype"]])
        filled = 0
        for part in info["parts"]:
            a, b = max(part[2], start), min(part[3], end)
            if a >= b:
                continue
            out[a - start : b - start] = self._read_part(name, part, a, b)
            filled += b - a
        if filled != end - start:
            raise CheckpointError(f"the checkpoint at {self.path} holds only {filled} of elements [{start}, {end}) of "
                                  f"{name!r}: its index is inconsistent.")
        return out

    def full(self, name: str) -> torch.Tensor:
        """The whole tensor ``name``, shaped."""
        return self.read(name).view(self.shape(name))

    def verify_all(self) -> None:
        """Check every part not read yet, and the trainer state, against their checksums (a no-op with
        ``verify=False`` or without checksums): what zero-consolidate does before writing anything."""
        if not self._checking:
            return
        for name, entry in _SIDE_FILES.items():
            if entry in self.index:
                self.checked_bytes(name)
        for name, info in self.tensors.items():
            for part in info["parts"]:
                if (part[0], part[1]) not in self._verified:
                    self._read_part(name, part, part[2], part[2])


_SIDE_FILES = {TRAINER_STATE: "trainer_state", PICKLED_OBJECTS: "pickled_objects"}  # rank 0's files: index entry
_DAMAGED = ("The file was changed after the save wrote it (a disk, copy or transfer error); resume from an earlier "
            "checkpoint. To load it anyway, damage included, pass verify=False (zero-consolidate --no-verify).")
