"""Optimizer state stored in fewer bytes: block-wise int8 codes, and bf16 with stochastic rounding.

The arithmetic of a step stays the user's optimizer's, in fp32: a tile's stored state is decoded
into fp32 scratch, torch's update runs on it, and the result is encoded back (see
``step_stored``). This file holds the encodings and that tile step; choosing them per optimizer
and storing them per piece is the step backend's.

[Note: int8 state]
A state tensor is cut into blocks of ``block`` elements; each block keeps one fp32 scale, its
largest magnitude, and one byte per element: the index of the code nearest to the element over
the scale. The codes are a "dynamic" map in the manner of the published 8-bit optimizers (Dettmers
et al., 8-bit Optimizers via Block-wise Quantization, 2022): after the sign bit (signed map only),
the number of leading zero bits is a decimal exponent, the first one bit ends it, and the bits
after it are a fraction, linear in [0.1, 1). So values from about 1e-7 to 1 of the scale keep a
few significant bits each, where a linear map would round everything below 1/127 of the block's
largest to zero: Adam's second moment spans many orders of magnitude in one block. The first
moment takes the signed map, the second (never negative) the unsigned one, which spends the sign
bit on one more exponent. The largest code is exactly 1, so a block's largest element is exact.
Error bound of one element x of a block with scale s: |x - decode(encode(x))| <= s * gap / 2,
where gap is the widest spacing between neighbouring codes of the map (``max_code_gap``); and it
is exact for x = 0 and |x| = s.

[Note: stochastic rounding]
bf16 keeps the top 16 bits of an fp32. Rounding to nearest drops an update smaller than half a
bf16 step every time, so a weight stops moving (the complaint behind DeepSpeed #5784). Stochastic
rounding adds 16 random bits to the 16 bits about to be dropped, then truncates: it rounds up with
probability equal to the dropped fraction, so the rounding is unbiased and small updates add up on
average. The random bits are a hash of (seed, step, key, element position): the same parameter
element at the same step gets the same bits on any world size and in any stage's layout, so
parity across them holds bit for bit; ``key`` tells parameters apart (say, a hash of the name) and
``start`` is the position of the tensor's first element in its parameter.

[Note: blocks that survive a reshard] (the plan for the step backend that stores int8 state)
A checkpoint stores state per parameter range, and a reshard moves the ranges' ends. An int8
block cut by a shard's end in one layout but not in another would have other scales there, and a
resumed run other codes. So blocks are counted from the parameter's first element (block i holds
its elements [i * block, (i + 1) * block)), and the layout puts every parameter's first element and
every shard's end at a multiple of ``block`` of the flat buffer (padding each parameter to a whole
number of blocks: at most block - 1 elements per parameter). Then every block lies in one piece
in any layout, and the checkpoint stores each piece's codes and scales as they are: a reshard moves
whole blocks, exactly.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

DEFAULT_BLOCK = 256
"""Elements per int8 block: 4 bytes of scale per 256 codes is 1.6% more than the codes alone."""


# ---- the dynamic code maps (see [Note: int8 state]) --------------------------------------------


def _magnitudes(exponent_bits: int) -> list[float]:
    """Every magnitude of a dynamic map over ``exponent_bits`` bits (the sign bit excluded), 0 first."""
    values = [0.0]
    for zeros in range(exponent_bits):
        fraction_bits = exponent_bits - 1 - zeros
        edges = torch.linspace(0.1, 1.0, 2**fraction_bits + 1, dtype=torch.float64)
        values += [float(v) * 10.0**-zeros for v in (edges[:-1] + edges[1:]) / 2]
    values = sorted(values)
    values[-1] = 1.0  # the block's largest element, its scale, is stored exactly
    return values


@functools.lru_cache(maxsize=None)
def code_map(signed: bool) -> torch.Tensor:
    """The 256 values of the signed (first moment) or unsigned (second moment) map, ascending, fp32."""
    if signed:
        mags = _magnitudes(7)  # 128 values: 0 and 127 magnitudes
        values = [-m for m in reversed(mags[1:])] + mags  # 127 negative, 0, 127 positive: 255 codes
        values.append(1.0)  # one spare code, a duplicate of the largest (never chosen first)
    else:
        values = _magnitudes(8)  # 0 and 255 magnitudes
    out = torch.tensor(values, dtype=torch.float64)
    assert out.numel() == 256
    return out.to(torch.float32)


@functools.lru_cache(maxsize=None)
def _midpoints(signed: bool) -> torch.Tensor:
    m = code_map(signed).to(torch.float64)
    return ((m[1:] + m[:-1]) / 2).to(torch.float32)


_TABLE_SHIFT = 14
"""The code table is indexed by an fp32's top 18 bits (sign, exponent, 9 mantissa bits)."""


@functools.lru_cache(maxsize=None)
def _code_table(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(table, bounds) of ``encode_``'s fast search (see [Note: the code table])."""
    idx = torch.arange(1 << (32 - _TABLE_SHIFT), dtype=torch.int64) << _TABLE_SHIFT
    edge = torch.where(idx >= 1 << 31, idx - (1 << 32), idx).to(torch.int32).view(torch.float32)
    mids = _midpoints(signed)
    table = torch.bucketize(torch.nan_to_num(edge, nan=0.0), mids, out_int32=True)
    bounds = torch.cat([torch.tensor([-math.inf]), mids, torch.tensor([math.inf])])
    return table, bounds


def nearest_codes(normal: torch.Tensor, signed: bool) -> torch.Tensor:
    """The code of each value of ``normal`` (fp32 in [-1, 1]): how many midpoints of the map lie
    strictly below it, as ``torch.bucketize(normal, midpoints)`` gives, found with a table.

    [Note: the code table]
    Every fp32 with the same top 18 bits lies in one bin [edge, next edge) (magnitudes; the edge is
    the value truncated toward zero), at most 2**-9 of its magnitude wide. The maps' neighbouring
    codes are at least 0.7% of their magnitude apart, so a bin holds at most one midpoint: the code
    is the edge's code (a table of 2**18 entries, made once by bucketize), plus one where a positive
    value lies above the next midpoint, less one where a negative value lies at or below the
    midpoint before. ``tests/test_lowp_engine.py`` checks it against bucketize on every midpoint
    and its fp32 neighbours."""
    table, bounds = _code_table(signed)
    table, bounds = table.to(normal.device), bounds.to(normal.device)
    bits = normal.contiguous().view(torch.int32)
    base = table[(bits >> _TABLE_SHIFT) & ((1 << (32 - _TABLE_SHIFT)) - 1)]  # int32 indices: no int64 copies
    above = torch.where(bits >= 0, normal > bounds[base + 1], False)
    below = torch.where(bits < 0, normal <= bounds[base], False)
    return torch.where(above, base + 1, torch.where(below, base - 1, base))


def max_code_gap(signed: bool) -> float:
    """The widest spacing between neighbouring values of a map (the error bound's ``gap``)."""
    m = code_map(signed).to(torch.float64)
    return float((m[1:] - m[:-1]).max())


# ---- block-wise int8 ---------------------------------------------------------------------------


@dataclass
class Int8State:
    """One state tensor (1-D, ``numel`` elements) as block-wise codes and fp32 scales."""

    codes: torch.Tensor  # uint8, numel
    scales: torch.Tensor  # fp32, one per block
    signed: bool
    block: int

    @classmethod
    def empty(cls, numel: int, signed: bool, block: int = DEFAULT_BLOCK, device: Any = "cpu") -> "Int8State":
        blocks = -(-numel // block)
        return cls(torch.zeros(numel, dtype=torch.uint8, device=device),
                   torch.zeros(blocks, dtype=torch.float32, device=device), signed, block)

    @property
    def numel(self) -> int:
        return self.codes.numel()

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 4

    def decode(self, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The values, fp32 (into ``out`` when given)."""
        values = code_map(self.signed).to(self.codes.device)[self.codes.long()]
        values = _per_block(values, self.block).mul_(self.scales[:, None]).reshape(-1)[: self.numel]
        if out is None:
            return values
        return out.copy_(values)

    def encode_(self, x: torch.Tensor) -> None:
        """Store ``x`` (fp32, ``numel`` elements) in place of the current values."""
        if x.numel() != self.numel:
            raise ValueError(f"encode_: {x.numel()} values for a state of {self.numel} elements")
        if not self.signed and bool((x < 0).any()):
            raise ValueError("the unsigned int8 map stores non-negative state (a second moment); a negative value "
                             "needs the signed map")
        blocks = _per_block(x.detach().float().reshape(-1), self.block)
        scales = blocks.abs().amax(dim=1)
        self.scales.copy_(scales)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        normal = (blocks / safe[:, None]).reshape(-1)[: self.numel]
        self.codes.copy_(nearest_codes(normal, self.signed).to(torch.uint8))  # torch.bucketize's, faster


def _per_block(flat: torch.Tensor, block: int) -> torch.Tensor:
    """``flat`` as (blocks, block), the last block padded with zeros."""
    pad = -flat.numel() % block
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block)


# ---- bf16 with stochastic rounding (see [Note: stochastic rounding]) ---------------------------


def _signed64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = (_signed64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 (torch's ``>>`` keeps the sign)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def sr_base(seed: int, step: int, key: int, slot: int = 0) -> int:
    """What the random bits of one state tensor at one step start from (cuda/adam_lowp.cu mixes it the
    same way): ``slot`` tells a parameter's state tensors apart (0: the master, 1 and 2: Adam's moments)."""
    return _signed64((seed * 0x100000001B3 ^ step * 0x9E3779B1 ^ key * 0x85EBCA77) ^ slot)


def random_bits16(seed: int, step: int, key: int, start: int, numel: int, device: Any = "cpu",
                  slot: int = 0) -> torch.Tensor:
    """16 random bits (int32 in [0, 65536)) per position ``start...start+numel-1``: a splitmix64 hash of
    (seed, step, key, slot, position), the same for a position whatever tensor it is computed in."""
    base = sr_base(seed, step, key, slot)
    z = torch.arange(start, start + numel, dtype=torch.int64, device=device)
    z = z * _GOLDEN + base  # wraps modulo 2**64, as splitmix64 means it to
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    z = z ^ _shift_right(z, 31)
    return (_shift_right(z, 40) & 0xFFFF).to(torch.int32)


def round_to_bf16(x: torch.Tensor, stochastic: bool, seed: int = 0, step: int = 0, key: int = 0,
                  start: int = 0, slot: int = 0) -> torch.Tensor:
    """``x`` (fp32) as bf16: stochastically rounded when ``stochastic``, else to nearest. Infinities and
    NaNs round to nearest (adding bits could turn the largest finite value into infinity: it stays)."""
    if not stochastic:
        return x.to(torch.bfloat16)
    flat = x.detach().float().reshape(-1).contiguous()
    bits = flat.view(torch.int32)
    noisy = (bits + random_bits16(seed, step, key, start, flat.numel(), flat.device, slot)) & ~0xFFFF
    rounded = noisy.view(torch.float32)
    keep = torch.isfinite(rounded) & torch.isfinite(flat)
    out = torch.where(keep, rounded, flat).to(torch.bfloat16)  # exact: the low 16 bits are zero
    return out.view_as(x)


@dataclass
class Bf16State:
    """One state tensor stored as bf16, rounded stochastically (or to nearest) on every write."""

    values: torch.Tensor  # bf16
    stochastic: bool = True
    key: int = 0  # which parameter (see random_bits16)
    start: int = 0  # the position of values[0] in the parameter
    slot: int = 0  # which of the parameter's state tensors (0: the master, 1 and 2: Adam's moments)

    @property
    def nbytes(self) -> int:
        return self.values.numel() * 2

    def decode(self, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.values.float() if out is None else out.copy_(self.values)

    def encode_(self, x: torch.Tensor, seed: int = 0, step: int = 0) -> None:
        self.values.copy_(round_to_bf16(x, self.stochastic, seed, step, self.key, self.start, self.slot))


# ---- a tile's step over stored state -----------------------------------------------------------

Stored = Any  # Int8State or Bf16State


def step_stored(stored: dict[str, Stored], scalars: dict[str, Any], step: Callable[[dict[str, Any]], dict[str, Any]],
                seed: int = 0, step_count: int = 0) -> dict[str, Any]:
    """Decode ``stored`` (name -> Int8State/Bf16State) into fp32 scratch, run ``step`` on the state dict
    (scratch tensors and the one-number ``scalars``), which returns the new state, and encode its
    tensors back. Returns the new one-number state. ``seed`` and ``step_count`` pick the random bits of
    stochastic rounding (see [Note: stochastic rounding])."""
    scratch: dict[str, Any] = {name: s.decode() for name, s in stored.items()}
    new = step({**scalars, **scratch})
    out = {}
    for name, value in new.items():
        if name in stored:
            target = stored[name]
            if isinstance(target, Bf16State):
                target.encode_(value, seed, step_count)
            else:
                target.encode_(value)
        else:
            out[name] = value
    return out


def stored_bytes(stored: Sequence[Stored]) -> int:
    """Bytes the stored state holds (codes and scales, or bf16 values)."""
    return sum(s.nbytes for s in stored)
