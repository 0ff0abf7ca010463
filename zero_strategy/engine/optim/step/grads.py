"""The gradients of the coming optimizer step: averaged, unscaled, checked, clipped.

[Note: state behind LightningOptimizer]
Lightning wraps an optimizer in a LightningOptimizer that copies the optimizer's ``__dict__``
and subclasses its class, so a method called through the wrapper that *assigns* an attribute
sets it on the wrapper alone. Per-step state therefore lives in one ``StepGradients`` object,
shared by both dicts and only ever mutated.

[Note: the fused mixed-precision step]
Where the CUDA kernels run (see [Note: kernels in the step] in engine/optim/step/fused.py), the gradients stay
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
import torch.distributed as dist

from .... import kernels
from ....kernels.reference import GradScale


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
        """The reduced gradients, before unscaling: kept as reduced when ``deferred`` (and there are
        some), else in the masters' dtype (a copy only for a wider master)."""
        deferred = deferred and bool(pairs)
        if not deferred:
            pairs = [(master, grad.to(master.dtype)) for master, grad in pairs]
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

    def find_overflow(self, comm, device: torch.device) -> None:
        """Whether some rank's gradients hold an inf or a NaN (a collective; ``device``: its)."""
        grads = self.grads
        if not grads:
            bad = torch.zeros(1, dtype=torch.uint8, device=device)
        elif kernels.available(grads[0]):  # one fused pass on CUDA: see [Note: kernels in the step] in
                                           # engine/optim/step/fused.py
            bad = kernels.grad_norm_and_overflow(grads)[1].to(torch.uint8).reshape(1)
        else:
            norms = torch._foreach_norm(grads, dtype=torch.float32)  # fp32: an fp16 norm overflows by itself
            bad = (~torch.isfinite(torch.stack(norms).sum())).to(torch.uint8).reshape(1)
        bad = bad.to(device)  # host gradients (offload) give a host flag; every rank takes part
        comm.all_reduce(bad, op=dist.ReduceOp.MAX, what=lambda: "all-reduce of the overflow flag")
        self.overflow = bool(bad.item())

    def clip_norm(self, max_norm: float, norm_type: float, comm, device: torch.device) -> torch.Tensor:
        """Scale the gradients so that their norm over every rank's shard is at most ``max_norm``; the
        norm before (a collective; ``device``: its, offloaded gradients being on the host)."""
        grads = self.grads  # raw when deferred: see [Note: the fused mixed-precision step]
        inf = norm_type == float("inf")
        if grads and kernels.available(grads[0]) and norm_type in (2.0, float("inf")):
            total = kernels.grad_norm_and_overflow(grads, norm_type)[0].double()  # sum of squares, or the max
        else:
            nonempty = [g for g in grads if g.numel()]  # foreach has no inf-norm of an empty tensor
            norms = (torch.stack(torch._foreach_norm(nonempty, norm_type, dtype=torch.float32)).double()
                     if nonempty else torch.zeros(1, device=device))  # fp32: raw bf16/fp16 norms round or overflow
            total = norms.max() if inf else norms.pow(norm_type).sum()
        total = self.norm_power_of_raw(total, norm_type).to(device)
        what = lambda: "all-reduce of the gradient norm for clipping"  # noqa: E731
        if inf:
            comm.all_reduce(total, op=dist.ReduceOp.MAX, what=what)
        else:
            comm.all_reduce(total, what=what)
            total = total.pow(1.0 / norm_type)
        self.multiply((max_norm / (total + 1e-6)).clamp(max=1.0))
        return total.to(torch.float32)

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
