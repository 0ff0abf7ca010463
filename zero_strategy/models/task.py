"""What the app's LightningModules share: a network, optimizer and scheduler factories, and the
validation loss averaged over every rank's items."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torchmetrics
from torch import nn

from .optim import OptimizerFactory, SchedulerFactory, build_optimizers


class TaskModule(L.LightningModule):
    """``optimizer`` and ``scheduler`` are factories (Hydra ``_partial_: true`` nodes, or any callable)
    so the config picks the class and its hyperparameters, and the module decides which parameters get
    weight decay. Subclasses call ``save_hyperparameters`` with the factories and ``net`` ignored:
    plain values only in hparams, so checkpoints load without pickle."""

    def __init__(self, net: nn.Module, optimizer: OptimizerFactory, scheduler: Optional[SchedulerFactory]) -> None:
        super().__init__()
        self.net = net
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.val_loss = torchmetrics.MeanMetric()

    def configure_optimizers(self) -> Any:
        return build_optimizers(self, self.optimizer_factory, self.scheduler_factory, self.hparams.weight_decay)
