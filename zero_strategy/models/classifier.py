"""LightningModule for classification around any network that maps inputs to logits (B, K): the
MLP below, or transformers' BertForSequenceClassification (see ``bert.py``)."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn

from .optim import OptimizerFactory, SchedulerFactory, logits_of
from .task import TaskModule


class MLP(nn.Module):
    """Linear -> ReLU -> Linear: the model every ZeRO tutorial starts with (128 -> 512 -> 10)."""

    def __init__(self, in_features: int = 128, hidden: int = 512, num_classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # (B, in_features) -> (B, num_classes)


class ClassifierModule(TaskModule):
    """Cross-entropy training; validation loss and accuracy (torchmetrics, synced over ranks)."""

    throughput_unit = "samples"  # what ThroughputMonitor counts for this kind of model

    def __init__(self, net: nn.Module, num_classes: int, optimizer: OptimizerFactory,
                 scheduler: Optional[SchedulerFactory] = None, weight_decay: Optional[float] = None) -> None:
        super().__init__(net, optimizer, scheduler)
        # weight_decay None: the optimizer's own setting applies to every parameter, as in the
        # tutorials these models come from; a number splits off biases and norms (optim.py).
        self.save_hyperparameters(ignore=["net", "optimizer", "scheduler"], logger=False)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return logits_of(self.net(x))  # (B, K)

    def items_in_batch(self, batch: Any) -> int:
        return len(batch[0])  # samples

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).float(), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x).float()  # (B, K)
        self.val_loss.update(F.cross_entropy(logits, y), weight=len(y))
        self.val_acc.update(logits, y)
        self.log("val/loss", self.val_loss, prog_bar=True)
        self.log("val/acc", self.val_acc, prog_bar=True)
