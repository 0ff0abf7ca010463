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
import sys
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
"""The code table is indexed by the top 18 bits of an fp32's order key (sign, exponent, 9 mantissa bits)."""
_LOW_BITS = (1 << _TABLE_SHIFT) - 1
_HALF = 1 << (31 - _TABLE_SHIFT)  # bins of negative keys come first in the table


def _order_key(bits: torch.Tensor) -> torch.Tensor:
    """fp32 bits (int32) as an int32 that orders like the values: negative values' magnitude bits flipped."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@functools.lru_cache(maxsize=None)
def _code_table(signed: bool) -> torch.Tensor:
    """``nearest_codes``'s table (see [Note: the code table]): per bin, ``limit << 8 | code``."""
    keys = torch.arange(-(1 << 31), 1 << 31, 1 << _TABLE_SHIFT, dtype=torch.int64)  # each bin's lowest key
    lowest = _order_key(keys.to(torch.int32)).view(torch.float32)  # the key function is its own inverse
    mids = _midpoints(signed)
    base = torch.bucketize(lowest, mids, out_int32=True)
    highest = _order_key((keys + _LOW_BITS).to(torch.int32)).view(torch.float32)
    above = torch.bucketize(highest, mids, out_int32=True)
    finite = torch.isfinite(lowest) & torch.isfinite(highest)
    assert bool((above[finite] - base[finite] <= 1).all()), "a bin holds at most one midpoint"
    # the midpoint in a bin that has one: values up to it (keys up to its key) keep ``base``, the rest take one more
    inside = finite & (above > base)
    mid_key = _order_key(mids[base.clamp(max=mids.numel() - 1).long()].contiguous().view(torch.int32))
    limit = torch.where(inside, mid_key & _LOW_BITS, torch.full_like(base, _LOW_BITS))
    base = torch.where(finite, base, torch.bucketize(torch.zeros(1), mids, out_int32=True))  # NaN: zero's code
    return ((limit << 8) | base).to(torch.int32)


def nearest_codes(normal: torch.Tensor, signed: bool, out: Optional[torch.Tensor] = None,
                  checked_nonnegative: bool = False) -> torch.Tensor:
    """The code of each value of ``normal`` (fp32 in [-1, 1]): how many midpoints of the map lie
    strictly below it, as ``torch.bucketize(normal, midpoints)`` gives, found with a table (into
    ``out``, uint8, when given; else an int32 tensor).

    [Note: the code table]
    The fp32 order key (the bits, with a negative value's magnitude bits flipped) orders like the
    values. Every fp32 with the same top 18 key bits lies in one bin, at most 2**-9 of its magnitude
    wide; the maps' neighbouring codes are at least 0.7% of their magnitude apart, so a bin holds at
    most one midpoint. One gather from a table of 2**18 int32 gives the code of the bin's lowest value
    and the low 14 key bits of the bin's midpoint (all ones where it has none): a value whose low key
    bits are above that takes one code more. Integer arithmetic only (a sign bit from a subtraction,
    no comparisons or ``where``: on CPU those are several times slower). ``tests/test_lowp_engine.py``
    checks it against bucketize on every midpoint and its fp32 neighbours.

    ``checked_nonnegative``: the caller knows no value is below zero (-0.0 and NaN may be there): under
    the unsigned map the plain bits then give the same codes (a non-negative value's key is its bits;
    anything with the sign bit set lands in bins of negative keys, whose code is 0, zero's) and the key's
    three passes are skipped."""
    table = _code_table(signed).to(normal.device)
    bits = normal.contiguous().view(torch.int32)
    key = bits if checked_nonnegative and not signed else _order_key(bits)
    index = key >> _TABLE_SHIFT
    index += _HALF
    packed = torch.index_select(table, 0, index.view(-1))
    low = (key & _LOW_BITS if key is bits else key.bitwise_and_(_LOW_BITS)).view(-1)  # ``normal`` kept
    limit = packed >> 8
    limit -= low
    limit >>= 31  # -1 where the value lies above the bin's midpoint
    packed &= 0xFF
    packed -= limit
    if out is None:
        return packed.view(normal.shape)
    return out.view(-1).copy_(packed)  # an int32 subtraction and a narrowing copy: faster than sub(out=uint8)


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
        return self.decode_range(0, self.numel, out)

    def decode_range(self, lo: int, hi: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Values ``[lo, hi)`` (``lo`` a multiple of the block), fp32, into ``out`` when given: one gather
        from the 256 values of the map, one multiply by the scales."""
        n = hi - lo
        values = torch.empty(n, dtype=torch.float32, device=self.codes.device) if out is None else out.view(-1)
        codes = self.codes[lo:hi]
        scales = self.scales[lo // self.block: -(-hi // self.block)]
        if _compiled_codec(values, codes):  # one pass, the same bits: see [Note: the compiled CPU codec]
            _cpu_codec().decode(codes, scales, _device_map(self.signed, codes.device), values, self.block)
            return values if out is None else out
        pairs_fit = n % 2 == 0 and lo % 2 == 0 and values.data_ptr() % 8 == 0
        if pairs_fit and codes.device.type == "cpu":  # two codes per gather (on CUDA a gather is not the cost)
            pairs = codes.view(torch.uint16).to(torch.int32)
            torch.index_select(_pair_map(self.signed, codes.device), 0, pairs, out=values.view(torch.int64))
        else:
            torch.index_select(_device_map(self.signed, codes.device), 0, codes.to(torch.int32), out=values)
        full = n // self.block
        values[: full * self.block].view(full, self.block).mul_(scales[:full, None])
        if full * self.block < n:
            values[full * self.block:].mul_(scales[full])
        return values if out is None else out

    def encode_(self, x: torch.Tensor) -> None:
        """Store ``x`` (fp32, ``numel`` elements) in place of the current values."""
        if x.numel() != self.numel:
            raise ValueError(f"encode_: {x.numel()} values for a state of {self.numel} elements")
        self.encode_range_(0, x)

    def encode_range_(self, lo: int, x: torch.Tensor, scratch: Optional[torch.Tensor] = None) -> None:
        """Store ``x`` (fp32) as elements ``[lo, lo + x.numel())`` (``lo`` a multiple of the block);
        ``scratch``: an fp32 buffer for the normalised values (used when it holds the range rounded up to
        whole blocks; else one is made). Raises for a negative value under the unsigned map."""
        x = x.detach().reshape(-1)
        if x.dtype != torch.float32:
            x = x.float()
        n = x.numel()
        if _compiled_codec(x, self.codes):
            whole = -(-n // self.block)
            scales, codes = self.scales[lo // self.block: lo // self.block + whole], self.codes[lo: lo + n]
            table = _code_table(self.signed)
            if not _cpu_codec().encode(x.contiguous(), self.block, self.signed, table, scales, codes):
                raise ValueError(_NEGATIVE_UNSIGNED)
            return
        pad = -n % self.block
        blocks = (torch.cat([x, x.new_zeros(pad)]) if pad else x).view(-1, self.block)
        scales = self.scales[lo // self.block: lo // self.block + blocks.shape[0]]
        normal = (torch.empty(n + pad, dtype=torch.float32, device=x.device)
                  if scratch is None or scratch.numel() < n + pad else scratch.view(-1)[: n + pad])
        if self.signed:  # the magnitudes go through the scratch, which the normalised values overwrite
            torch.amax(torch.abs(blocks, out=normal.view(-1, self.block)), dim=1, out=scales)
        else:
            torch.amax(blocks, dim=1, out=scales)
            scales += 0.0  # a block of zeros' scale is +0.0 even where its maximum was -0.0 (as the C codec's)
            if bool((torch.amin(blocks, dim=1) < 0).any()):  # one sync per range: the map has no negative codes
                raise ValueError(_NEGATIVE_UNSIGNED)
        safe = torch.where(scales > 0, scales, 1.0)  # a block of zeros: its codes are zero's
        torch.div(blocks, safe[:, None], out=normal.view(-1, self.block))
        nearest_codes(normal[:n], self.signed, out=self.codes[lo: lo + n], checked_nonnegative=not self.signed)


_NEGATIVE_UNSIGNED = ("the unsigned int8 map stores non-negative state (a second moment); a negative value needs "
                      "the signed map")


def _cpu_codec() -> Any:
    from ...kernels import cpu_codec  # noqa: PLC0415  (zero_strategy.kernels imports this module)

    return cpu_codec


def _compiled_codec(values: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the compiled C codec takes these fp32 values (and the tensors written beside them: int8
    codes) (see [Note: the compiled CPU codec])."""
    return values.dtype == torch.float32 and _cpu_codec().usable(values, *others)


@functools.lru_cache(maxsize=None)
def _device_map(signed: bool, device: torch.device) -> torch.Tensor:
    return code_map(signed).to(device)


@functools.lru_cache(maxsize=None)
def _pair_map(signed: bool, device: torch.device) -> torch.Tensor:
    """The values of every pair of codes, as one int64 (2**16 entries, 512 KiB): two adjacent codes read
    as one little-endian uint16 give both values in one gather, about twice as fast as one gather each."""
    assert sys.byteorder == "little", "the pair table reads two codes as a little-endian uint16"
    values = code_map(signed)
    index = torch.arange(1 << 16)
    pairs = torch.stack([values[index & 0xFF], values[index >> 8]], dim=1).contiguous()  # (2**16, 2) fp32
    return pairs.view(torch.int64).reshape(-1).to(device)


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


def sr_base(seed: int, step: int, key: int, slot: int = 0) -> int:
    """What the random bits of one state tensor at one step start from (cuda/adam_lowp.cu mixes it the
    same way): ``slot`` tells a parameter's state tensors apart (0: the master, 1 and 2: Adam's moments)."""
    return _signed64((seed * 0x100000001B3 ^ step * 0x9E3779B1 ^ key * 0x85EBCA77) ^ slot)


_POSITIONS: dict[torch.device, torch.Tensor] = {}


def _golden_positions(numel: int, device: Any) -> torch.Tensor:
    """``arange(numel) * golden`` (int64, wrapping), kept per device and grown as needed: the position's
    share of splitmix64's first step, the same at every step."""
    device = torch.device(device)
    have = _POSITIONS.get(device)
    if have is None or have.numel() < numel:
        have = _POSITIONS[device] = torch.arange(max(numel, 1 << 17), dtype=torch.int64, device=device) * _GOLDEN
    return have[:numel]


def random_bits16(seed: int, step: int, key: int, start: int, numel: int, device: Any = "cpu",
                  slot: int = 0) -> torch.Tensor:
    """16 random bits (int32 in [0, 65536)) per position ``start...start+numel-1``: a splitmix64 hash of
    (seed, step, key, slot, position), the same for a position whatever tensor it is computed in.

    Bits 40...55 of splitmix64's output. Its last step, ``z ^ (z >> 31)``, changes bits 0...32 only,
    so those bits are bits 40...55 of the value before it: the torch code skips that step (and its
    int64 pass), giving cuda/adam_lowp.cu's bits."""
    z = _golden_positions(numel, device) + _signed64(start * 0x9E3779B97F4A7C15 + sr_base(seed, step, key, slot))
    shifted = z >> 30
    shifted &= (1 << 34) - 1  # a logical shift (torch's >> keeps the sign)
    z ^= shifted
    z *= _MIX1  # wraps modulo 2**64, as splitmix64 means it to
    torch.bitwise_right_shift(z, 27, out=shifted)
    shifted &= (1 << 37) - 1
    z ^= shifted
    z *= _MIX2
    if sys.byteorder == "little":  # bits 40...55 are bits 8...23 of the high int32 word
        bits = z.view(torch.int32)[1::2] >> 8
    else:
        bits = (z >> 40).to(torch.int32)
    return bits.bitwise_and_(0xFFFF)


_SAFE_FOR_RANDOM_BITS = float(torch.tensor(0x7F7F0000, dtype=torch.int32).view(torch.float32))
"""The largest bf16: adding 16 bits below it to a smaller magnitude's fp32 bits stays finite."""


def round_to_bf16(x: torch.Tensor, stochastic: bool, seed: int = 0, step: int = 0, key: int = 0,
                  start: int = 0, slot: int = 0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x`` (fp32) as bf16 (into ``out``, bf16, when given): stochastically rounded when ``stochastic``,
    else to nearest. Infinities and NaNs round to nearest (adding bits could turn the largest finite value
    into infinity: it stays)."""
    if not stochastic:
        return x.to(torch.bfloat16) if out is None else out.copy_(x)
    flat = x.detach().reshape(-1)
    if flat.dtype != torch.float32:
        flat = flat.float()
    flat = flat.contiguous()
    if _compiled_codec(flat):  # one pass, the same bits: see [Note: the compiled CPU codec]
        direct = out is not None and out.dtype == torch.bfloat16 and out.is_contiguous()
        target = out if direct else torch.empty(flat.shape, dtype=torch.bfloat16)
        _cpu_codec().bf16_stochastic(flat, start * 0x9E3779B97F4A7C15 + sr_base(seed, step, key, slot), target)
        if out is None:
            return target.view_as(x)
        return out if direct else out.copy_(target.view_as(out))
    bits = flat.view(torch.int32)
    noisy = random_bits16(seed, step, key, start, flat.numel(), flat.device, slot)
    noisy += bits
    plain = flat.device.type == "cpu" and sys.byteorder == "little" and flat.numel() > 0
    if plain:  # one sync on CPU (free there) saves the where of the general case
        plain = max(float(flat.amax()), -float(flat.amin())) < _SAFE_FOR_RANDOM_BITS
    if plain:  # every value finite and far from overflow: bf16 is the high half of the noisy bits
        target = torch.empty(flat.shape, dtype=torch.bfloat16, device=flat.device) if out is None else out
        target.view(-1).view(torch.int16).copy_(noisy.view(torch.int16)[1::2])
        return target.view_as(x) if out is None else out
    noisy &= ~0xFFFF
    rounded = noisy.view(torch.float32)
    keep = torch.isfinite(rounded) & torch.isfinite(flat)
    result = torch.where(keep, rounded, flat).to(torch.bfloat16)  # exact: the low 16 bits are zero
    if out is None:
        return result.view_as(x)
    return out.copy_(result.view_as(out))


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
        self.encode_range_(0, x, seed, step)

    def decode_range(self, lo: int, hi: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.values[lo:hi].float() if out is None else out.copy_(self.values[lo:hi])

    def encode_range_(self, lo: int, x: torch.Tensor, seed: int = 0, step: int = 0) -> None:
        """Store ``x`` as elements ``[lo, lo + x.numel())`` (their random bits are those of their positions)."""
        target = self.values[lo: lo + x.numel()]
        round_to_bf16(x, self.stochastic, seed, step, self.key, self.start + lo, self.slot, out=target)


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
