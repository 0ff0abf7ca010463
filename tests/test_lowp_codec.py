"""The compiled CPU codec (zero_strategy/kernels/int8_codec.c) gives the torch code's bits.

Each case runs the same call twice, once with the torch code forced (``set_backend("torch")``) and
once with the C codec, and compares every byte written: int8 codes and scales, bf16 values. The
inputs are random tensors and adversarial ones: every midpoint of both maps and its fp32 neighbours
scaled into blocks, signed zeros, subnormals, infinities, NaNs, blocks of zeros, short last blocks.
"""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from zero_strategy import kernels
from zero_strategy.engine.optim import lowp
from zero_strategy.kernels import cpu_codec

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) to build the CPU codec")


@pytest.fixture(autouse=True)
def _auto_backend():
    yield
    kernels.set_backend(None)


def _both(fn):
    """``fn()`` under the torch code, then under the C codec (which must be built)."""
    kernels.set_backend("torch")
    with_torch = fn()
    kernels.set_backend("auto")
    assert cpu_codec.library() is not None, "the C codec did not build (see the log's warning)"
    return with_torch, fn()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits; a NaN's own bits are the one thing allowed to differ (NaN compares as NaN)."""
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    as_int = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return torch.equal(a.masked_fill(nan, 0).view(as_int), b.masked_fill(nan, 0).view(as_int))


def _adversarial(signed: bool, block: int) -> torch.Tensor:
    """Every midpoint of the map and its two fp32 neighbours, scaled by assorted block maxima, plus the
    special values, in blocks that each hold their own maximum."""
    mids = lowp._midpoints(signed)
    around = torch.cat([mids, torch.nextafter(mids, torch.tensor(-2.0)), torch.nextafter(mids, torch.tensor(2.0))])
    if not signed:
        around = around.clamp_min(0)
    scales = torch.tensor([1.0, 3.0e-5, 7.5e3, 1.0e-38, 2.0**-140])
    pieces = []
    for s in scales:
        values = (around * s).reshape(-1)
        for lo in range(0, values.numel(), block - 1):
            chunk = values[lo: lo + block - 1]
            pieces.append(torch.cat([chunk, s.reshape(1)]))  # the block's largest: s
    special = torch.tensor([0.0, -0.0, 1e-45, 1e-40, 3.4e38, float("inf"), float("nan")])
    if signed:
        special = torch.cat([special, -special])
    pieces += [special, torch.full((block,), -0.0 if not signed else 0.0), torch.zeros(block), special[:3]]
    return torch.cat(pieces)


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
@pytest.mark.parametrize("block", [64, 256])
def test_int8_encode_and_decode_give_the_torch_codes_scales_and_values(signed, block):
    g = torch.Generator().manual_seed(3)
    random = torch.randn(5 * block + 17, generator=g) * torch.logspace(-6, 2, 5 * block + 17)
    cases = [_adversarial(signed, block), random if signed else random.square()]
    for values in cases:
        n = values.numel()

        def run():
            state = lowp.Int8State.empty(n + block, signed, block)  # one block more: the range starts at lo
            state.encode_range_(block, values)
            return state.codes.clone(), state.scales.clone(), state.decode_range(block, block + n)

        for a, b in zip(*_both(run)):
            assert _same_bits(a, b)


def test_an_unsigned_encode_of_a_negative_value_raises_either_way():
    values = torch.tensor([1.0, 2.0, -1e-30, 0.5])
    for backend in ("torch", "auto"):
        kernels.set_backend(backend)
        with pytest.raises(ValueError, match="negative value needs the signed map"):
            lowp.Int8State.empty(4, signed=False, block=64).encode_range_(0, values)


@pytest.mark.parametrize("start", [0, 1000, 2**40 + 3])
def test_stochastic_bf16_rounding_gives_the_torch_bits(start):
    g = torch.Generator().manual_seed(start % 97)
    x = torch.randn(4099, generator=g) * torch.logspace(-30, 30, 4099)
    x[:12] = torch.tensor([float("inf"), -float("inf"), float("nan"), 3.3895e38, -3.3895e38, 3.4028e38, 0.0, -0.0,
                           1e-40, -1e-40, 1e-45, 65504.0])
    x[12:14] = torch.tensor([0x7F800001, -0x7F800001], dtype=torch.int32).view(torch.float32)  # NaNs whose
    # payload rounds up into an infinity's bits when rounded to nearest as plain bits: NaN stays NaN

    def run():
        whole = lowp.round_to_bf16(x, True, seed=5, step=9, key=77, start=start, slot=2)
        into = torch.empty(2 * x.numel(), dtype=torch.bfloat16)[::2]  # a strided target: the general path
        lowp.round_to_bf16(x, True, seed=5, step=9, key=77, start=start, slot=2, out=into)
        return whole, into.clone()

    for a, b in zip(*_both(run)):
        assert _same_bits(a, b)


def test_calls_on_several_threads_give_the_bits_of_one():
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # three threads, the last one's share short (see [Note: the codec's threads])
    try:
        g = torch.Generator().manual_seed(11)
        n = 3 * cpu_codec.PART_NUMEL + 1000 + 37
        x = torch.randn(n, generator=g) * torch.logspace(-8, 3, n)

        def run():
            signed = lowp.Int8State.empty(n, True)
            signed.encode_(x)
            unsigned = lowp.Int8State.empty(n, False)
            unsigned.encode_(x.square())
            rounded = lowp.round_to_bf16(x, True, seed=1, step=2, key=3, start=12345, slot=1)
            return (signed.codes.clone(), signed.scales.clone(), signed.decode(), unsigned.codes.clone(),
                    unsigned.scales.clone(), unsigned.decode(), rounded)

        for a, b in zip(*_both(run)):
            assert _same_bits(a, b)
        kernels.set_backend("auto")
        with pytest.raises(ValueError, match="negative value needs the signed map"):  # in the last thread's share
            lowp.Int8State.empty(n, False).encode_(torch.cat([x[:-1].square(), torch.tensor([-1.0])]))
    finally:
        torch.set_num_threads(threads)


def test_without_a_compiler_it_warns_once_and_the_torch_code_runs(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("ZERO_STRATEGY_CACHE", str(tmp_path / "cache"))
    cpu_codec._library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_codec.__name__):
            assert cpu_codec.library() is None
            assert cpu_codec.library() is None
        warnings = [r.getMessage() for r in caplog.records if r.name == cpu_codec.__name__]
        assert len(warnings) == 1 and "no C compiler" in warnings[0] and "no-such-cc" in warnings[0]
        state = lowp.Int8State.empty(256, signed=True)
        values = torch.randn(256)
        state.encode_(values)
        assert (state.decode() - values).abs().max() <= state.scales[0] * lowp.max_code_gap(True) / 2
    finally:
        cpu_codec._library.cache_clear()


def test_the_library_is_built_into_the_cache_named_by_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ZERO_STRATEGY_CACHE", str(tmp_path))
    cpu_codec._library.cache_clear()
    try:
        assert cpu_codec.library() is not None
        built = list(tmp_path.glob("int8_codec-*.so"))
        assert len(built) == 1 and not list(tmp_path.glob("*.tmp"))
    finally:
        cpu_codec._library.cache_clear()
