"""A sequence-classification set with no download: windows of real source code (the standard
library's, or any text the user points to) labelled 1 ("clean"), and windows in which a
fraction of the bytes was replaced by random printable characters labelled 0 ("corrupted").

It is a sentence-level cousin of ELECTRA's replaced-token detection: the model has to know what
code looks like. At a quarter of the bytes replaced, a tiny BERT reaches about 90% accuracy in
a few hundred steps of batch 8 on CPU. (Shuffling the bytes instead, which keeps every byte's
count, is too hard for a short run: a tiny BERT trained from scratch stayed at chance.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from .byte_corpus import read_split, stdlib_dir

_PRINTABLE = (32, 127)  # ASCII space .. '~': the corruption cannot be spotted by a non-ASCII byte


def clean_or_corrupted(text: torch.Tensor, seq_len: int, size: int, corruption: float, seed: int) -> TensorDataset:
    """``size`` windows spread evenly over ``text`` (uint8); about half, chosen at random, corrupted."""
    if len(text) < seq_len:
        raise ValueError(f"{len(text)} bytes cannot fill a window of seq_len={seq_len}; use more text")
    g = torch.Generator().manual_seed(seed)
    starts = torch.linspace(0, len(text) - seq_len, size).long()  # (N,): spread over the whole text
    windows = text[starts[:, None] + torch.arange(seq_len)].long()  # (N, T)
    labels = torch.randint(2, (size,), generator=g)  # (N,): 1 clean, 0 corrupted
    noise = torch.randint(*_PRINTABLE, (size, seq_len), generator=g)  # (N, T)
    replace = (torch.rand(size, seq_len, generator=g) < corruption) & (labels[:, None] == 0)  # (N, T)
    return TensorDataset(torch.where(replace, noise, windows), labels)


class CorruptedSourceDataModule(L.LightningDataModule):
    """Binary classification of byte windows: clean text (1) or partly replaced by noise (0)."""

    num_classes = 2

    def __init__(self, path: Optional[str] = None, pattern: str = "*.py", seq_len: int = 64, batch_size: int = 8,
                 corruption: float = 0.25, train_size: int = 8192, val_size: int = 512, seed: int = 0) -> None:
        # path None: the standard library's source, present on every machine
        # seq_len 64: enough context to judge, short enough for a tiny BERT on CPU
        # batch_size 8: the BERT fine-tuning tutorials' batch
        # corruption 0.25: learnable in a short run; at 0.15 a tiny BERT needs far more steps
        super().__init__()
        if not 0.0 < corruption <= 1.0:
            raise ValueError(f"corruption={corruption} must be a fraction of bytes in (0, 1]")
        self.path = Path(path).expanduser() if path else stdlib_dir()
        self.pattern, self.seq_len, self.batch_size, self.corruption = pattern, seq_len, batch_size, corruption
        self.train_size, self.val_size, self.seed = train_size, val_size, seed
        self.train_set: Optional[TensorDataset] = None
        self.val_set: Optional[TensorDataset] = None

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is None:
            # whole files go to one side (see byte_corpus.in_validation): no window is in both
            train, val = read_split(self.path, self.pattern, val_percent=5.0)
            self.train_set = clean_or_corrupted(train, self.seq_len, self.train_size, self.corruption, self.seed + 1)
            self.val_set = clean_or_corrupted(val, self.seq_len, self.val_size, self.corruption, self.seed + 2)

    def train_dataloader(self) -> DataLoader:
        # num_workers 0: the tensors are in memory already; workers would only cost start-up time
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)
