"""Byte-level language-model data from text files: a file, a folder, or the Python standard
library's own source (present on every machine, so the default run needs no download).

Tokens are bytes (vocabulary 256): no tokenizer to fetch, any text works, and a model's
vocab_size is known before the data is read.
"""

from __future__ import annotations

import fnmatch
import os
import sysconfig
import zlib
from pathlib import Path
from typing import Optional, Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

VOCAB_SIZE = 256  # one token per byte value


class ByteWindows(Dataset):
    """Non-overlapping windows of a byte stream: item i is (x, y) with y = x shifted by one."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        if len(data) < seq_len + 1:
            raise ValueError(f"{len(data)} bytes cannot fill one window of seq_len={seq_len} (+1 for the "
                             "target); use more text or a smaller data.seq_len")
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.seq_len: (i + 1) * self.seq_len + 1].long()  # (T + 1,)
        return chunk[:-1], chunk[1:]  # (T,), (T,)


def list_files(root: Path, pattern: str = "*", exclude: Sequence[Path] = ()) -> list[Path]:
    """Files under ``root`` whose path relative to it matches the fnmatch ``pattern`` ("*" crosses
    folders: "*.py" is every .py file at any depth), sorted by relative path: the same order on
    every machine and rank, whatever order the file system lists them in."""
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"data path {str(root)!r} is neither a file nor a folder; point data.path "
                                "at a text file or a folder of text files")
    # bytecode caches are not text; third-party packages differ from machine to machine
    skipped = {"__pycache__", "site-packages", "dist-packages", ".git"}
    excluded = {e.resolve() for e in exclude}
    files = []
    for folder, subfolders, names in os.walk(root):
        # prune while walking: a virtual environment inside the stdlib folder holds many thousands of files
        subfolders[:] = [d for d in subfolders if d not in skipped and (Path(folder) / d).resolve() not in excluded]
        for name in names:
            rel = (Path(folder) / name).relative_to(root).as_posix()
            if fnmatch.fnmatchcase(rel, pattern):
                files.append(Path(folder) / name)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def in_validation(relative_path: str, val_percent: float) -> bool:
    """Whether a file belongs to the validation split: decided by a hash of its relative path,
    so a file's side never changes when other files are added or removed (no leakage between
    runs on different machines), and whole files stay on one side (no leakage within a file)."""
    return zlib.crc32(relative_path.encode()) % 10_000 < val_percent * 100


def read_split(root: Path, pattern: str, val_percent: float, exclude: Sequence[Path] = (),
               max_bytes: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) byte tensors. Files that are not UTF-8 text (binaries) are skipped. A single
    file, or a folder whose files all fall on one side, is split by position instead: the last
    ``val_percent`` of the bytes is validation."""
    sides: dict[bool, list[bytes]] = {False: [], True: []}
    total = 0
    for path in list_files(root, pattern, exclude):
        raw = path.read_bytes()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        rel = path.name if root.is_file() else path.relative_to(root).as_posix()
        sides[in_validation(rel, val_percent)].append(raw)
        total += len(raw)
        if max_bytes is not None and total >= max_bytes:
            break
    if not sides[False] and not sides[True]:
        raise FileNotFoundError(f"no UTF-8 text files match {pattern!r} under {str(root)!r}; check data.path "
                                "and data.pattern (an fnmatch pattern such as '*.txt')")
    if not sides[False] or not sides[True]:
        everything = b"\n".join(sides[False] + sides[True])
        cut = int(len(everything) * (1 - val_percent / 100))
        return _as_tensor(everything[:cut]), _as_tensor(everything[cut:])
    return _as_tensor(b"\n".join(sides[False])), _as_tensor(b"\n".join(sides[True]))


def _as_tensor(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


class TextDataModule(L.LightningDataModule):
    """Byte-level next-token prediction over a text file or a folder of text files."""

    vocab_size = VOCAB_SIZE

    def __init__(self, path: str, pattern: str = "*", seq_len: int = 128, batch_size: int = 16,
                 val_percent: float = 5.0, max_bytes: Optional[int] = None, num_workers: int = 0) -> None:
        # pattern "*": every file at any depth; binaries are skipped by the UTF-8 check.
        # val_percent 5: enough windows for a stable loss on small corpora, little taken from training.
        # num_workers 0: the data is an in-memory tensor, and on small machines every core already
        # runs a rank; worker processes would only add start-up time.
        super().__init__()
        self.path, self.pattern, self.seq_len, self.batch_size = Path(path).expanduser(), pattern, seq_len, batch_size
        self.val_percent, self.max_bytes, self.num_workers = val_percent, max_bytes, num_workers
        self.exclude: list[Path] = []
        self.train_set: Optional[ByteWindows] = None
        self.val_set: Optional[ByteWindows] = None

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is None:  # every rank reads the files itself: cheap, and no broadcast needed
            train, val = read_split(self.path, self.pattern, self.val_percent, self.exclude, self.max_bytes)
            self.train_set, self.val_set = ByteWindows(train, self.seq_len), ByteWindows(val, self.seq_len)

    def train_dataloader(self) -> DataLoader:
        # shuffle: Lightning swaps in a DistributedSampler that shuffles with the same seed on every rank
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers,
                          drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


class StdlibDataModule(TextDataModule):
    """The Python standard library's ``.py`` files (about 30 MB on CPython 3.11), read from the
    running interpreter: real code on every machine with no download. Third-party packages
    installed inside it (site-packages) are left out, since they differ between machines."""

    def __init__(self, seq_len: int = 128, batch_size: int = 16, val_percent: float = 5.0,
                 max_bytes: Optional[int] = None, num_workers: int = 0) -> None:
        super().__init__(str(stdlib_dir()), "*.py", seq_len, batch_size, val_percent, max_bytes, num_workers)
        paths = sysconfig.get_paths()
        self.exclude = [Path(paths[k]) for k in ("purelib", "platlib") if k in paths]
