"""Fused CUDA kernels (cuda/*.cu, compiled at run time by CuPy) with a torch reference for each.

Every function runs the CUDA kernels when its tensors are CUDA tensors the kernels take and CuPy
imports, and the torch reference otherwise (see [Note: when the kernels run] in kernels/ops.py); the
results agree either way. ``ZERO_STRATEGY_KERNELS=torch`` (or ``set_backend("torch")``) forces the
reference everywhere, and the torch code of the CPU int8 and bf16 state codec, whose C version
(int8_codec.c, built at run time by the system's C compiler: cpu_codec.py) otherwise runs on CPU.

    adam_step(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay=0.0,
              decoupled=False, maximize=False, grad_scale=1.0, lowp_out=None) -> None
    sgd_step(params, grads, momentum_buffers, *, lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
             nesterov=False, maximize=False, grad_scale=1.0, lowp_out=None) -> momentum buffers
    grad_norm_and_overflow(tensors, norm_type=2.0, device=None) -> (total, nonfinite)
    optimizer_step(optimizer, grad_scale=1.0, lowp_out=None, grads=None) -> bool  (False: call step())
    launch_counts() -> {source stem: kernels launched by this process}
"""

from . import reference
from .loader import available, backend, launch_counts, set_backend
from .ops import adam_step, grad_norm_and_overflow, sgd_step
from .optimizer import optimizer_step

__all__ = ["adam_step", "available", "backend", "grad_norm_and_overflow", "launch_counts", "optimizer_step",
           "reference", "set_backend", "sgd_step"]
