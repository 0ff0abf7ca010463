"""The on-disk format of a sharded checkpoint: files, index, atomic commit, and reading ranges back.

Nothing here knows about flat groups or optimizers: a checkpoint is a set of named tensors, each
stored as one or more *parts* (a contiguous range of the tensor's flattened elements) spread over
the rank files. The engine side (``sharded.py``) decides what the names are.

[Note: checkpoint layout]
A checkpoint is a directory (Lightning's ``*.ckpt`` name, as DeepSpeed's are)::

    index.json               rank 0: every tensor's full shape and dtype, and which file holds
                             which range of it; the files' sizes and checksums; the world size
                             and stage
    trainer_state.pt         rank 0: Lightning's loops, callbacks, schedulers, loss scale,
                             hyper-parameters, and the optimizers' non-tensor state, loaded
                             with torch.load(weights_only=True): never arbitrary unpickling
    rank_00000.safetensors   what rank 0 owns: its pieces of the weights, master weights and
    rank_00001.safetensors   optimizer state, each a range of a flattened full tensor

Parts are ranges of the *parameter*, not of a flat buffer, so the files describe the model and
not the layout that wrote them: any world size and stage reads exactly the ranges it needs
(``CheckpointReader.read``), and safetensors reads them without loading the rest of the file.

[Note: checksums]
Each rank hashes every part (safetensors key) of its file as it writes it, and rank 0 the bytes
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
import xxhash
from safetensors import SafetensorError, safe_open

FORMAT = "zero_strategy.sharded/1"  # checksums were added without a new format: older readers ignore them
INDEX = "index.json"
TRAINER_STATE = "trainer_state.pt"

# Why xxh3_64 (the xxhash package, a dependency) and not the standard library: measured on this
# 2-core machine (a 64 MiB buffer, best of 5), zlib.crc32 costs 0.25-0.49 s/GiB, adler32 0.30,
# sha1 0.56, sha256 0.60-1.06, blake2b 1.1-1.7 and md5 1.4-1.8, while writing the bytes into the
# page cache costs 0.42: the fastest of them would cost about as much as the write itself, on
# every save and again on every load. xxh3_64 costs 0.03-0.04 s/GiB (25 GiB/s; write_safetensors
# took 73 ms for 240 MB with it, 66 ms without), so it is computed inline as each tensor is
# written, with no threads, far inside the 10% budget. 64 bits make a missed random damage (1 in
# 2**64 per part) negligible; it guards against accidents (disk, copy, truncation), not against
# someone who can also rewrite the index.
CHECKSUM = "xxh3_64"


def checksum(data: Any) -> str:
    """The checksum of a bytes-like object, as 16 hex digits (JSON keeps a string exactly)."""
    return xxhash.xxh3_64_hexdigest(data)


# torch dtype <-> safetensors' dtype code: the dtypes a checkpoint can hold
_SAFETENSORS_CODE = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.bool: "BOOL", torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
}
DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in _SAFETENSORS_CODE}  # the index's dtype names


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def partial_dir(path: Path) -> Path:
    return path.parent / f".{path.name}.partial"


def old_dir(path: Path) -> Path:
    return path.parent / f".{path.name}.old"


def is_partial(path: Path) -> bool:
    """Whether ``path`` is named as the directory a save writes into before it is moved into place."""
    return path.name.startswith(".") and path.name.endswith(".partial")


def is_sharded_checkpoint(path: Any) -> bool:
    """True when ``path`` is a finished checkpoint directory written by this package.

    A ``.<name>.partial`` directory (a save that did not finish) is not one, nor is a directory whose
    index.json is cut off or not valid JSON: this is a question, so it answers False rather than
    raise, and a caller that scans for checkpoints skips a damaged one. ``CheckpointReader`` on such
    a directory raises a ``CheckpointError`` that says what is wrong.
    """
    path = Path(path)
    if is_partial(path) or not path.is_dir():
        return False
    try:
        index = json.loads((path / INDEX).read_bytes())
    except (OSError, ValueError):  # missing, unreadable, cut off, not JSON, not UTF-8
        return False
    return isinstance(index, dict) and index.get("format") == FORMAT


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, incomplete, corrupt, or for another model."""


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint without checksums (written by an earlier version) is loaded unverified."""


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


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: Optional[dict[str, str]] = None,
                      with_checksums: bool = True) -> dict[str, str]:
    """Write contiguous CPU ``tensors`` as a safetensors file, hashing each one's bytes as it goes out
    (one pass over memory that is about to be written anyway); returns ``{key: checksum}``.

    Written here rather than with ``safetensors.torch.save_file``, which creates its file as a
    temporary of mode 0600 whatever the umask: a plain ``open()`` follows the umask.
    """
    # Largest elements first, so every tensor starts at a multiple of its element size (the header
    # is padded to 8 bytes): readers that map the file can use the bytes in place.
    order = sorted(tensors, key=lambda key: (-tensors[key].element_size(), key))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key in order:
        tensor = tensors[key]
        if tensor.dtype not in _SAFETENSORS_CODE:
            raise CheckpointError(f"tensor {key!r} has dtype {tensor.dtype}, which safetensors cannot store; the "
                                  f"dtypes it can are {sorted(DTYPES)}. Convert it before saving.")
        size = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": _SAFETENSORS_CODE[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    sums: dict[str, str] = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for key in order:
            data = _bytes_of(tensors[key])
            f.write(data)
            if with_checksums:
                sums[key] = checksum(data)
    return sums


class RankWriter:
    """Collects one rank's ranges of named tensors and writes them as one safetensors file."""

    def __init__(self, rank: int, with_checksums: bool = True) -> None:
        self.file = rank_file(rank)
        self.with_checksums = with_checksums
        self.tensors: dict[str, torch.Tensor] = {}
        self.parts: list[Part] = []
        self.checksums: dict[str, str] = {}  # key -> checksum, filled by write()

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
        self.checksums = write_safetensors(target, self.tensors, {"format": FORMAT}, self.with_checksums)
        return target.stat().st_size


def write_index(folder: Path, index: dict[str, Any]) -> None:
    _write_durably(folder / INDEX, json.dumps(index, indent=1, sort_keys=True).encode())


def write_trainer_state(folder: Path, state: dict[str, Any]) -> dict[str, Any]:
    """Write Lightning's state; returns its index entry (bytes and checksum)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    _write_durably(folder / TRAINER_STATE, data)
    return {"bytes": len(data), "checksum": checksum(data)}


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


# ---- validating the index ------------------------------------------------------------------


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0  # bool is an int to isinstance, and no count


def _is_checksum(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 16 and all(c in "0123456789abcdef" for c in value)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def validate_index(index: Any, where: Path) -> None:
    """Raise a ``CheckpointError`` naming the field and its value unless every field the reader uses
    is well formed: format, world_size, files (names, byte sizes, checksums), trainer_state, and each
    tensor's shape, dtype and parts (a known file, a string key, a range inside the tensor)."""

    def bad(field: str, value: Any, expected: str) -> CheckpointError:
        return CheckpointError(f"{where}: {field} is {_shown(value)}, expected {expected}. The index is damaged or "
                               "was not written by zero_strategy; load an earlier checkpoint.")

    if not isinstance(index, dict):
        raise bad("the index", index, "a JSON object")
    if index.get("format") != FORMAT:
        raise CheckpointError(f"{where} has format {_shown(index.get('format'))}; this version of zero_strategy "
                              f"reads {FORMAT!r}.")
    world_size = index.get("world_size")
    if not _is_count(world_size) or world_size < 1:
        raise bad("world_size", world_size, "a positive integer")
    algorithm = index.get("checksum")
    if algorithm not in (None, CHECKSUM):
        raise bad("checksum", algorithm, f"{CHECKSUM!r} (or no such field, in a checkpoint of an earlier version)")
    files = index.get("files")
    if (not isinstance(files, dict) or len(files) != world_size
            or any(rank_file(r) not in files for r in range(world_size))):
        raise bad("files", sorted(files) if isinstance(files, dict) else files,
                  f"one file per rank of world_size {world_size}: {rank_file(0)} ... {rank_file(world_size - 1)}")
    for name, entry in files.items():
        if not isinstance(entry, dict) or not _is_count(entry.get("bytes")):
            raise bad(f"files[{name!r}]", entry, "{'bytes': <a non-negative integer>, ...}")
        sums = entry.get("checksums")
        if algorithm and (not isinstance(sums, dict) or not all(_is_checksum(v) for v in sums.values())):
            raise bad(f"files[{name!r}]['checksums']", sums, "{key: <16 hex digits>, ...}")
    trainer = index.get("trainer_state")
    if algorithm and (not isinstance(trainer, dict) or not _is_count(trainer.get("bytes"))
                      or not _is_checksum(trainer.get("checksum"))):
        raise bad("trainer_state", trainer, "{'bytes': <a non-negative integer>, 'checksum': <16 hex digits>}")
    tensors = index.get("tensors")
    if not isinstance(tensors, dict):
        raise bad("tensors", tensors, "a JSON object of tensor name -> shape, dtype, parts")
    for name, info in tensors.items():
        field = f"tensors[{name!r}]"
        if not isinstance(info, dict):
            raise bad(field, info, "{'shape': [...], 'dtype': ..., 'parts': [...]}")
        shape = info.get("shape")
        if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
            raise bad(f"{field}['shape']", shape, "a list of non-negative integers")
        if not isinstance(info.get("dtype"), str) or info["dtype"] not in DTYPES:
            raise bad(f"{field}['dtype']", info.get("dtype"), f"one of {', '.join(sorted(DTYPES))}")
        numel = torch.Size(shape).numel()
        parts = info.get("parts")
        if not isinstance(parts, list):
            raise bad(f"{field}['parts']", parts, "a list of [file, key, start, end]")
        for i, part in enumerate(parts):
            where_part = f"{field}['parts'][{i}]"
            if not isinstance(part, list) or len(part) != 4:
                raise bad(where_part, part, "[file, key, start, end]")
            file, key, start, end = part
            if file not in files:
                raise bad(f"{where_part} file", file, f"one of the index's files ({rank_file(0)} ...)")
            if not isinstance(key, str):
                raise bad(f"{where_part} key", key, "a string")
            if not (_is_count(start) and _is_count(end) and start < end <= numel):
                raise bad(f"{where_part} range", [start, end], f"0 <= start < end <= {numel} (the tensor's elements)")
            if algorithm and key not in files[file]["checksums"]:
                raise bad(f"files[{file!r}]['checksums'][{key!r}]", None, "the checksum of that part")


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
        if "trainer_state" in self.index:
            sized[TRAINER_STATE] = self.index["trainer_state"]
        for name, info in sized.items():
            file = self.path / name
            kind = "file" if name == TRAINER_STATE else "shard file"
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

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> torch.Size:
        return torch.Size(self.tensors[name]["shape"])

    @property
    def _checking(self) -> bool:
        return self.verify and self.has_checksums

    def _trainer_state_bytes(self) -> bytes:
        file = self.path / TRAINER_STATE
        if not file.is_file():
            raise CheckpointError(f"{file} is missing: the checkpoint is incomplete.")
        data = file.read_bytes()
        if self._checking and checksum(data) != self.index["trainer_state"]["checksum"]:
            raise CheckpointError(f"{file} is damaged: its bytes do not match the checksum the save recorded. "
                                  f"{_DAMAGED}")
        return data

    def trainer_state(self) -> dict[str, Any]:
        """Lightning's state, unpickled with ``weights_only=True`` (tensors, containers, numbers only)."""
        data = self._trainer_state_bytes()
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as err:  # torch raises UnpicklingError, RuntimeError or EOFError here
            raise CheckpointError(
                f"{self.path / TRAINER_STATE} cannot be loaded safely (torch.load with weights_only=True): {err}. If "
                "it holds objects of your own classes (in hyper-parameters or callback state) and you trust the "
                "checkpoint, allow them with torch.serialization.add_safe_globals([...]).") from err

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
        self._trainer_state_bytes()
        for name, info in self.tensors.items():
            for part in info["parts"]:
                if (part[0], part[1]) not in self._verified:
                    self._read_part(name, part, part[2], part[2])


_DAMAGED = ("The file was changed after the save wrote it (a disk, copy or transfer error); resume from an earlier "
            "checkpoint. To load it anyway, damage included, pass verify=False (zero-consolidate --no-verify).")
