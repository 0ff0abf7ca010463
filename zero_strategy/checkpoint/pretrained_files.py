"""Pretrained weights in safetensors files, read by byte range: no file is ever loaded whole.

[Note: reading pretrained slices]
A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's dtype,
shape and byte range in the data that follows) and the tensors' bytes, row-major. The elements
``[a, b)`` of a flattened tensor are therefore one contiguous byte range of the file, and a rank
reads exactly the ranges of its shards (``read_elements``): ``os.pread`` into a tensor of the
file's dtype, no memory map (whose touched pages would stay in the resident set until the file
is closed), no copy of the file. A Hugging Face model directory holds ``model.safetensors`` or
shards listed in ``model.safetensors.index.json``; the headers of all its files make one table of
names (``PretrainedFiles.entries``), read once per rank.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch

SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class PretrainedFileError(ValueError):
    """A path that holds no safetensors weights, or a file that is not a valid one."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie: ``file``, from byte ``offset``, row-major, ``shape`` of ``dtype``."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _read_header(file: Path) -> dict[str, TensorEntry]:
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise PretrainedFileError(f"{file} is not a safetensors file (shorter than its 8-byte header length).")
        (length,) = struct.unpack("<Q", raw)
        if length > _MAX_HEADER:
            raise PretrainedFileError(f"{file} is not a safetensors file (header length {length} bytes).")
        try:
            header = json.loads(f.read(length))
        except ValueError as err:
            raise PretrainedFileError(f"{file} is not a safetensors file: its header is not JSON ({err}).") from err
        size = os.fstat(f.fileno()).st_size
    entries = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        if spec["dtype"] not in DTYPES:
            raise PretrainedFileError(f"{file}: tensor {name!r} has dtype {spec['dtype']}, which this reader does "
                                      f"not know (known: {sorted(DTYPES)}).")
        begin, end = spec["data_offsets"]
        entry = TensorEntry(name, file, DTYPES[spec["dtype"]], tuple(spec["shape"]), 8 + length + begin)
        if end - begin != entry.numel * torch.empty(0, dtype=entry.dtype).element_size() or 8 + length + end > size:
            raise PretrainedFileError(f"{file}: tensor {name!r}'s byte range [{begin}, {end}) does not match its "
                                      f"shape {entry.shape} or lies past the end of the file: the file is damaged.")
        entries[name] = entry
    return entries


def weight_files(path: Union[str, os.PathLike]) -> list[Path]:
    """The safetensors files of ``path``: a .safetensors file, an index .json, or a model directory."""
    path = Path(path)
    if path.is_dir():
        if (path / INDEX_FILE).is_file():
            path = path / INDEX_FILE
        elif (path / SINGLE_FILE).is_file():
            return [path / SINGLE_FILE]
        else:
            found = sorted(p.name for p in path.iterdir())[:10]
            hint = (" It holds PyTorch pickles (.bin), which this loader does not run: convert them to safetensors "
                    "once (transformers' save_pretrained writes safetensors)." if any(n.endswith(".bin") for n in found)
                    else "")
            raise PretrainedFileError(f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE} (it holds {found}).{hint}")
    if not path.is_file():
        raise PretrainedFileError(f"{path} does not exist; give a .safetensors file, its index .json, or a Hugging "
                                  "Face model directory (a hub name must be downloaded to a directory first).")
    if path.suffix == ".json":
        with open(path) as f:
            index = json.load(f)
        if "weight_map" not in index:
            raise PretrainedFileError(f"{path} is not a safetensors index: it has no 'weight_map'.")
        return [path.parent / name for name in dict.fromkeys(index["weight_map"].values())]
    if path.suffix != ".safetensors":
        raise PretrainedFileError(f"{path} is not a .safetensors file; PyTorch pickles are not loaded (convert them "
                                  "to safetensors), and a directory must hold model.safetensors or its index.")
    return [path]


def is_pretrained_path(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` is safetensors weights: a .safetensors file, an index .json, or a directory with one."""
    path = Path(path)
    if path.is_dir():
        return (path / SINGLE_FILE).is_file() or (path / INDEX_FILE).is_file()
    return path.is_file() and (path.suffix == ".safetensors" or path.name.endswith(".safetensors.index.json"))


class PretrainedFiles:
    """The tensors of a set of safetensors files, read by element range (see [Note: reading pretrained
    slices]). Close it (or use it as a context manager) to close the files."""

    def __init__(self, path: Union[str, os.PathLike]) -> None:
        self.path = Path(path)
        self.files = weight_files(path)
        self.entries: dict[str, TensorEntry] = {}
        for file in self.files:
            for name, entry in _read_header(file).items():
                if name in self.entries:
                    raise PretrainedFileError(f"tensor {name!r} is in both {self.entries[name].file} and {file}.")
                self.entries[name] = entry
        self._fds: dict[Path, int] = {}
        self.bytes_read = 0

    def read_elements(self, name: str, start: int = 0, end: Optional[int] = None,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Elements ``[start, end)`` of tensor ``name`` flattened, in the file's dtype; read into ``out``
        (a contiguous CPU tensor of that dtype and size) when given."""
        entry = self.entries[name]
        end = entry.numel if end is None else end
        if not 0 <= start <= end <= entry.numel:
            raise IndexError(f"elements [{start}, {end}) lie outside {name!r}, which has {entry.numel}.")
        if out is None:
            out = torch.empty(end - start, dtype=entry.dtype)
        size = out.element_size()
        view = out.view(torch.uint8).numpy() if out.numel() else None
        fd = self._fds.get(entry.file)
        if fd is None:
            fd = self._fds[entry.file] = os.open(entry.file, os.O_RDONLY)
        done, want, at = 0, (end - start) * size, entry.offset + start * size
        while done < want:
            n = os.preadv(fd, [memoryview(view)[done:]], at + done)
            if n <= 0:
                raise PretrainedFileError(f"{entry.file} ended inside tensor {name!r}: the file is damaged.")
            done += n
        self.bytes_read += want
        return out

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` whole, shaped, in the file's dtype."""
        return self.read_elements(name).view(self.entries[name].shape)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "PretrainedFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
