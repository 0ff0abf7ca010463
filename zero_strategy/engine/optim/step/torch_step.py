"""The inner optimizer's own step on the pieces' device (see [Note: step backends])."""

from __future__ import annotations

from .backend import StepBackend
from .grads import StepGradients


class TorchStep(StepBackend):
    """torch's update of every piece with a gradient, whole, then the masters' write-back."""

    def update(self, grads: StepGradients) -> None:
        grads.materialize()
        self.torch_update(grads)
        self.stepped.write_back()

    def torch_update(self, grads: StepGradients) -> None:
        """The update alone, on materialized gradients (see [Note: the fused mixed-precision step])."""
        assert grads.pairs is not None
        for master, grad in grads.pairs:
            master.grad = grad
        self.stepped.inner.step()
