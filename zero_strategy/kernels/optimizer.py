"""``optimizer_step``: a torch Adam, AdamW or SGD stepped by the fused kernels, state kept in torch's layout.

[Note: taking over optimizer.step()]
The engine keeps a real torch optimizer over its pieces (checkpoints, LR schedulers and the user's
hyperparameters all go through it). ``optimizer_step`` performs exactly what its ``step()`` would,
with one launch per param group and dtype combination, reading ``p.grad`` (or the gradients the
caller passes, which may be narrower than the params) and creating or
updating ``optimizer.state[p]`` as torch does (``step`` a float32 0-dim tensor on the CPU, or on
the device for fused groups, as torch keeps it; ``exp_avg``, ``exp_avg_sq``; ``momentum_buffer``),
so the optimizer can go on with its own ``step()`` at any time and its ``state_dict`` is torch's.
It takes over only what it reproduces: the exact classes Adam, AdamW and SGD (a subclass may
override ``step``), without amsgrad, capturable or differentiable, with no step hooks, and fp32
CUDA params the kernels take. Anything else returns False and changes nothing, and the caller
runs ``optimizer.step()``.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from . import ops
from .loader import CUDA_TYPE_NAMES, available
from .reference import GradScale


def _scalar(x) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _takes_over(optimizer: torch.optim.Optimizer, grad_of) -> bool:
    """See [Note: taking over optimizer.step()]."""
    kind = type(optimizer)
    if kind not in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        return False
    if (optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks  # type: ignore[attr-defined]
            or _global_optimizer_pre_hooks or _global_optimizer_post_hooks):
        return False
    device = None
    for group in optimizer.param_groups:
        if group.get("differentiable") or group.get("capturable") or group.get("amsgrad"):
            return False
        for p in group["params"]:
            grad = grad_of(p)
            if grad is None:
                continue
            device = device or p.device
            if (p.dtype != torch.float32 or p.device != device or not available(p) or not p.is_contiguous()
                    or grad.is_sparse or grad.dtype not in CUDA_TYPE_NAMES or not grad.is_contiguous()
                    or grad.device != device or grad.numel() != p.numel()):
                return False
    return device is not None


@torch.no_grad()
def optimizer_step(optimizer: torch.optim.Optimizer, grad_scale: GradScale = 1.0,
                   lowp_out: Optional[Mapping[torch.Tensor, torch.Tensor]] = None,
                   grads: Optional[Mapping[torch.Tensor, torch.Tensor]] = None) -> bool:
    """Step ``optimizer`` with the fused kernels if they reproduce it, and say whether they did.

    Returns False, having changed nothing, when they do not (see [Note: taking over
    optimizer.step()]); call ``optimizer.step()`` then. Gradients are ``p.grad * grad_scale``
    (``grad_scale``: a float or a one-element device tensor, e.g. 1/loss_scale times the clip
    coefficient), read as fp32, bf16 or fp16 and left unchanged. ``lowp_out`` maps a param to a
    bf16/fp16 tensor of its size that receives the updated weight (the working copy to all-gather).
    ``grads``, when given, maps each param to its gradient in place of ``p.grad`` (params missing from it
    are skipped, as torch skips a None grad): the way to pass bf16/fp16 gradients of fp32 params, which
    torch does not allow as ``.grad``.
    """
    grad_of = (lambda p: grads.get(p)) if grads is not None else (lambda p: p.grad)
    if not _takes_over(optimizer, grad_of):
        return False
    out_of = lowp_out or {}
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if grad_of(p) is not None]
        if not params:
            continue
        group_grads = [grad_of(p) for p in params]
        outs = [out_of.get(p) for p in params] if out_of else None
        lr = _scalar(group["lr"])
        if isinstance(optimizer, torch.optim.SGD):
            momentum = _scalar(group["momentum"])
            states = [optimizer.state[p] for p in params] if momentum != 0 else None
            buffers = ops.sgd_step(params, group_grads, [s.get("momentum_buffer") for s in states] if states else None,
                                   lr=lr, momentum=momentum, dampening=_scalar(group["dampening"]),
                                   weight_decay=_scalar(group["weight_decay"]), nesterov=group["nesterov"],
                                   maximize=group["maximize"], grad_scale=grad_scale, lowp_out=outs)
            for state, buf in zip(states or (), buffers):
                state["momentum_buffer"] = buf
            continue
        steps = []
        for p in params:
            state = optimizer.state[p]
            if len(state) == 0:  # torch's lazy initialisation (Adam._init_group)
                on_device = group.get("fused") or group.get("capturable")
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            steps.append(state["step"])
        torch._foreach_add_(steps, 1)
        step_counts = torch.stack([s.to(steps[0].device) for s in steps]).tolist()  # one sync for device steps
        beta1, beta2 = (_scalar(b) for b in group["betas"])
        ops.adam_step(params, group_grads, [optimizer.state[p]["exp_avg"] for p in params],
                      [optimizer.state[p]["exp_avg_sq"] for p in params], step_counts, lr=lr, beta1=beta1,
                      beta2=beta2, eps=_scalar(group["eps"]), weight_decay=_scalar(group["weight_decay"]),
                      decoupled=group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)),
                      maximize=group["maximize"], grad_scale=grad_scale, lowp_out=outs)
    return True
