"""What a DeepSpeed config's ``"optimizer"`` section becomes: a factory of the torch optimizer
(deepspeed/optimizers.py builds it; deepspeed/muon.py's for DeepSpeed's Muon)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class OptimizerFactory:
    """Builds the torch optimizer a config's ``"optimizer"`` section describes: ``factory(params)``."""

    optimizer_class: type
    kwargs: Mapping[str, Any]

    def __call__(self, params: Any, module: Any = None, gradient_clipping: float = 0.0) -> torch.optim.Optimizer:
        """``params``: parameters or param groups, as any torch optimizer takes them. ``module`` (the model)
        and ``gradient_clipping`` (the config's) are for Muon's factory (deepspeed/muon.py)."""
        return self.optimizer_class(params, **self.kwargs)
