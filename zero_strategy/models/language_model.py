"""LightningModule for next-token prediction around any network that maps ids (B, T) to logits
(B, T, V): the package's GPT, or a transformers causal LM such as GPT2LMHeadModel."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn

from .optim import OptimizerFactory, SchedulerFactory, logits_of
from .task import TaskModule


class CausalLMModule(TaskModule):
    """Trains ``net`` with cross-entropy on shifted tokens; reports loss and perplexity.

    ``optimizer`` and ``scheduler`` are factories (Hydra ``_partial_: true`` nodes, or any
    callable) so the config picks the class and its hyperparameters, and the module decides
    which parameters get weight decay.
    """

    throughput_unit = "tokens"  # what ThroughputMonitor counts for this kind of model

    def __init__(self, net: nn.Module, optimizer: OptimizerFactory,
                 scheduler: Optional[SchedulerFactory] = None, weight_decay: float = 0.1) -> None:
        super().__init__(net, optimizer, scheduler)
        # weight_decay 0.1: GPT-3's value; applied to matrices only (see optim.build_optimizers)
        self.save_hyperparameters(ignore=["net", "optimizer", "scheduler"], logger=False)
        # torchmetrics' Perplexity averages over every token of every rank, then exponentiates
        self.val_ppl = torchmetrics.text.Perplexity()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return logits_of(self.net(idx))  # (B, T, V)

    def items_in_batch(self, batch: Any) -> int:
        return batch[0].numel()  # tokens: B * T

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # (B, T, V) and (B, T) flattened to (B*T, V) and (B*T,)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, targets = batch  # (B, T), (B, T): targets are idx shifted left by one
        loss = self._loss(self(idx), targets)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        idx, targets = batch
        logits = self(idx)  # (B, T, V)
        self.val_loss.update(self._loss(logits, targets), weight=targets.numel())
        self.val_ppl.update(logits.float(), targets)
        self.log("val/loss", self.val_loss, prog_bar=True)
        self.log("val/ppl", self.val_ppl)

