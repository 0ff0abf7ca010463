"""Data sets generated from a seed: no files, no download, identical on every rank and machine.

- ``MarkovLMDataModule``: token sequences from a fixed random Markov chain, for language models.
  Each token has a few likely successors, so the loss has a known floor well below chance and a
  model visibly learns.
- ``GaussianClassificationDataModule``: Gaussian inputs labelled by a fixed random linear
  "teacher", the classic ZeRO tutorial set-up (examples/mlp_classifier uses the same idea).
"""

from __future__ import annotations

from typing import Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class _TensorDataModule(L.LightningDataModule):
    """Holds a train and a val TensorDataset made once by ``make(split_seed, size)``."""

    def __init__(self, batch_size: int, train_size: int, val_size: int, seed: int) -> None:
        super().__init__()
        self.batch_size, self.train_size, self.val_size, self.seed = batch_size, train_size, val_size, seed
        self.train_set: Optional[TensorDataset] = None
        self.val_set: Optional[TensorDataset] = None

    def make(self, seed: int, size: int) -> TensorDataset:
        raise NotImplementedError

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is None:
            # different seeds per split: validation samples are new draws from the same distribution
            self.train_set = self.make(self.seed + 1, self.train_size)
            self.val_set = self.make(self.seed + 2, self.val_size)

    def train_dataloader(self) -> DataLoader:
        # num_workers 0: the tensors are in memory already; workers would only cost start-up time
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


class MarkovLMDataModule(_TensorDataModule):
    """Sequences of ``seq_len + 1`` tokens from a random chain where each token is followed by one
    of ``branching`` successors (fixed per token, random probabilities): the best possible loss
    is at most ln(branching) nats per token, against ln(vocab_size) for guessing."""

    vocab_size = 256  # the same id space as the byte-level corpora, so models swap freely

    def __init__(self, seq_len: int = 128, batch_size: int = 16, branching: int = 4, train_size: int = 16384,
                 val_size: int = 512, seed: int = 0) -> None:
        # branching 4: loss floor <= ln 4 = 1.39 against ln 256 = 5.55; low enough to see learning in 100 steps
        # train_size 16384 sequences: 2 MB, more than a short run consumes, so no epoch repeats
        super().__init__(batch_size, train_size, val_size, seed)
        if not 1 <= branching <= self.vocab_size:
            raise ValueError(f"branching={branching} must be between 1 and {self.vocab_size}")
        self.seq_len, self.branching = seq_len, branching
        g = torch.Generator().manual_seed(seed)  # the chain itself: the same for every split
        self.successors = torch.stack([torch.randperm(self.vocab_size, generator=g)[:branching]
                                       for _ in range(self.vocab_size)])  # (V, branching)
        self.probs = torch.rand(self.vocab_size, branching, generator=g) + 0.1  # (V, branching), none near 0

    def make(self, seed: int, size: int) -> TensorDataset:
        g = torch.Generator().manual_seed(seed)
        tokens = torch.empty(size, self.seq_len + 1, dtype=torch.long)  # (N, T + 1)
        tokens[:, 0] = torch.randint(self.vocab_size, (size,), generator=g)
        for t in range(1, self.seq_len + 1):  # all sequences advance together: T steps, not N * T
            prev = tokens[:, t - 1]  # (N,)
            choice = torch.multinomial(self.probs[prev], 1, generator=g).squeeze(1)  # (N,)
            tokens[:, t] = self.successors[prev, choice]
        return TensorDataset(tokens[:, :-1], tokens[:, 1:])  # (N, T) inputs, (N, T) next-token targets


class GaussianClassificationDataModule(_TensorDataModule):
    """x ~ N(0, I) in ``num_features`` dimensions, label = argmax of a fixed random linear map of
    x. A linear teacher means a perfect classifier exists, so accuracy climbs well above chance."""

    def __init__(self, num_features: int = 128, num_classes: int = 10, batch_size: int = 32,
                 train_size: int = 8192, val_size: int = 1024, seed: int = 0) -> None:
        # 128 features, 10 classes, batch 32: the ZeRO tutorials' MLP set-up (Linear 128 -> 512 -> 10)
        super().__init__(batch_size, train_size, val_size, seed)
        self.num_features, self.num_classes = num_features, num_classes
        g = torch.Generator().manual_seed(seed + 1234)
        self.teacher = torch.randn(num_features, num_classes, generator=g)  # (F, K), shared by both splits

    def make(self, seed: int, size: int) -> TensorDataset:
        x = torch.randn(size, self.num_features, generator=torch.Generator().manual_seed(seed))  # (N, F)
        return TensorDataset(x, (x @ self.teacher).argmax(-1))  # (N, F), (N,)
