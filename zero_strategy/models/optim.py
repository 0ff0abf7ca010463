"""What the LightningModules share: optimizer construction from a factory, a warm-up + cosine
learning-rate schedule, and unwrapping transformers' output objects."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import nn

OptimizerFactory = Callable[..., torch.optim.Optimizer]  # called as factory(param_groups)
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


def logits_of(output: Any) -> torch.Tensor:
    """Logits from a plain tensor or a transformers ModelOutput (which carries ``.logits``)."""
    return output if isinstance(output, torch.Tensor) else output.logits


def param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only: decaying biases, norms' gains and other vectors toward zero hurts and
    regularises nothing (the usual transformer recipe). Embeddings are matrices and decay too."""
    decay, no_decay = [], []
    for p in module.parameters():  # parameters() yields a tied weight once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizers(module: nn.Module, optimizer: OptimizerFactory, scheduler: Optional[SchedulerFactory],
                     weight_decay: Optional[float]) -> Any:
    """What ``configure_optimizers`` returns: the optimizer, with the scheduler stepped per step.

    ``weight_decay=None`` hands all parameters over in one group, so the factory's own
    ``weight_decay`` (or none) applies to all of them.
    """
    params = [p for p in module.parameters() if p.requires_grad] if weight_decay is None \
        else param_groups(module, weight_decay)
    opt = optimizer(params)
    if scheduler is None:
        return opt
    return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler(opt), "interval": "step"}}


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                  min_lr_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up to the optimizer's lr over ``warmup_steps``, then cosine decay to
    ``min_lr_ratio`` of it at ``total_steps`` (held there after).

    Warm-up keeps Adam's first updates small while its second-moment estimate is still noisy;
    ending at 10% rather than zero (Chinchilla's choice) leaves the last steps still learning.
    ``total_steps <= 0`` (Lightning's max_steps=-1, "no limit") means warm-up then constant.
    """
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps} must be >= 0")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if total_steps <= warmup_steps:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
