"""Torch implementations of every kernel: what the CUDA code must match, and what runs elsewhere.

Each function has the signature of its public counterpart in ``zero_strategy.kernels`` and runs on
any device and dtype. The optimizer steps repeat torch.optim's single-tensor code line by line
(same operations, same order, same float64 host scalars), so on fp32 they give torch's bits.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

GradScale = Union[float, torch.Tensor]
"""The gradient factor every optimizer step takes: a host float, or a one-element tensor on the device
(e.g. the clip coefficient, computed there, over the loss scale), so that no host sync is needed."""


def scaled_grad(grad: torch.Tensor, dtype: torch.dtype, grad_scale: GradScale) -> torch.Tensor:
    """``grad`` in ``dtype`` times ``grad_scale``; never modifies ``grad``."""
    grad = grad.to(dtype)
    if isinstance(grad_scale, torch.Tensor):
        return grad * grad_scale.to(device=grad.device, dtype=dtype)
    return grad if grad_scale == 1.0 else grad * grad_scale


def adam_bias_corrections(step: float, lr: float, beta1: float, beta2: float) -> tuple[float, float]:
    """(step_size, bias_correction2_sqrt) for one tensor at ``step`` (already incremented), as torch."""
    return lr / (1 - beta1**step), (1 - beta2**step) ** 0.5


def step_values(steps: Sequence[Union[float, int, torch.Tensor]]) -> list[float]:
    """Per-tensor step counts as floats (torch keeps them as 0-dim tensors)."""
    return [float(s.item()) if isinstance(s, torch.Tensor) else float(s) for s in steps]


@torch.no_grad()
def adam_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
              exp_avg_sqs: Sequence[torch.Tensor], steps: Sequence[Union[float, int, torch.Tensor]], *, lr: float,
              beta1: float, beta2: float, eps: float, weight_decay: float = 0.0, decoupled: bool = False,
              maximize: bool = False, grad_scale: GradScale = 1.0,
              lowp_out: Optional[Sequence[Optional[torch.Tensor]]] = None) -> None:
    """Adam (``decoupled=False``) or AdamW in place: torch.optim's ``_single_tensor_adam``."""
    for i, (param, step) in enumerate(zip(params, step_values(steps))):
        grad = scaled_grad(grads[i], param.dtype, grad_scale)
        grad = -grad if maximize else grad
        exp_avg, exp_avg_sq = exp_avgs[i], exp_avg_sqs[i]
        if weight_decay != 0:
            if decoupled:
                param.mul_(1 - lr * weight_decay)
            else:
                grad = grad.add(param, alpha=weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size, bias_correction2_sqrt = adam_bias_corrections(step, lr, beta1, beta2)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)
        if lowp_out is not None and lowp_out[i] is not None:
            lowp_out[i].copy_(param.view_as(lowp_out[i]))


@torch.no_grad()
def sgd_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
             momentum_buffers: Optional[Sequence[Optional[torch.Tensor]]], *, lr: float, momentum: float = 0.0,
             dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False, maximize: bool = False,
             grad_scale: GradScale = 1.0,
             lowp_out: Optional[Sequence[Optional[torch.Tensor]]] = None) -> list[Optional[torch.Tensor]]:
    """SGD in place: torch.optim's ``_single_tensor_sgd``. Returns the momentum buffers (a new one
    where ``None`` was given, holding the first step's gradient); all ``None`` when momentum is 0."""
    buffers: list[Optional[torch.Tensor]] = list(momentum_buffers) if momentum_buffers is not None else [None] * len(params)
    for i, param in enumerate(params):
        grad = scaled_grad(grads[i], param.dtype, grad_scale)
        grad = -grad if maximize else grad
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        if momentum != 0:
            buf = buffers[i]
            if buf is None:
                buf = buffers[i] = grad.detach().clone()
            else:
                buf.mul_(momentum).add_(grad, alpha=1 - dampening)
            grad = grad.add(buf, alpha=momentum) if nesterov else buf
        param.add_(grad, alpha=-lr)
        if lowp_out is not None and lowp_out[i] is not None:
            lowp_out[i].copy_(param.view_as(lowp_out[i]))
    return buffers if momentum != 0 else [None] * len(params)


@torch.no_grad()
def grad_norm_and_overflow(tensors: Sequence[torch.Tensor], norm_type: float = 2.0,
                           device: Optional[torch.device] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(total, nonfinite) over all ``tensors``: total is the sum of ``|x|**norm_type`` (the norm to the
    power ``norm_type``, so ranks can all-reduce it with SUM), or the largest ``|x|`` for ``inf`` (reduce
    with MAX); fp32 0-dim. nonfinite is a bool 0-dim tensor: some element is NaN or infinite.

    Here nonfinite comes from the norm itself (one pass, torch's foreach norms), so it is also set when
    finite values overflow fp32 on the way; the kernel flags elements.
    """
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        where = device if device is not None else "cpu"
        return torch.zeros((), dtype=torch.float32, device=where), torch.zeros((), dtype=torch.bool, device=where)
    norm_type = float(norm_type)
    norms = torch.stack(torch._foreach_norm(tensors, norm_type, dtype=torch.float32)).double()
    total = norms.max() if norm_type == float("inf") else norms.pow(norm_type).sum()
    return total.float(), ~torch.isfinite(total)


@torch.no_grad()
def adam_lowp_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence, exp_avg_sqs: Sequence,
                   steps: Sequence[Union[float, int, torch.Tensor]], *, keys: Sequence[int], starts: Sequence[int],
                   seed: int, step_count: int, **adam) -> None:
    """Adam or AdamW (``adam``: adam_step's keywords) over low-precision state, as cuda/adam_lowp.cu: each
    moment an ``Int8State`` or a ``Bf16State`` (engine/optim/lowp.py), each param fp32 or a bf16 master rounded
    stochastically; decoded into fp32, stepped by ``adam_step``, encoded back. ``keys[i]`` and ``starts[i]``
    place params[i] for the random bits, with ``seed`` and the optimizer's ``step_count``."""
    from ..engine.optim.lowp import Bf16State, round_to_bf16  # the encodings: engine/optim/lowp.py

    for i, param in enumerate(params):
        master = param.float() if param.dtype == torch.bfloat16 else param
        m, v = exp_avgs[i].decode(), exp_avg_sqs[i].decode()
        adam_step([master], [grads[i]], [m], [v], [steps[i]], **adam)
        for slot, (stored, value) in enumerate(((exp_avgs[i], m), (exp_avg_sqs[i], v)), start=1):
            if isinstance(stored, Bf16State):
                stored.values.copy_(round_to_bf16(value, True, seed, step_count, keys[i], starts[i], slot))
            else:
                stored.encode_(value)
        if param.dtype == torch.bfloat16:
            param.copy_(round_to_bf16(master, True, seed, step_count, keys[i], starts[i], 0))
