"""Names, dtypes and checksums of the sharded checkpoint format (see [Note: checkpoint layout] and
[Note: checksums] in checkpoint/store.py), shared by the writer, the reader and the index's validation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import xxhash

FORMAT = "zero_strategy.sharded/1"  # checksums were added without a new format: older readers ignore them
INDEX = "index.json"
TRAINER_STATE = "trainer_state.pt"
PICKLED_OBJECTS = "pickled_objects.pt"  # see [Note: pickled objects] in checkpoint/pickled.py

# Why xxh3_64 (the xxhash package, a dependency) and not the standard library: measured on this
# 2-core machine (a 64 MiB buffer, best of 5), zlib.crc32 costs 0.25-0.49 s/GiB, adler32 0.30,
# sha1 0.56, sha256 0.60-1.06, blake2b 1.1-1.7 and md5 1.4-1.8, while writing the bytes into the
# page cache costs 0.42: the fastest of them would cost about as much as the write itself, on
# every save and again on every load. xxh3_64 costs 0.03-0.04 s/GiB (25 GiB/s), so hashing the
# tensors in memory, one after the other with no threads, is a small fraction of writing them.
# 64 bits make a missed random damage (1 in 2**64 per part) negligible; it guards against
# accidents (disk, copy, truncation), not against someone who can also rewrite the index.
CHECKSUM = "xxh3_64"


def checksum(data: Any) -> str:
    """The checksum of a bytes-like object, as 16 hex digits (JSON keeps a string exactly)."""
    return xxhash.xxh3_64_hexdigest(data)


def checksummer() -> Any:
    """A running ``checksum``: ``update(bytes)`` piece by piece, then ``hexdigest()`` equals
    ``checksum`` of the pieces joined."""
    return xxhash.xxh3_64()


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


class PickledObjectsWarning(UserWarning):
    """A checkpoint's objects that only full unpickling loads were not restored (see [Note: pickled
    objects] in checkpoint/pickled.py): the load was not given ``weights_only=False``."""
