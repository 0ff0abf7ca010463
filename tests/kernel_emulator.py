"""The CUDA kernels of cuda/*.cu emulated on host memory, so their launch path runs without a GPU.

Without a GPU the CUDA code cannot run, but everything around it can: the engine's choice of the
fused path, the dtype grouping, the tensor-list table and the argument order of every launch. This
emulator replaces ``zero_strategy.kernels.ops.launch`` and reads the table and the arguments exactly
as cuda/*.cu does (addresses included: CPU tensors' memory), so a table or argument mistake fails
here. Numerics are the kernels' formulas in torch fp32, in the kernels' order of operations.

    with emulated_kernels() as launched:     # a Counter: kernel name -> launches
        ...                                  # CPU tensors now take the kernels' path
    emulated_device                          # the same as a pytest fixture

[Note: what the emulator patches]
``available`` says whether a tensor's operations would run the kernels; it is bound by name in three
modules (the package face, ops.py and optimizer.py), and every one is patched, so the engine (which
asks ``zero_strategy.kernels.available``) and the kernel functions agree that CPU tensors take the
CUDA path, unless the backend is forced to torch (``set_backend("torch")``), as on a GPU.
``ops.launch`` is the one place a kernel starts; the emulator counts each launch by its full name
(``adam_step<bf16_t, bf16_t>``: the gradient and output dtypes the launch read and wrote).
Everything is put back on exit, so a pooled worker process (tests/distributed.py) is left as it was.

[Note: the emulator's address check]
The emulator writes through raw addresses into host memory, as the kernels write into device memory.
An address whose tensor was freed before the launch (a temporary whose only reference was dropped
while its address sat in a table) or a length past a tensor's end would write into glibc's heap
here, corrupting it for whatever runs next in the process (a pooled worker runs other test files
after this one), and into another tensor's memory on a GPU. So every byte range the emulator reads
or writes must lie inside a tensor that the launching function holds at the launch (its locals:
tensors, and lists, tuples and dicts of them, two levels deep: the per-role lists of a table), and
a range that does not fails the launch, naming the kernel and the range.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections import Counter
from typing import Any, Iterator, Optional

import pytest
import torch

_TYPES = {"float": torch.float32, "bf16_t": torch.bfloat16, "f16_t": torch.float16, "no_out_t": None}
_ROLES = {"fused_adam": (5, 2), "fused_sgd": (4, 0), "grad_norm": (1, 0)}
"""Per source: (pointer roles, float64 scalar rows) of its table, as in the .cu file's enums."""


_held: Optional[list[tuple[int, int]]] = None
"""While a kernel is emulated: the [start, end) byte ranges of the tensors its launcher holds
(see [Note: the emulator's address check])."""
_launching = ""  # the kernel being emulated, for the check's message


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``t``'s elements span: from its first element to just past its last (strides included)."""
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def held_ranges(values: Any, depth: int = 3) -> list[tuple[int, int]]:
    """The extents of the host tensors among ``values`` (a frame's locals), in lists, tuples and dicts
    down to ``depth`` levels."""
    found: list[tuple[int, int]] = []
    if isinstance(values, torch.Tensor):
        if values.device.type == "cpu" and values.numel():
            found.append(_extent(values))
    elif depth and isinstance(values, (list, tuple, dict)):
        for v in values.values() if isinstance(values, dict) else values:
            found.extend(held_ranges(v, depth - 1))
    return found


def _memory(address: int, dtype: torch.dtype, begin: int, end: int) -> torch.Tensor:
    """Elements [begin, end) of the ``dtype`` array at ``address`` (host memory), as a tensor over it,
    once the range is found inside a tensor the launcher holds (see [Note: the emulator's address check])."""
    size = torch.empty(0, dtype=dtype).element_size()
    start, stop = int(address) + begin * size, int(address) + end * size
    if _held is None:
        raise AssertionError("the emulator reads memory only inside a launch (emulated_kernels' launch), which "
                             "knows the tensors the launcher holds")
    if not any(lo <= start and stop <= hi for lo, hi in _held):
        raise AssertionError(
            f"{_launching}: bytes [{start:#x}, {stop:#x}) ({stop - start} bytes of {dtype}) lie inside no tensor "
            "the launching function holds: a freed tensor's address, or a length past a tensor's end. On a GPU "
            "the kernel would write into other memory; keep every tensor whose address is in the table or the "
            "arguments alive until the launch, and check the lengths against the tensors.")
    raw = (ctypes.c_char * (stop - start)).from_address(start)
    return torch.frombuffer(raw, dtype=dtype)


def _blocks(table: torch.Tensor, n: int, roles: int, scalars: int, chunk: int):
    """(tensor index, begin, end, flags, row) of every block, found as the CUDA code finds them."""
    row = lambda r: table[r * n : (r + 1) * n]  # noqa: E731
    first = table[(roles + 2 + scalars) * n : (roles + 2 + scalars) * n + n + 1].tolist()
    for b in range(first[-1]):
        t = max(i for i in range(n) if first[i] <= b)
        begin = (b - first[t]) * chunk
        yield t, begin, min(begin + chunk, int(row(roles)[t])), int(row(roles + 1)[t]), row


def _grad_norm_final(args) -> None:
    partials, flags, count, max_mode, total, nonfinite = args
    p = _memory(partials, torch.float32, 0, int(count)).double()
    _memory(total, torch.float32, 0, 1)[0] = (p.max() if max_mode else p.sum()).float()
    _memory(nonfinite, torch.bool, 0, 1)[0] = bool(_memory(flags, torch.uint8, 0, int(count)).any())


_MASK64 = (1 << 64) - 1


def _uniform01(seed: int, index: torch.Tensor) -> torch.Tensor:
    """cuda/quantize.cu's uniform01: splitmix64 of (seed, index), its top 24 bits over 2**24."""
    def wrap(v: int) -> int:  # a uint64 as torch's int64 holds it
        return v - (1 << 64) if v >= 1 << 63 else v

    def shr(z: torch.Tensor, k: int) -> torch.Tensor:  # logical shift right of uint64 bits held in int64
        return (z >> k) & ((1 << (64 - k)) - 1)

    z = wrap(seed & _MASK64) + (index + 1) * wrap(0x9E3779B97F4A7C15)  # int64 arithmetic wraps as uint64 does
    z = (z ^ shr(z, 30)) * wrap(0xBF58476D1CE4E5B9)
    z = (z ^ shr(z, 27)) * wrap(0x94D049BB133111EB)
    z = z ^ shr(z, 31)
    return shr(z, 40).to(torch.float32) / 16777216.0


def _emulate_quantize(name: str, grid: int, block: int, args) -> None:
    """The kernels of cuda/quantize.cu on host memory, reading their arguments as the CUDA code does."""
    from zero_strategy.engine.comm.quantize import QuantSpec, reference_dequantize_rows  # noqa: PLC0415

    kernel, _, params = name.partition("<")
    params = [p.strip() for p in params.rstrip(">").split(",")]
    if kernel == "quant_scales":
        x, numel, qblock, nblocks, qmax, out, row_bytes, codes_len = (int(a) for a in args)
        rows = grid // nblocks
        assert grid == rows * nblocks, f"{name}: grid {grid} is not rows x {nblocks} blocks"
        values = _memory(x, _TYPES[params[0]], 0, rows * numel).float().view(rows, numel)
        padded = torch.zeros(rows, nblocks * qblock)
        padded[:, :numel] = values
        scales = padded.view(rows, nblocks, qblock).abs().amax(dim=2) / qmax
        for r in range(rows):
            _memory(out + r * row_bytes + codes_len, torch.float32, 0, nblocks).copy_(scales[r])
        return
    if kernel == "quant_codes":
        x, rows, numel, qblock, qmax, seed, out, row_bytes, codes_len = (int(a) for a in args)
        bits = int(params[1])
        assert grid == -(-rows * codes_len // block), f"{name}: grid {grid} for {rows} rows of {codes_len} code bytes"
        nblocks = -(-numel // qblock)
        values = _memory(x, _TYPES[params[0]], 0, rows * numel).float().view(rows, numel)
        scales = torch.stack([_memory(out + r * row_bytes + codes_len, torch.float32, 0, nblocks) for r in range(rows)])
        scale = scales.repeat_interleave(qblock, dim=1)[:, :numel]
        usable = (scale > 0) & scale.isfinite()
        q = torch.where(usable, values / torch.where(usable, scale, torch.ones_like(scale)), torch.zeros_like(values))
        if seed:
            index = torch.arange(rows * numel, dtype=torch.int64).view(rows, numel)
            q = torch.floor(q + _uniform01(int(_memory(seed, torch.int64, 0, 1)[0]), index))
        else:
            q = torch.round(q)
        codes = q.clamp(-qmax, qmax).to(torch.int8)
        for r in range(rows):
            row = _memory(out + r * row_bytes, torch.uint8, 0, codes_len)
            row.zero_()
            if bits == 8:
                row[:numel] = codes[r].view(torch.uint8)
            else:
                nibbles = (codes[r] + 8).to(torch.uint8).view(-1, 2)
                row[: numel // 2] = nibbles[:, 0] | (nibbles[:, 1] << 4)
        return
    packed, rows, numel, qblock, row_bytes, codes_len = (int(a) for a in args[:6])
    bits = int(params[-1])
    rows_in = torch.stack([_memory(packed + r * row_bytes, torch.uint8, 0, row_bytes) for r in range(rows)])
    values = reference_dequantize_rows(rows_in, numel, QuantSpec(bits, qblock))
    if kernel == "dequant_rows":
        out, stride = int(args[6]), int(args[7])
        assert grid == -(-rows * numel // block), f"{name}: grid {grid} for {rows} x {numel} elements"
        for r in range(rows):
            _memory(out, _TYPES[params[0]], r * stride, r * stride + numel).copy_(values[r])
    else:
        assert kernel == "dequant_sum" and grid == -(-numel // block), f"{name}: grid {grid} for {numel} elements"
        acc = torch.zeros(numel)
        for r in range(rows):  # row 0 first, as the kernel sums
            acc += values[r]
        _memory(int(args[6]), torch.float32, 0, numel).copy_(acc)


def emulate(stem: str, name: str, device: torch.device, grid: int, block: int, args) -> None:
    """Run kernel ``name`` of ``cuda/<stem>.cu`` on host memory; the signature of ``ops.launch``."""
    if stem == "quantize":
        _emulate_quantize(name, grid, block, args)
        return
    types = [_TYPES[a.strip()] for a in name.partition("<")[2].rstrip(">").split(",")] if "<" in name else []
    if name == "grad_norm_final":
        _grad_norm_final(args)
        return
    table_address, n, chunk = int(args[0]), int(args[1]), int(args[2])
    roles, scalars = _ROLES[stem]
    length = (roles + 2 + scalars) * n + n + 1
    table = _memory(table_address, torch.int64, 0, length).clone()
    grid_seen = 0
    for t, begin, end, flags, row in _blocks(table, n, roles, scalars, chunk):
        grid_seen += 1
        arr = lambda role, dtype: _memory(int(row(role)[t]), dtype, begin, end)  # noqa: E731
        if stem == "grad_norm":
            max_mode, partials, flag_out, offset = args[3:]
            x = arr(0, types[0]).float()
            b = grid_seen - 1 + int(offset)
            _memory(partials, torch.float32, b, b + 1)[0] = x.abs().max() if max_mode else x.square().sum()
            _memory(flag_out, torch.uint8, b, b + 1)[0] = int(not torch.isfinite(x).all())
            continue
        scale = float(args[3]) * (float(_memory(args[4], torch.float32, 0, 1)[0]) if int(args[4]) else 1.0)
        g = arr(1, types[0]).float() * scale
        p = arr(0, torch.float32)
        if stem == "fused_adam":
            omb1, beta2, omb2, eps, wd, decay, decoupled, maximize = (float(a) for a in args[5:])
            g = -g if maximize else g
            if wd:
                if decoupled:
                    p.mul_(decay)
                else:
                    g = g + wd * p
            step_size, bc2 = (float(table[(roles + 2 + s) * n + t].view(torch.float64)) for s in range(2))
            m, v = arr(2, torch.float32), arr(3, torch.float32)
            m.lerp_(g, omb1)
            v.mul_(beta2).addcmul_(g, g, value=omb2)
            p.addcdiv_(m, v.sqrt() / bc2 + eps, value=-step_size)
            out_role = 4
        else:
            lr, momentum, omd, wd, nesterov, maximize = (float(a) for a in args[5:])
            g = -g if maximize else g
            g = g + wd * p if wd else g
            if momentum:
                buf = arr(2, torch.float32)
                buf.copy_(g) if flags & 2 else buf.mul_(momentum).add_(g, alpha=omd)
                g = g + momentum * buf if nesterov else buf
            p.add_(g, alpha=-lr)
            out_role = 3
        if types[1] is not None:
            arr(out_role, types[1]).copy_(p)
    assert grid_seen == grid, f"{name}: launched with grid {grid}, but its table describes {grid_seen} blocks"


@contextlib.contextmanager
def emulated_kernels() -> Iterator[Counter]:
    """CPU tensors take the CUDA kernels' path, run by ``emulate``; yields the launches by kernel name.
    See [Note: what the emulator patches]."""
    import zero_strategy.kernels as face  # noqa: PLC0415  (the package face: what the engine asks)
    from zero_strategy.kernels import loader, ops, optimizer  # noqa: PLC0415

    launched: Counter = Counter()

    def launch(stem, name, device, grid, block, args):
        global _held, _launching
        if grid:
            launched[name] += 1
            _held, _launching = held_ranges(sys._getframe(1).f_locals), name  # the caller: the ops.py function
            try:
                emulate(stem, name, device, grid, block, args)
            finally:
                _held, _launching = None, ""

    def available(tensor: torch.Tensor) -> bool:  # loader.available, with host memory standing in for CUDA
        return loader.backend() == "auto"

    patches = [(face, "available", available), (ops, "available", available), (optimizer, "available", available),
               (ops, "launch", launch)]
    saved = [(module, attr, getattr(module, attr)) for module, attr, _ in patches]
    try:
        for module, attr, value in patches:
            setattr(module, attr, value)
        yield launched
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


@pytest.fixture
def emulated_device() -> Iterator[Counter]:
    """``emulated_kernels()`` for one test; the value is its Counter of launches."""
    with emulated_kernels() as launched:
        yield launched
