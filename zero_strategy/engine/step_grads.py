"""The gradients of the coming optimizer step: averaged, unscaled, checked, clipped.

[Note: state behind LightningOptimizer]
Lightning wraps an optimizer in a LightningOptimizer that copies the optimizer's ``__dict__``
and subclasses its class, so a method called through the wrapper that *assigns* an attribute
sets it on the wrapper alone. Per-step state therefore lives in one ``StepGradients`` object,
shared by both dicts and only ever mutated.

[Note: the fused mixed-precision step]
Where the CUDA kernels run (see [Note: kernels in the step] in optimizer.py), the gradients stay
as the reduction left them, bf16/fp16 included, and what the step still owes them (1/loss scale,
then the clipping coefficient) is one factor, ``scale``: a host float, or a one-element device
tensor once clipping computed it there. The overflow check and the clipping norm read the raw
gradients in one pass (the norm of ``scale * g`` is ``|scale|`` times theirs), and the fused update
reads each gradient once, multiplies by ``scale``, and writes the fp32 master and the bf16/fp16
working weights in the same pass: no fp32 copy of a gradient, no separate unscale, clip or
write-back pass. Anything that needs the gradients' values themselves (clipping by value, an
optimizer the kernels do not take over, ``piece_grads()``) first calls ``materialize()``, which
makes them the fp32 (master-dtype), fully scaled tensors the torch path uses.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels.reference import GradScale


class StepGradients:
    """Each stepped piece's gradient for the coming step (see the Notes above)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.pairs: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None  # (master piece, its gradient)
        self.where: list[tuple[int, int]] = []  # (group, piece) of each pair
        self.overflow = False
        self.scale: GradScale = 1.0  # what the gradients still owe (deferred only)
        self.deferred = False  # raw gradients and a factor: see [Note: the fused mixed-precision step]
        self.altered = False  # handed out since reduced (the caller may have changed them): see overlap.py
        self.factors: list[torch.Tensor] = []  # clip coefficients applied since reduced

    @property
    def ready(self) -> bool:
        return self.pairs is not None

    @property
    def grads(self) -> list[torch.Tensor]:
        assert self.pairs is not None
        return [grad for _, grad in self.pairs]

    def set(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], where: list[tuple[int, int]], deferred: bool,
            loss_scale: Optional[float]) -> None:
        """The reduced gradients (``deferred``: as reduced; else already fp32 copies), before unscaling."""
        self.pairs, self.where, self.deferred, self.overflow, self.altered = pairs, where, deferred, False, False
        self.factors = []
        factor = 1.0 / loss_scale if loss_scale is not None else 1.0
        if deferred:
            self.scale = factor
        elif factor != 1.0 and pairs:
            torch._foreach_mul_(self.grads, factor)

    @property
    def changed(self) -> bool:
        """Whether the gradients may differ from their reduction's result: handed out, or clipped by
        a coefficient other than exactly 1 (read only by the overlapped step: a device sync)."""
        return self.altered or any(not bool((f == 1).all()) for f in self.factors)

    def multiply(self, factor: torch.Tensor) -> None:
        """Scale every gradient by ``factor`` (a clip coefficient): deferred, or in place."""
        self.factors.append(factor)
        if self.deferred:
            self.scale = factor * self.scale
        elif self.pairs:
            torch._foreach_mul_(self.grads, factor.to(self.pairs[0][1].device, self.pairs[0][1].dtype))

    def norm_power_of_raw(self, raw: torch.Tensor, norm_type: float) -> torch.Tensor:
        """This rank's norm term of the gradients as they are meant to be, from that of the raw ones
        (the sum of ``|g|**p``, or the largest ``|g|``)."""
        if not self.deferred:
            return raw
        scale = self.scale if isinstance(self.scale, torch.Tensor) else torch.tensor(self.scale)
        factor = scale.to(raw.device, raw.dtype).abs()
        return raw * (factor if norm_type == float("inf") else factor ** norm_type)

    def materialize(self) -> None:
        """Fully scaled gradients in the masters' dtype, as the torch path takes them."""
        if not self.deferred or self.pairs is None:
            return
        scale = self.scale
        self.pairs = [(master, _times(grad.to(master.dtype, copy=True), scale)) for master, grad in self.pairs]
        self.scale, self.deferred = 1.0, False


def _times(grad: torch.Tensor, scale: GradScale) -> torch.Tensor:
    if isinstance(scale, torch.Tensor):
        return grad.mul_(scale.to(grad.device, grad.dtype))
    return grad if scale == 1.0 else grad.mul_(scale)
