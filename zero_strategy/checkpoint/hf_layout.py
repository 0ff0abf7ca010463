"""The Hugging Face directory layout, written one tensor at a time.

What ``from_pretrained`` reads: ``config.json``, the weights as ``model.safetensors`` or as
``model-0000k-of-0000n.safetensors`` shards with ``model.safetensors.index.json`` (a weight map and
``metadata.total_size``). Nothing here knows about engines or checkpoints: a plan of named tensors
with their shapes and dtypes goes in, and ``write(key, tensor)`` calls fill the files in the plan's
order.

[Note: streaming safetensors]
A safetensors file is an 8-byte little-endian header length, a JSON header naming every tensor's
dtype, shape and byte range, then the bytes. The ranges follow from the shapes and dtypes alone, so
``StreamingSafetensors`` writes the header first and each tensor's bytes as they arrive, and host
memory holds one tensor, not one shard file: with transformers' 5 GB default shards that is the
difference between one weight matrix and 5 GB per export. The file is read back by safetensors
(its header and ranges are validated there) in the tests.

[Note: an export directory swapped whole]
The export is written into ``.<name>.partial`` beside ``OUT_DIR`` and moved into place with the
checkpoint store's two renames (see [Note: atomic save] in checkpoint/store.py), so a crash leaves the previous
export or the new one, never shards of both. Files of the existing directory that an export does
not write (a tokenizer, a README) are hard-linked into the new one first (copied where links are
not possible), so they survive; another directory inside it is refused before anything is written,
since it cannot be carried over atomically.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from . import store
from .files import follow_umask, write_durably
from .format import _SAFETENSORS_CODE

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' save_pretrained default is 50GB; the Hub's guidance is 5GB

EXPORT_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                 "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
_SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
               "TIB": 2**40}
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def export_dtype(name: Union[str, torch.dtype, None]) -> Optional[torch.dtype]:
    """``"bf16"``, ``"fp16"``, ``"fp32"`` (or their torch names, or a torch dtype) as a dtype; None stays None
    (each tensor keeps the dtype of its most precise saved values)."""
    if name is None or isinstance(name, torch.dtype):
        if name not in (None, *EXPORT_DTYPES.values()):
            raise ValueError(f"dtype={name} cannot be exported; use one of torch.float32, torch.bfloat16, "
                             "torch.float16.")
        return name
    key = str(name).lower().removeprefix("torch.")
    if key not in EXPORT_DTYPES:
        raise ValueError(f"dtype {name!r} is not one the export writes; use one of bf16, fp16, fp32 (or leave it out "
                         "to keep the checkpoint's most precise values).")
    return EXPORT_DTYPES[key]


def parse_size(size: Union[int, str]) -> int:
    """``"5GB"`` (decimal units, as transformers reads them; ``"5GiB"`` binary) or a number of bytes."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"max_shard_size={size} must be a positive number of bytes, such as 5_000_000_000 or "
                             "'5GB'.")
        return size
    text = str(size).strip().upper().replace(" ", "")
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)([KMGT]I?B)?", text)
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"max_shard_size={size!r} is not a size; write a positive number with a unit, such as 5GB, "
                         f"500MB or 2GiB (units: {', '.join(u for u in _SIZE_UNITS if 'I' not in u)}, and KiB...TiB).")
    return int(float(match.group(1)) * _SIZE_UNITS.get(match.group(2) or "", 1))


def tensor_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def plan_shards(entries: Sequence[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Keys (with their sizes in bytes, in writing order) cut into shards of at most ``max_bytes``:
    a shard ends where the next tensor would not fit, and a tensor larger than the limit is a shard
    of its own (as transformers shards; the order of the keys is kept)."""
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for key, nbytes in entries:
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(key)
        size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def shard_file_names(count: int, single: str = SINGLE_FILE) -> list[str]:
    if count == 1:
        return [single]
    stem = single.removesuffix(".safetensors")
    return [f"{stem}-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


class StreamingSafetensors:
    """One safetensors file whose tensors are written one by one, in the order given (see [Note:
    streaming safetensors]). ``specs``: ``(key, shape, dtype)`` for every tensor of the file."""

    def __init__(self, path: Path, specs: Sequence[tuple[str, Sequence[int], torch.dtype]],
                 metadata: Optional[dict[str, str]] = None) -> None:
        self.path = path
        self._pending = [(key, list(shape), dtype) for key, shape, dtype in specs]
        header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        for key, shape, dtype in self._pending:
            if dtype not in _SAFETENSORS_CODE:
                raise ValueError(f"tensor {key!r} has dtype {dtype}, which safetensors cannot store.")
            end = offset + tensor_bytes(shape, dtype)
            header[key] = {"dtype": _SAFETENSORS_CODE[dtype], "shape": shape, "data_offsets": [offset, end]}
            offset = end
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the bytes start 8-aligned, as safetensors' own writer leaves them
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(text)) + text)
        self._next = 0

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """The next tensor's values (on any device; converted to the planned dtype by the caller)."""
        if self._next >= len(self._pending):
            raise RuntimeError(f"{self.path}: tensor {key!r} is one more than the file was planned for.")
        want_key, shape, dtype = self._pending[self._next]
        if key != want_key or list(tensor.shape) != shape or tensor.dtype != dtype:
            raise RuntimeError(f"{self.path}: expected {want_key!r} {dtype} {shape} next, got {key!r} {tensor.dtype} "
                               f"{list(tensor.shape)}: the export's plan and its values disagree (a bug).")
        flat = tensor.detach().reshape(-1).contiguous().cpu()
        if flat.numel():
            self._file.write(flat.view(torch.uint8).numpy().data)
        self._next += 1

    def abandon(self) -> None:
        """Close without finishing (the export failed; its directory is discarded)."""
        self._file.close()

    def close(self) -> None:
        """Flush the file to disk; raises unless every planned tensor was written."""
        try:
            if self._next != len(self._pending):
                missing = [k for k, _, _ in self._pending[self._next:]]
                raise RuntimeError(f"{self.path}: {len(missing)} planned tensors were not written ({missing[:3]}...).")
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()
        follow_umask(self.path)


def write_json(path: Path, data: Any) -> None:
    """JSON as transformers writes its index and configs (indented, sorted, a final newline)."""
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    write_durably(path, text.encode())
    follow_umask(path)


def is_export_file(name: str) -> bool:
    """Whether ``name`` (an entry of an export directory) is one an export writes, and so replaces."""
    return name in (SINGLE_FILE, INDEX_FILE, CONFIG_FILE, GENERATION_CONFIG_FILE, ADAPTER_WEIGHTS,
                    ADAPTER_CONFIG) or _SHARD_NAME.fullmatch(name) is not None


def check_export_target(out_dir: Path, adapter_dir: Optional[str]) -> None:
    """Refuse, before anything is gathered or written, a target the swap cannot handle (see [Note: an
    export directory swapped whole])."""
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"the export target {out_dir} is a file; give a directory (new or existing) to write "
                                 "the Hugging Face layout into.")
    if out_dir.is_dir():
        others = [e.name for e in out_dir.iterdir() if e.is_dir() and e.name != adapter_dir]
        if others:
            raise IsADirectoryError(f"the export target {out_dir} holds directories {others[:3]} that the export "
                                    "cannot carry over when it replaces the directory atomically; export into a new "
                                    "or an otherwise flat directory.")


def partial_dir(out_dir: Path) -> Path:
    return store.partial_dir(out_dir)


def begin_export(out_dir: Path) -> Path:
    """A fresh ``.<name>.partial`` beside ``out_dir`` to write the export into."""
    return store.prepare_partial(out_dir)


def finish_export(out_dir: Path) -> None:
    """Carry the existing directory's other files over, then swap the partial directory into place."""
    staged = store.partial_dir(out_dir)
    if out_dir.is_dir():
        for entry in out_dir.iterdir():
            if entry.is_file() and not is_export_file(entry.name) and not (staged / entry.name).exists():
                try:
                    os.link(entry, staged / entry.name)
                except OSError:  # another file system, or no hard links here
                    shutil.copy2(entry, staged / entry.name)
    store.commit(out_dir)


def abandon_export(out_dir: Path) -> None:
    store.discard(out_dir)
