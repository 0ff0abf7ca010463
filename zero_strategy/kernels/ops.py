"""The public kernel functions: the CUDA kernels of cuda/*.cu where they apply, the torch reference elsewhere.

[Note: when the kernels run]
A call runs the CUDA kernels when its first tensor is ``available`` (CUDA, CuPy imports, backend not
forced to torch) and every tensor is contiguous, on that device, of a dtype the kernels take
(optimizer state and weights fp32; gradients fp32, bf16 or fp16; low-precision outputs bf16 or
fp16). Otherwise the whole call runs the torch reference (reference.py), which takes anything torch
does. Either way the results agree (bit for bit on CPU against torch.optim; within rounding of the
fused multiply-adds on CUDA), so callers never branch on which one ran.

Inside, tensors are grouped by their dtypes and each group is one launch over a tensor-list table
(see [Note: tensor-list table] in cuda/zs_common.cuhhh): no flattening, no per-tensor launch.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from . import reference
from .loader import CUDA_TYPE_NAMES, available, launch
from .reference import GradScale

CHUNK = 16384
"""Elements per CUDA block: a multiple of the vector width (4); 256 threads make 16 passes."""
THREADS = 256
FLAG_VEC, FLAG_FIRST_STEP = 1, 2  # a tensor's flags in the table, as in cuda/zs_common.cuh

_LOWP = (torch.bfloat16, torch.float16)


# ---- checks --------------------------------------------------------------------------------

def _check_lists(what: str, first: Sequence, **others: Optional[Sequence]) -> None:
    for name, seq in others.items():
        if seq is not None and len(seq) != len(first):
            raise ValueError(f"{what}: {len(seq)} {name} for {len(first)} params; give one per param (None for none).")
    for name, seq in others.items():
        for i, (p, t) in enumerate(zip(first, seq or ())):
            if t is not None and t.numel() != p.numel():
                raise ValueError(f"{what}: {name}[{i}] has {t.numel()} elements but params[{i}] has {p.numel()}; "
                                 "each must match its param.")


def _kernels_take(first: torch.Tensor, typed: Sequence[tuple[Sequence[Optional[torch.Tensor]], tuple]]) -> bool:
    """See [Note: when the kernels run]. ``typed``: (tensors, dtypes they may have) pairs."""
    if not available(first):
        return False
    return all(t is None or (t.device == first.device and t.dtype in dtypes and t.is_contiguous())
               for tensors, dtypes in typed for t in tensors)


# ---- the launch table ----------------------------------------------------------------------

def _address(t: Optional[torch.Tensor], offset: int = 0) -> int:
    return 0 if t is None else t.data_ptr() + offset * t.element_size()


def _table(device: torch.device, addresses: list[list[tuple[int, int]]], numels: list[int],
           first_step: Optional[list[bool]] = None, scalars: Sequence[Sequence[float]] = ()) -> tuple[torch.Tensor, int]:
    """The device table of one launch (layout: [Note: tensor-list table]) and its grid size.

    ``addresses[r][t]`` = (address, element size) of tensor t's array for role r (address 0: absent).
    """
    n = len(numels)
    flags = []
    for t in range(n):
        vec = all(addr % (4 * size) == 0 for addr, size in (role[t] for role in addresses) if addr)
        flags.append((FLAG_VEC if vec else 0) | (FLAG_FIRST_STEP if first_step is not None and first_step[t] else 0))
    first_block = [0]
    for k in numels:
        first_block.append(first_block[-1] + -(-k // CHUNK))
    ints = [addr for role in addresses for addr, _ in role] + numels + flags
    parts = [torch.tensor(ints, dtype=torch.int64)]
    if scalars:
        parts.append(torch.tensor(scalars, dtype=torch.float64).view(torch.int64).reshape(-1))
    parts.append(torch.tensor(first_block, dtype=torch.int64))
    table = torch.cat(parts)
    if device.type == "cuda":  # (a CPU table serves tests that emulate the kernels on host memory)
        table = table.pin_memory().to(device, non_blocking=True)
    return table, first_block[-1]


def _grad_scale_args(grad_scale: GradScale, device: torch.device) -> tuple[float, Optional[torch.Tensor]]:
    """(host factor, device float32 factor or None): the kernels multiply both into the gradient."""
    if isinstance(grad_scale, torch.Tensor):
        if grad_scale.numel() != 1:
            raise ValueError(f"grad_scale must be a float or a one-element tensor; got shape {tuple(grad_scale.shape)}.")
        return 1.0, grad_scale.to(device=device, dtype=torch.float32).reshape(1).contiguous()
    return float(grad_scale), None


def _groups(indices: Sequence[int], key) -> dict:
    out: dict = {}
    for i in indices:
        out.setdefault(key(i), []).append(i)
    return out


def _type_name(t: Optional[torch.Tensor]) -> str:
    return "no_out_t" if t is None else CUDA_TYPE_NAMES[t.dtype]


def _np():
    import numpy  # noqa: PLC0415  (CuPy's dependency; only the CUDA path needs it)

    return numpy


# ---- optimizer steps -------------------------------------------------------------------------

@torch.no_grad()
def adam_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
              exp_avg_sqs: Sequence[torch.Tensor], steps: Sequence[Union[float, int, torch.Tensor]], *, lr: float,
              beta1: float, beta2: float, eps: float, weight_decay: float = 0.0, decoupled: bool = False,
              maximize: bool = False, grad_scale: GradScale = 1.0,
              lowp_out: Optional[Sequence[Optional[torch.Tensor]]] = None) -> None:
    """One Adam (``decoupled=False``) or AdamW (``decoupled=True``) step, in place, on many tensors.

    Matches torch.optim.Adam/AdamW (amsgrad=False, capturable=False). ``steps[i]`` is tensor i's step
    count *after* this step's increment (torch's ``state["step"]``; numbers or 0-dim tensors), so each
    tensor has its own bias corrections. The gradient used is ``grads[i] * grad_scale`` (a float or a
    one-element tensor on the device, e.g. loss unscale times clip coefficient); ``grads`` may be
    fp32, bf16 or fp16 and are not modified. ``lowp_out[i]``, when given, receives the updated weight
    rounded to its dtype (bf16/fp16), e.g. the working copy that is all-gathered next.
    """
    _check_lists("adam_step", params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, lowp_out=lowp_out)
    if len(steps) != len(params):
        raise ValueError(f"adam_step: {len(steps)} steps for {len(params)} params; give each param its step count.")
    outs = list(lowp_out) if lowp_out is not None else [None] * len(params)
    fp32 = (torch.float32,)
    if not params or not _kernels_take(params[0], [(params, fp32), (exp_avgs, fp32), (exp_avg_sqs, fp32),
                                                   (grads, tuple(CUDA_TYPE_NAMES)), (outs, _LOWP)]):
        reference.adam_step(params, grads, exp_avgs, exp_avg_sqs, steps, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                            weight_decay=weight_decay, decoupled=decoupled, maximize=maximize,
                            grad_scale=grad_scale, lowp_out=lowp_out)
        return
    np, device = _np(), params[0].device
    scale, scale_tensor = _grad_scale_args(grad_scale, device)
    step_counts = reference.step_values(steps)
    nonempty = [i for i in range(len(params)) if params[i].numel() > 0]
    for (g, o), idx in _groups(nonempty, lambda i: (_type_name(grads[i]), _type_name(outs[i]))).items():
        roles = [params, grads, exp_avgs, exp_avg_sqs, outs]
        addresses = [[(_address(r[i]), r[i].element_size() if r[i] is not None else 1) for i in idx] for r in roles]
        corrections = [reference.adam_bias_corrections(step_counts[i], lr, beta1, beta2) for i in idx]
        table, grid = _table(device, addresses, [params[i].numel() for i in idx],
                             scalars=[[c[0] for c in corrections], [c[1] for c in corrections]])
        launch("fused_adam", f"adam_step<{g}, {o}>", device, grid, THREADS, (
            np.uint64(table.data_ptr()), np.int32(len(idx)), np.int64(CHUNK), np.float32(scale),
            np.uint64(_address(scale_tensor)), np.float32(1 - beta1), np.float32(beta2), np.float32(1 - beta2),
            np.float32(eps), np.float32(weight_decay), np.float32(1 - lr * weight_decay), np.int32(decoupled),
            np.int32(maximize)))


@torch.no_grad()
def sgd_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
             momentum_buffers: Optional[Sequence[Optional[torch.Tensor]]], *, lr: float, momentum: float = 0.0,
             dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False, maximize: bool = False,
             grad_scale: GradScale = 1.0,
             lowp_out: Optional[Sequence[Optional[torch.Tensor]]] = None) -> list[Optional[torch.Tensor]]:
    """One SGD step, in place, on many tensors; matches torch.optim.SGD.

    ``momentum_buffers[i]`` is tensor i's buffer, or None before its first step (then, as in torch, a
    new buffer starts at that step's gradient). Returns the buffers after the step (new ones
    included; all None when ``momentum`` is 0), for the caller to keep. ``grad_scale`` and
    ``lowp_out`` as in ``adam_step``.
    """
    _check_lists("sgd_step", params, grads=grads, momentum_buffers=momentum_buffers, lowp_out=lowp_out)
    outs = list(lowp_out) if lowp_out is not None else [None] * len(params)
    buffers = list(momentum_buffers) if momentum_buffers is not None else [None] * len(params)
    fp32 = (torch.float32,)
    if not params or not _kernels_take(params[0], [(params, fp32), (buffers, fp32), (grads, tuple(CUDA_TYPE_NAMES)),
                                                   (outs, _LOWP)]):
        return reference.sgd_step(params, grads, momentum_buffers, lr=lr, momentum=momentum, dampening=dampening,
                                  weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                                  grad_scale=grad_scale, lowp_out=lowp_out)
    np, device = _np(), params[0].device
    scale, scale_tensor = _grad_scale_args(grad_scale, device)
    first_step = [b is None for b in buffers]
    if momentum != 0:
        buffers = [torch.empty_like(p) if b is None else b for p, b in zip(params, buffers)]
    nonempty = [i for i in range(len(params)) if params[i].numel() > 0]
    for (g, o), idx in _groups(nonempty, lambda i: (_type_name(grads[i]), _type_name(outs[i]))).items():
        roles = [params, grads, buffers if momentum != 0 else [None] * len(params), outs]
        addresses = [[(_address(r[i]), r[i].element_size() if r[i] is not None else 1) for i in idx] for r in roles]
        table, grid = _table(device, addresses, [params[i].numel() for i in idx], [first_step[i] for i in idx])
        launch("fused_sgd", f"sgd_step<{g}, {o}>", device, grid, THREADS, (
            np.uint64(table.data_ptr()), np.int32(len(idx)), np.int64(CHUNK), np.float32(scale),
            np.uint64(_address(scale_tensor)), np.float32(lr), np.float32(momentum), np.float32(1 - dampening),
            np.float32(weight_decay), np.int32(nesterov), np.int32(maximize)))
    return buffers if momentum != 0 else [None] * len(params)


# ---- gradient norm and overflow --------------------------------------------------------------

@torch.no_grad()
def grad_norm_and_overflow(tensors: Sequence[torch.Tensor], norm_type: float = 2.0,
                           device: Optional[torch.device] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(total, nonfinite) over all ``tensors`` in one pass, without a host sync.

    total (fp32, 0-dim): the sum of ``|x|**norm_type`` over every element, i.e. this rank's part of the
    norm to the power ``norm_type`` (all-reduce with SUM, then take the ``1/norm_type`` root), or the
    largest ``|x|`` for ``norm_type=inf`` (all-reduce with MAX). nonfinite (bool, 0-dim): some element
    is NaN or infinite (the loss scaler's overflow). The kernels handle norm types 2 and inf and are
    deterministic; other norm types run the reference. ``device`` places the zeros of an empty list.
    """
    nonempty = [t for t in tensors if t.numel() > 0]
    norm_type = float(norm_type)
    if (not nonempty or norm_type not in (2.0, float("inf"))
            or not _kernels_take(nonempty[0], [(nonempty, tuple(CUDA_TYPE_NAMES))])):
        return reference.grad_norm_and_overflow(tensors, norm_type, device=device or (tensors[0].device if tensors else None))
    np, device = _np(), nonempty[0].device
    by_dtype = _groups(range(len(nonempty)), lambda i: nonempty[i].dtype)
    blocks = {dt: sum(-(-nonempty[i].numel() // CHUNK) for i in idx) for dt, idx in by_dtype.items()}
    partials = torch.empty(sum(blocks.values()), dtype=torch.float32, device=device)
    flags = torch.empty(partials.numel(), dtype=torch.uint8, device=device)
    max_mode = np.int32(norm_type == float("inf"))
    offset = 0
    for dtype, idx in by_dtype.items():
        table, grid = _table(device, [[(_address(nonempty[i]), nonempty[i].element_size()) for i in idx]],
                             [nonempty[i].numel() for i in idx])
        launch("grad_norm", f"grad_norm_partials<{CUDA_TYPE_NAMES[dtype]}>", device, grid, THREADS, (
            np.uint64(table.data_ptr()), np.int32(len(idx)), np.int64(CHUNK), max_mode, np.uint64(partials.data_ptr()),
            np.uint64(flags.data_ptr()), np.int64(offset)))
        offset += grid
    total = torch.empty((), dtype=torch.float32, device=device)
    nonfinite = torch.empty((), dtype=torch.bool, device=device)
    launch("grad_norm", "grad_norm_final", device, 1, THREADS, (
        np.uint64(partials.data_ptr()), np.uint64(flags.data_ptr()), np.int64(partials.numel()), max_mode,
        np.uint64(total.data_ptr()), np.uint64(nonfinite.data_ptr())))
    return total, nonfinite


# ---- block quantization for communication -----------------------------------------------------
# The format (packed rows) and the torch reference are zero_strategy/engine/comm/quantize.py's; these run
# cuda/quantize.cu when the kernels take the tensors, and return False (having done nothing) when
# they do not, so the caller runs the reference.

def _row_bytes(what: str, numel: int, bits: int, block: int, codes_len: int) -> int:
    """Bytes of a packed row of ``numel`` elements: ``codes_len`` of codes, then an fp32 scale per block.
    The kernels write and read exactly there, so a layout that does not fit fails here, not past a buffer."""
    if codes_len < -(-numel * bits // 8):
        raise ValueError(f"{what}: {codes_len} code bytes cannot hold {numel} codes of {bits} bits; pass "
                         "code_bytes(numel, spec) (zero_strategy/engine/comm/quantize.py).")
    return codes_len + 4 * -(-numel // block)


def _packed_shape(what: str, packed: torch.Tensor, numel: int, bits: int, block: int, codes_len: int) -> tuple:
    """The (rows, numel, block, row bytes, codes bytes) arguments the dequantizing kernels start with,
    once ``packed`` is found to hold rows of that layout."""
    np = _np()
    rows, row_bytes = packed.shape
    if row_bytes != _row_bytes(what, numel, bits, block, codes_len):
        raise ValueError(f"{what}: packed rows of {row_bytes} bytes do not hold {numel} elements at {bits} bits "
                         f"in blocks of {block} ({_row_bytes(what, numel, bits, block, codes_len)} bytes); pass the "
                         "rows quantize_rows made for these elements.")
    return np.int64(rows), np.int64(numel), np.int64(block), np.int64(row_bytes), np.int64(codes_len)


@torch.no_grad()
def quantize_rows(x: torch.Tensor, bits: int, block: int, out: torch.Tensor, codes_len: int,
                  seed: Optional[torch.Tensor] = None) -> bool:
    """Packed rows of ``x`` (rows, L) into ``out`` (rows, row bytes; uint8), ``bits`` 8 or 4 per code,
    ``block`` elements per scale, the codes taking ``codes_len`` bytes of a row. ``seed``: a device
    int64 tensor, rounding stochastically with draws hashed from it; None: to nearest."""
    typed = [([x], tuple(CUDA_TYPE_NAMES)), ([out], (torch.uint8,)), ([seed], (torch.int64,))]
    if x.dim() != 2 or not _kernels_take(x, typed):
        return False
    rows, numel = x.shape
    nblocks, qmax, name = -(-numel // block), 2 ** (bits - 1) - 1, CUDA_TYPE_NAMES[x.dtype]
    shape = (rows, _row_bytes("quantize_rows", numel, bits, block, codes_len))
    if out.dim() != 2 or tuple(out.shape) != shape:  # the kernels write every byte of that shape
        raise ValueError(f"quantize_rows: out must be uint8 of shape {shape} for x of shape {tuple(x.shape)}; got "
                         f"{tuple(out.shape)}. Allocate it with packed_row_bytes (zero_strategy/engine/comm/quantize.py).")
    np = _np()
    row_bytes, device = out.shape[1], x.device
    launch("quantize", f"quant_scales<{name}>", device, rows * nblocks, THREADS, (
        np.uint64(x.data_ptr()), np.int64(numel), np.int64(block), np.int64(nblocks), np.int32(qmax),
        np.uint64(out.data_ptr()), np.int64(row_bytes), np.int64(codes_len)))
    launch("quantize", f"quant_codes<{name}, {bits}>", device, -(-rows * codes_len // THREADS), THREADS, (
        np.uint64(x.data_ptr()), np.int64(rows), np.int64(numel), np.int64(block), np.int32(qmax),
        np.uint64(0 if seed is None else seed.data_ptr()), np.uint64(out.data_ptr()), np.int64(row_bytes),
        np.int64(codes_len)))
    return True


@torch.no_grad()
def dequantize_rows(packed: torch.Tensor, numel: int, bits: int, block: int, codes_len: int,
                    out: torch.Tensor) -> bool:
    """``out`` (rows, ``numel``, rows may be strided; fp32, bf16 or fp16) = the values of ``packed``:
    written straight into the caller's buffer, in its dtype."""
    if out.dim() != 2 or out.stride(1) != 1 or not _kernels_take(packed, [([packed], (torch.uint8,)),
                                                                           ([out.select(0, 0)], tuple(CUDA_TYPE_NAMES))]):
        return False
    np, shape = _np(), _packed_shape("dequantize_rows", packed, numel, bits, block, codes_len)
    if tuple(out.shape) != (packed.shape[0], numel):  # the kernel writes a row of numel per packed row
        raise ValueError(f"dequantize_rows: out must be of shape {(packed.shape[0], numel)} (a row of {numel} "
                         f"elements per packed row); got {tuple(out.shape)}.")
    grid = -(-packed.shape[0] * numel // THREADS)
    launch("quantize", f"dequant_rows<{CUDA_TYPE_NAMES[out.dtype]}, {bits}>", packed.device, grid, THREADS, (
        np.uint64(packed.data_ptr()), *shape, np.uint64(out.data_ptr()), np.int64(out.stride(0))))
    return True


@torch.no_grad()
def dequantize_sum(packed: torch.Tensor, numel: int, bits: int, block: int, codes_len: int,
                   out: torch.Tensor) -> bool:
    """``out`` (``numel`` fp32) = the sum over rows of ``packed``'s values, in fp32, row 0 first."""
    if not _kernels_take(packed, [([packed], (torch.uint8,)), ([out], (torch.float32,))]):
        return False
    np, shape = _np(), _packed_shape("dequantize_sum", packed, numel, bits, block, codes_len)
    if out.numel() != numel:
        raise ValueError(f"dequantize_sum: out must have {numel} elements (the sum of the rows); got {out.numel()}.")
    launch("quantize", f"dequant_sum<{bits}>", packed.device, -(-numel // THREADS), THREADS, (
        np.uint64(packed.data_ptr()), *shape, np.uint64(out.data_ptr())))
    return True
