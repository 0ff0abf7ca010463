"""The update in the CUDA kernels (see [Note: step backends] in engine/optim/step/backend.py).

[Note: kernels in the step]
On CUDA, when CuPy imports (see zero_strategy/kernels), three passes run as fused kernels: the
overflow check of the loss scaler and the local norm for clipping (one read of every gradient,
``grad_norm_and_overflow``), and the update of Adam, AdamW and SGD (``optimizer_step``: one
launch per param group over all its pieces, each piece with its own step count, the state kept
in torch's layout in ``inner.state``). Any other optimizer, dtype or device runs torch's own
code, as on CPU, and ``ZERO_STRATEGY_KERNELS=torch`` forces that everywhere.
"""

from __future__ import annotations

from typing import Any

import torch

from .... import kernels
from ....config import ZeroConfig
from .backend import StepBackend, Stepped
from .grads import StepGradients
from .torch_step import TorchStep


class FusedStep(StepBackend):
    """Where the kernels run (chosen when they do on the pieces' device): Adam, AdamW and SGD in one
    pass per piece that reads the raw gradient, applies the factor it owes, and writes the master
    and the working weights (see [Note: the fused mixed-precision step] in engine/optim/step/grads.py). Gradients
    handed out (``piece_grads``) are stepped by the kernels from their materialized values; what the
    kernels do not take over (another optimizer, step hooks) steps as ``fallback`` does."""

    defers_gradients = True

    def __init__(self, stepped: Stepped, config: ZeroConfig, owner: Any, fallback: TorchStep) -> None:
        super().__init__(stepped, config, owner)
        self.fallback = fallback

    def update(self, grads: StepGradients) -> None:
        if grads.deferred and self._fused(grads):
            return
        grads.materialize()
        assert grads.pairs is not None
        if kernels.optimizer_step(self.stepped.inner, grads=dict(grads.pairs)):
            self.stepped.write_back()
        else:
            self.fallback.update(grads)

    def _fused(self, grads: StepGradients) -> bool:
        """The fused update; False, having changed nothing, when the kernels do not take it over."""
        assert grads.pairs is not None
        working: dict[torch.Tensor, torch.Tensor] = {
            t: g.weights(piece) for g, tensors in zip(self.stepped.groups, self.stepped.tensors)
            if g.has_master_copy for piece, t in zip(g.pieces, tensors)}
        return kernels.optimizer_step(self.stepped.inner, grad_scale=grads.scale, lowp_out=working,
                                      grads=dict(grads.pairs))
