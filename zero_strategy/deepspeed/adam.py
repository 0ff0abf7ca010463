"""``deepspeed.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam`` as the torch optimizers they compute.

DeepSpeed's two kernels both compute Adam with decoupled weight decay (AdamW) by default and
Adam with L2 decay with ``adam_w_mode``/``adamw_mode`` false, with weight decay 0 by default. Each
name here returns ``torch.optim.AdamW`` or ``torch.optim.Adam`` with those arguments, which the
engine steps with torch's fused or foreach kernels on its flat shards (on the CPU too, with
offload), so a script that builds ``FusedAdam(model.parameters(), lr=...)`` and passes it to
``initialize(optimizer=...)`` trains the same update. ``bias_correction=False`` is refused (torch
always corrects the bias); ``fp32_optimizer_states`` must stay true (mixed precision keeps fp32
state here).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


def _adam(who: str, params: Any, lr: float, bias_correction: bool, betas: Any, eps: float, decoupled: bool,
          weight_decay: float, amsgrad: bool) -> torch.optim.Optimizer:
    if not bias_correction:
        raise ValueError(f"{who}(bias_correction=False): torch's Adam always corrects the bias; drop the argument.")
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return cls(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)


def FusedAdam(params: Any, lr: float = 1e-3, bias_correction: bool = True, betas: Any = (0.9, 0.999),  # noqa: N802
              eps: float = 1e-8, adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
              set_grad_none: bool = True) -> torch.optim.Optimizer:
    """DeepSpeed's FusedAdam: ``torch.optim.AdamW`` (``adam_w_mode=False``: ``torch.optim.Adam``)."""
    return _adam("FusedAdam", params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad)


def DeepSpeedCPUAdam(model_params: Any, lr: float = 1e-3, bias_correction: bool = True,  # noqa: N802
                     betas: Any = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False,
                     adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> torch.optim.Optimizer:
    """DeepSpeed's CPU Adam: ``torch.optim.AdamW`` (``adamw_mode=False``: ``torch.optim.Adam``); with
    offload the engine steps it on the CPU."""
    if not fp32_optimizer_states:
        raise ValueError("DeepSpeedCPUAdam(fp32_optimizer_states=False): mixed precision keeps fp32 optimizer state "
                         "here; drop the argument (for bf16 state use precision \"bf16-true\").")
    return _adam("DeepSpeedCPUAdam", model_params, lr, bias_correction, betas, eps, adamw_mode, weight_decay, amsgrad)


