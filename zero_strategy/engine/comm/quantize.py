"""Block-wise int8/int4 quantization for communication: the packed format, the torch reference (what
runs on CPU), and the dispatch to cuda/quantize.cu (what runs on CUDA with CuPy; see [Note: kernels
or reference]).

[Note: packed rows]
What travels is a *packed row* of bytes per chunk of a collective (one row per rank's chunk), so a
quantized collective is one ordinary collective of uint8 rows:

    [ codes: ceil(L * bits / 8) bytes, zero-padded to a multiple of 4 | scales: nblocks x fp32 ]

for a chunk of L elements cut into ``nblocks = ceil(L / block)`` blocks of ``block`` consecutive
elements (the last one may be shorter). Each block has one fp32 scale, ``absmax / qmax`` (qmax = 127
for int8, 7 for int4), and its elements become ``round(x / scale)`` clamped to ``[-qmax, qmax]``
(round half to even, or stochastically: see [Note: stochastic rounding of blocks]; a block of zeros has scale 0
and codes 0). int8 codes are stored as int8 bytes;
int4 codes as ``code + 8`` in a nibble, element 2i in the low nibble of byte i and 2i+1 in the high
one (L must then be even). Dequantizing is ``code * scale`` in fp32. Scales are fp32 whatever the
data's dtype: a bf16 scale would add its own rounding (8 bits of mantissa) to every element.

``packed_row_bytes`` is the one definition of a row's size: the collectives send it and the
communication model (zero_strategy/comm_model.py) counts it, so the two agree to the byte.

Rounded to nearest, the same codes come out on every rank for the same input (the same torch ops
on the same device type), which is what makes a quantized all-gather give every rank the same weights.

[Note: stochastic rounding of blocks]
Gradients are rounded stochastically instead (``noise``: a generator): down or up with the
probabilities that make each code's expectation the value itself (QSGD's unbiased rounding). To
nearest, int4 turns every element under 1/14 of its block's largest into 0, on every rank and every
step: the small gradients of a block with one large one are lost, not just blurred, and a GPT on the
standard library ended 200 steps 1.4% above the unquantized run's validation loss (1.2% with blocks
of 64, 1.5% of 32), against 0.1% rounded stochastically. The draws come from the reducer's own
generator, seeded by rank, so runs repeat and the user's random streams (dropout, data order) are
untouched.

[Note: kernels or reference]
``quantize_rows``, ``dequantize_rows``, ``dequantize_into`` and ``dequantize_sum`` run the CUDA kernels
of cuda/quantize.cu when zero_strategy.kernels takes the tensors (CUDA, CuPy, contiguous rows of
fp32/bf16/fp16), and the ``reference_*`` functions below otherwise. Rounded to nearest, both give the
same bytes (the same fp32 divisions and round-half-to-even); the sums agree within fp32 rounding.
Rounded stochastically they draw differently (torch's generator here, a hash of a seed drawn from
that generator there), both unbiased. ``dequantize_into`` writes the values straight into the
gathered buffer in its dtype: on CUDA the copy-out of a quantized all-gather is the dequantizing
kernel itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import kernels

BITS = (8, 4)
_SCALE_BYTES = 4  # fp32


@dataclass(frozen=True)
class QuantSpec:
    """How a chunk is quantized: ``bits`` per element (8 or 4) and elements per scale (``block``)."""

    bits: int
    block: int

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"bits={self.bits!r}: block-wise quantization supports {BITS} bits per element.")
        if type(self.block) is not int or self.block < 1:
            raise ValueError(f"block={self.block!r} must be a positive integer (elements per scale).")

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1  # symmetric: 127 or 7, so that -code is a code too


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def code_bytes(numel: int, spec: QuantSpec) -> int:
    """Bytes of the codes of a chunk of ``numel`` elements, padded so the scales start 4-byte aligned."""
    return _round_up(-(-numel * spec.bits // 8), _SCALE_BYTES)


def num_blocks(numel: int, spec: QuantSpec) -> int:
    return -(-numel // spec.block)


def packed_row_bytes(numel: int, spec: QuantSpec) -> int:
    """Bytes of one packed row of ``numel`` elements (see [Note: packed rows])."""
    return code_bytes(numel, spec) + _SCALE_BYTES * num_blocks(numel, spec)


def quantize_rows(x: torch.Tensor, spec: QuantSpec, out: torch.Tensor | None = None,
                  noise: torch.Generator | None = None) -> torch.Tensor:
    """Packed rows (rows, packed_row_bytes(L)) of uint8 from ``x`` of shape (rows, L), any float dtype;
    see ``reference_quantize_rows``, and [Note: kernels or reference] for what runs."""
    out = _check_quantize_args(x, spec, out)
    seed = None
    if noise is not None and kernels.available(x):  # the kernel hashes a seed drawn on the device: no sync
        seed = torch.randint(0, 2**62, (1,), generator=noise, device=noise.device).to(x.device)
    if kernels.ops.quantize_rows(x, spec.bits, spec.block, out, code_bytes(x.shape[1], spec), seed):
        return out
    return reference_quantize_rows(x, spec, out, noise)


def _check_quantize_args(x: torch.Tensor, spec: QuantSpec, out: torch.Tensor | None) -> torch.Tensor:
    """``out``, checked, or a new one of the right shape."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows takes (rows, elements), got shape {tuple(x.shape)}")
    rows, numel = x.shape
    if spec.bits == 4 and numel % 2:
        raise ValueError(f"int4 packs two elements per byte: a row of {numel} elements must be even")
    row_bytes = packed_row_bytes(numel, spec)
    if out is None:
        return torch.empty((rows, row_bytes), dtype=torch.uint8, device=x.device)
    if out.shape != (rows, row_bytes) or out.dtype != torch.uint8:
        raise ValueError(f"out must be uint8 of shape {(rows, row_bytes)}, got {out.dtype} {tuple(out.shape)}")
    return out


def reference_quantize_rows(x: torch.Tensor, spec: QuantSpec, out: torch.Tensor | None = None,
                            noise: torch.Generator | None = None) -> torch.Tensor:
    """Packed rows (rows, packed_row_bytes(L)) of uint8 from ``x`` of shape (rows, L), any float dtype.

    ``out`` (uint8, that shape) receives them when given. ``noise``: round stochastically with draws
    from this generator (see [Note: stochastic rounding of blocks]); None: to nearest.
    """
    out = _check_quantize_args(x, spec, out)
    rows, numel = x.shape
    nb, codes_len = num_blocks(numel, spec), code_bytes(numel, spec)
    padded = torch.zeros((rows, nb * spec.block), dtype=torch.float32, device=x.device)
    padded[:, :numel] = x
    blocks = padded.view(rows, nb, spec.block)  # (rows, nblocks, block)
    scales = blocks.abs().amax(dim=2) / spec.qmax  # (rows, nblocks)
    divided = torch.where(scales.unsqueeze(2) > 0, blocks / scales.unsqueeze(2), torch.zeros_like(blocks))
    if noise is None:
        codes = torch.round(divided)
    else:  # up with probability frac(x / scale): the expectation is x / scale
        codes = torch.floor(divided + torch.rand(divided.shape, generator=noise, device=divided.device))
    codes = codes.clamp_(-spec.qmax, spec.qmax)
    codes = codes.view(rows, -1)[:, :numel].to(torch.int8)  # (rows, L)
    out[:, codes_len:] = scales.contiguous().view(torch.uint8).view(rows, -1)
    if spec.bits == 8:
        out[:, :numel] = codes.view(torch.uint8)
        out[:, numel:codes_len] = 0
    else:
        nibbles = (codes + 8).to(torch.uint8).view(rows, numel // 2, 2)
        out[:, : numel // 2] = nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)
        out[:, numel // 2 : codes_len] = 0
    return out


def _check_packed(packed: torch.Tensor, numel: int, spec: QuantSpec) -> None:
    row_bytes = packed.shape[1]
    if row_bytes != packed_row_bytes(numel, spec):
        raise ValueError(f"packed rows of {row_bytes} bytes do not hold {numel} elements at {spec} "
                         f"({packed_row_bytes(numel, spec)} bytes)")


def dequantize_rows(packed: torch.Tensor, numel: int, spec: QuantSpec) -> torch.Tensor:
    """fp32 values (rows, ``numel``) of packed rows made by ``quantize_rows``."""
    out = torch.empty((packed.shape[0], numel), dtype=torch.float32, device=packed.device)
    return dequantize_into(packed, numel, spec, out)


def dequantize_into(packed: torch.Tensor, numel: int, spec: QuantSpec, out: torch.Tensor) -> torch.Tensor:
    """``out`` (rows, ``numel``: a view of a gathered buffer, say; fp32, bf16 or fp16) = the values of
    ``packed``, rounded to ``out``'s dtype; returns ``out``."""
    _check_packed(packed, numel, spec)
    if not kernels.ops.dequantize_rows(packed, numel, spec.bits, spec.block, code_bytes(numel, spec), out):
        out.copy_(reference_dequantize_rows(packed, numel, spec))
    return out


def reference_dequantize_rows(packed: torch.Tensor, numel: int, spec: QuantSpec) -> torch.Tensor:
    """fp32 values (rows, ``numel``) of packed rows, in torch."""
    _check_packed(packed, numel, spec)
    rows = packed.shape[0]
    nb, codes_len = num_blocks(numel, spec), code_bytes(numel, spec)
    scales = packed[:, codes_len:].contiguous().view(torch.float32)  # (rows, nblocks)
    if spec.bits == 8:
        codes = packed[:, :numel].contiguous().view(torch.int8).to(torch.float32)
    else:
        pairs = packed[:, : numel // 2]
        low, high = (pairs & 0x0F).to(torch.int8) - 8, (pairs >> 4).to(torch.int8) - 8
        codes = torch.stack((low, high), dim=2).view(rows, numel).to(torch.float32)
    padded = torch.zeros((rows, nb * spec.block), dtype=torch.float32, device=packed.device)
    padded[:, :numel] = codes
    return (padded.view(rows, nb, spec.block) * scales.unsqueeze(2)).view(rows, -1)[:, :numel]


def dequantize_sum(packed: torch.Tensor, numel: int, spec: QuantSpec) -> torch.Tensor:
    """The sum over rows of the dequantized packed rows, in fp32: shape (``numel``,). Reducing after
    dequantizing, in fp32, keeps each contribution's error its own (see [Note: quantized reduce-scatter]
    in engine/comm/collectives.py)."""
    _check_packed(packed, numel, spec)
    out = torch.empty(numel, dtype=torch.float32, device=packed.device)
    if kernels.ops.dequantize_sum(packed, numel, spec.bits, spec.block, code_bytes(numel, spec), out):
        return out
    return reference_dequantize_rows(packed, numel, spec).sum(dim=0)
