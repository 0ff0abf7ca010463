"""A model's FLOPs per training step, counted once, and the peak a device can reach.

[Note: counting FLOPs]
The FLOPs of one training step are counted by torch's own counter (``torch.utils.flop_counter.
FlopCounterMode``) over the forwards of the engine's first training step (each micro-batch's, with
grad enabled), and backward is counted as twice its forward: each product of the forward is two
products in backward, the gradients of both of its operands, as DeepSpeed's flops profiler counts it.
The counter is a dispatch mode, entered when a forward begins and left when it returns, in the
thread that runs it: one kept on from the forward through backward to the optimizer step would stay
on for good, slowing every operation and keeping tensors alive, wherever a forward is not followed
by a step (a forward to inspect a loss, a dropped engine), and backward may run on other threads.
Nor is it left inside a backward: the autograd engine saves the thread's dispatch modes when a
backward begins and puts them back when it ends, so a mode left there comes back on for good (as it
did under manual optimization, where the front end's forward phase, open around ``training_step``,
ended when ``manual_backward`` reached the graph: every later operation of the run went through the
counter; the suite's 43 Trainer cases in one launch took 142 s, 36 s without). So each forward's own
end stops the count and leaves the mode (the front end's step around it may still be open); where
a backward begins before that (a step that never calls the watched module's forward), counting
stops at its first gradient and the mode is left at the next call outside a backward.
The rule overcounts by the input gradient of a layer whose input needs none (the first layer after
the data, when its input is not an embedding's output). It counts what runs (matrix products,
convolutions, attention) from the shapes, for any model, where the rule of 6 x parameters x tokens
holds only for a transformer's dense layers: it leaves out attention's own products, which grow with
the sequence length, and counts the embedding lookups, which multiply nothing. A forward recomputed
by activation checkpointing is not counted (it runs in backward). The count is this rank's, for its
micro-batches; it is taken once, assuming every step runs the same shapes. Counting slows that one
step's forwards (each operation passes through Python), which is left out of the breakdown's sums
anyway. A model that runs compiled (``torch.compile``) is not counted: code that torch.compile meets
while the counter's dispatch mode is active stays uncompiled for good.

MFU is the counted FLOPs per second over the device's peak: ``peak_flops`` when given, else the
dense tensor-core peak of the working dtype for the GPUs of ``PEAK_TFLOPS`` (TF32 for fp32 when
torch's float32 matmul precision allows it, plain fp32 otherwise), else none (a CPU, an unknown GPU).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Optional

import torch
from torch import nn

PEAK_TFLOPS: tuple[tuple[str, Optional[tuple[float, bool, Optional[float], float]]], ...] = (
    # (device name pattern, (16-bit tensor cores, whether they take bf16 (else fp16 only), TF32, fp32)),
    # TFLOP/s, dense (no structured sparsity), from NVIDIA's data sheets. The first match wins.
    (r"H100.*NVL|H200.*NVL", None),  # the figures depend on the configuration: give peak_flops
    (r"H100.*PCIe", (756.0, True, 378.0, 51.2)),
    (r"H100|H200", (989.4, True, 494.7, 66.9)),  # SXM
    (r"A100", (312.0, True, 156.0, 19.5)),
    (r"L40S", (362.1, True, 183.0, 91.6)),
    (r"\bL4\b", (121.0, True, 60.0, 30.3)),
    (r"\bA10\b", (125.0, True, 62.5, 31.2)),
    (r"V100.*PCIE", (112.0, False, None, 14.0)),
    (r"V100", (125.0, False, None, 15.7)),  # SXM2
    (r"\bT4\b", (65.0, False, None, 8.1)),
)
"""Peak TFLOP/s of common GPUs, by the dtype of the matrix products."""


def peak_flops(device: torch.device, dtype: torch.dtype) -> Optional[float]:
    """The dense peak FLOP/s of ``device`` computing in ``dtype`` (see [Note: counting FLOPs]), or None
    where ``PEAK_TFLOPS`` does not know it (every CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    figures = next((row for pattern, row in PEAK_TFLOPS if re.search(pattern, name)), None)
    if figures is None:
        return None
    half, takes_bf16, tf32, fp32 = figures
    if dtype == torch.float16 or (dtype == torch.bfloat16 and takes_bf16):
        return half * 1e12
    if dtype == torch.float32:
        tf32_allowed = tf32 is not None and torch.get_float32_matmul_precision() != "highest"
        return (tf32 if tf32_allowed else fp32) * 1e12  # type: ignore[operator]
    return None


_WRAPPERS = os.path.join("_dynamo", "eval_frame.py")


BACKWARD_FACTOR = 2
"""A backward's FLOPs per forward FLOP: two products per forward product (see [Note: counting FLOPs])."""


def is_compiled(module: Optional[nn.Module]) -> bool:
    """Whether ``module`` runs compiled, or one of its submodules does (``torch.compile(net)``,
    ``net.compile()``), or it is called from compiled code (``torch.compile(model)``, a compiled
    function): the caller's frames are read, once."""
    from torch._dynamo.eval_frame import OptimizeContext, OptimizedModule

    if module is not None and any(isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None)
                                  is not None for m in module.modules()):
        return True
    frame = sys._getframe(1)
    while frame is not None:  # torch.compile's wrappers (in dynamo's eval_frame.py) hold their context as ``self``;
        # only their locals are read: reading a frame's f_locals keeps a copy of its variables as long as it
        # runs (Python 3.11-3.12), so a caller's dropped model would stay alive
        if (frame.f_code.co_filename.endswith(_WRAPPERS)
                and isinstance(frame.f_locals.get("self"), (OptimizeContext, OptimizedModule))):
            return True
        frame = frame.f_back
    return False


def in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (recomputation runs forwards there)."""
    return torch._C._current_graph_task_id() != -1


class FlopCount:
    """The FLOPs of one training step (see [Note: counting FLOPs]): its forwards counted, from the first
    training forward to the end of that step; ``per_step`` and ``forward_per_step`` once done."""

    def __init__(self) -> None:
        self.per_step: Optional[int] = None
        self.forward_per_step: Optional[int] = None
        self.skipped: Optional[str] = None  # why nothing was counted
        self._mode = None  # the counter, entered during a forward only
        self._stopped = False  # the mode counts no more: it is left at the next call outside a backward
        self._forward = 0

    def forward_began(self, module: Optional[nn.Module]) -> None:
        self._leave()
        if self.per_step is not None or self.skipped is not None or self._mode is not None:
            return
        if is_compiled(module):
            self.skipped = "the model runs compiled (torch.compile), which the counter would keep from compiling"
            return
        from torch.utils.flop_counter import FlopCounterMode

        self._mode = FlopCounterMode(display=False)
        self._mode.__enter__()

    def forward_ended(self) -> None:
        """The forward ends, and its count: the counter is left now (in the thread that entered it, as a
        dispatch mode needs), or, inside a backward, at the next call outside one (see the Note)."""
        if self._mode is not None and not self._stopped:
            self._forward += int(self._mode.get_total_flops())
            self._stopped = True
        self._leave()

    def _leave(self) -> None:
        if self._stopped and not in_backward():
            mode, self._mode, self._stopped = self._mode, None, False
            mode.__exit__(None, None, None)

    def step_ended(self) -> None:
        self.forward_ended()
        if self.per_step is None and self.skipped is None and self._forward:
            self.forward_per_step = self._forward
            self.per_step = BACKWARD_FACTOR * self._forward + self._forward

    def abort(self) -> None:
        """The step being counted will not end as a step (an evaluation loop reset it): count the next."""
        self.forward_ended()
        self._forward = 0
