"""The index of a sharded checkpoint, validated field by field before anything reads it.

See [Note: checkpoint layout] in checkpoint/store.py for what the fields mean.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .format import CHECKSUM, DTYPES, FORMAT, CheckpointError, rank_file


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0  # bool is an int to isinstance, and no count


def _is_checksum(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 16 and all(c in "0123456789abcdef" for c in value)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def validate_index(index: Any, where: Path) -> None:
    """Raise a ``CheckpointError`` naming the field and its value unless every field the reader uses
    is well formed: format, world_size, shard_group_size, files (names, byte sizes, checksums),
    trainer_state, pickled_objects, and each tensor's shape, dtype and parts (a known file, a string key, a range
    inside the tensor)."""

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
    shard_group_size = index.get("shard_group_size")  # hybrid sharding's K; absent before it existed
    if shard_group_size is not None and (not _is_count(shard_group_size) or shard_group_size < 1
                                         or world_size % shard_group_size):
        raise bad("shard_group_size", shard_group_size, f"null or a positive divisor of world_size {world_size}")
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
    pickled = index.get("pickled_objects")  # present when the state held such objects: see checkpoint/pickled.py
    if pickled is not None and (not isinstance(pickled, dict) or not _is_count(pickled.get("bytes"))
                                or (algorithm and not _is_checksum(pickled.get("checksum")))):
        raise bad("pickled_objects", pickled, "{'bytes': <a non-negative integer>, 'checksum': <16 hex digits>}")
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
