"""The low-precision state encodings of engine/optim/lowp.py, checked against what they promise rather
than against themselves: the int8 round trip stays within its stated bound on random and
adversarial blocks, stochastic rounding is unbiased and reproducible by position, and one int8
AdamW step through ``step_stored`` equals an 8-bit AdamW written here from the published algorithm."""

from __future__ import annotations

import math

import pytest
import torch

from zero_strategy.engine.optim.lowp import (Bf16State, Int8State, code_map, max_code_gap, random_bits16, round_to_bf16,
                                             step_stored)
from zero_strategy.engine.optim.tiles import step_views


def _blocks(signed: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    normal = torch.randn(1000, generator=g)
    spread = torch.randn(1000, generator=g) * 10.0 ** torch.randint(-9, 3, (1000,), generator=g)  # Adam's v
    outlier = torch.full((512,), 1e-6)
    outlier[17] = 1e3  # one huge element beside tiny ones
    blocks = {"normal": normal, "spread": spread, "outlier": outlier, "zeros": torch.zeros(300),
              "equal": torch.full((256,), 3.25), "tiny": torch.full((256,), 1e-30), "short": torch.randn(7, generator=g)}
    if not signed:
        blocks = {k: v.abs() for k, v in blocks.items()}
    else:
        blocks["alternating"] = torch.tensor([(-1.0) ** i * 2.0**-i for i in range(40)])
    return blocks


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("block", [256, 64])
def test_the_int8_round_trip_stays_within_its_bound(signed, block):
    gap = max_code_gap(signed)
    for name, x in _blocks(signed).items():
        state = Int8State.empty(x.numel(), signed, block)
        state.encode_(x)
        back = state.decode()
        padded = torch.cat([x, x.new_zeros(-x.numel() % block)]).view(-1, block)
        scale = padded.abs().amax(dim=1).repeat_interleave(block)[: x.numel()]
        bound = scale * gap / 2 * (1 + 1e-6)
        assert bool(((back - x).abs() <= bound).all()), name
        exact = (x == 0) | (x.abs() == scale)  # zeros and each block's largest element are kept exactly
        assert torch.equal(back[exact], x[exact]), name


def test_the_maps_are_ascending_and_spread_over_orders_of_magnitude():
    for signed in (True, False):
        m = code_map(signed)
        assert m.numel() == 256 and bool((m[1:] >= m[:-1]).all()) and m.max() == 1.0
        positive = m[m > 0]
        assert positive.min() < 1e-6  # a linear map's smallest step would be 1/127
    assert (code_map(True) < 0).sum() == 127 and (code_map(False) < 0).sum() == 0
    with pytest.raises(ValueError, match="unsigned int8 map stores non-negative"):
        Int8State.empty(4, signed=False).encode_(torch.tensor([1.0, -1.0, 0.0, 2.0]))


def test_stochastic_rounding_is_unbiased_and_never_more_than_one_step_off():
    lo = torch.tensor(1.0, dtype=torch.bfloat16)
    hi = torch.tensor(1.0 + 2.0**-7, dtype=torch.bfloat16)  # the bf16 after 1.0
    for fraction in (0.001, 0.1, 0.37, 0.5, 0.9):
        x = torch.tensor(float(lo) + fraction * (float(hi) - float(lo)))
        n = 20000
        rounded = round_to_bf16(x.repeat(n), True, seed=3, step=1).float()  # n positions, n draws
        assert bool(((rounded == float(lo)) | (rounded == float(hi))).all())
        mean = float(rounded.mean())
        sigma = (float(hi) - float(lo)) * math.sqrt(fraction * (1 - fraction) / n)
        assert abs(mean - float(x)) < 5 * sigma + 1e-12, fraction
        assert float(round_to_bf16(x.view(1), False)) in (float(lo), float(hi))  # to nearest: one of the two


def test_stochastic_rounding_depends_on_the_position_not_on_the_tensor():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1000, generator=g)
    whole = round_to_bf16(x, True, seed=5, step=7, key=11, start=100)
    halves = torch.cat([round_to_bf16(x[:400], True, seed=5, step=7, key=11, start=100),
                        round_to_bf16(x[400:], True, seed=5, step=7, key=11, start=500)])
    assert torch.equal(whole, halves)  # the same element at the same step, in any layout
    assert not torch.equal(whole, round_to_bf16(x, True, seed=5, step=8, key=11, start=100))
    assert not torch.equal(whole, round_to_bf16(x, True, seed=5, step=7, key=12, start=100))
    exact = x.to(torch.bfloat16).float()
    assert torch.equal(round_to_bf16(exact, True, seed=5, step=7), exact.to(torch.bfloat16))  # representable: kept
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), torch.finfo(torch.bfloat16).max])
    out = round_to_bf16(special, True, seed=1, step=1).float()
    assert out[0] == float("inf") and out[1] == float("-inf") and out[2].isnan() and math.isfinite(out[3])
    bits = random_bits16(0, 0, 0, 0, 1 << 16)
    assert int(bits.min()) >= 0 and int(bits.max()) < 1 << 16 and abs(float(bits.float().mean()) / 65535 - 0.5) < 0.01


# ---- one 8-bit AdamW step against the published algorithm --------------------------------------


def _reference_quantize(x: torch.Tensor, signed: bool, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise quantization as the paper states it: per block, normalise by the absolute maximum
    and take the code of the nearest value of the map; written with a plain nearest search."""
    values = code_map(signed)
    codes, scales = [], []
    for b in x.split(block):
        s = b.abs().max()
        scales.append(s)
        normal = b / s if s > 0 else b
        distance = (normal[:, None] - values[None, :]).abs()
        codes.append(distance.argmin(dim=1))  # the first nearest: the lower of two equidistant codes
    return torch.cat(codes), torch.stack(scales)


def _reference_dequantize(codes, scales, signed: bool, block: int) -> torch.Tensor:
    return code_map(signed)[codes] * scales.repeat_interleave(block)[: codes.numel()]


def test_one_int8_adamw_step_equals_the_published_8bit_adamw():
    g = torch.Generator().manual_seed(2)
    n, block = 700, 64
    p0, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    m0, v0 = torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 10.0 ** torch.randint(-8, -1, (n,),
                                                                                                       generator=g)
    lr, (b1, b2), eps, wd, t = 1e-3, (0.9, 0.999), 1e-8, 0.01, 5
    hyper = dict(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)

    # the reference: dequantize, the AdamW update in fp32 (Loshchilov & Hutter; each operation as torch
    # writes it, so the fp32 results are the same bits), quantize
    mc, ms = _reference_quantize(m0, True, block)
    vc, vs = _reference_quantize(v0, False, block)
    m, v = _reference_dequantize(mc, ms, True, block), _reference_dequantize(vc, vs, False, block)
    m = torch.lerp(m, grad, 1 - b1)  # b1 * m + (1 - b1) * g
    v = torch.addcmul(v * b2, grad, grad, value=1 - b2)  # b2 * v + (1 - b2) * g * g
    want_p = p0 * (1 - lr * wd)
    denom = v.sqrt() / math.sqrt(1 - b2**t) + eps
    want_p = want_p - (lr / (1 - b1**t)) * (m / denom)
    want_m = _reference_dequantize(*_reference_quantize(m, True, block), True, block)
    want_v = _reference_dequantize(*_reference_quantize(v, False, block), False, block)

    # the engine's way: decode into scratch, torch's AdamW over it, encode back
    stored = {"exp_avg": Int8State.empty(n, True, block), "exp_avg_sq": Int8State.empty(n, False, block)}
    stored["exp_avg"].encode_(m0)
    stored["exp_avg_sq"].encode_(v0)
    param = p0.clone()

    def torch_step(state):
        new = step_views(torch.optim.AdamW, {"foreach": False}, [(param, grad, (0, hyper), state)])
        return new[param]

    scalars = step_stored(stored, {"step": torch.tensor(float(t - 1))}, torch_step)
    assert float(scalars["step"]) == t
    # the bias corrections: torch computes them from its tensor step count in fp32, the reference in fp64
    torch.testing.assert_close(param, want_p, rtol=1e-6, atol=0)
    assert torch.equal(stored["exp_avg"].decode(), want_m) and torch.equal(stored["exp_avg_sq"].decode(), want_v)


def test_bf16_state_writes_round_stochastically_and_count_two_bytes():
    state = Bf16State(torch.zeros(1000, dtype=torch.bfloat16), stochastic=True, key=3)
    x = torch.full((1000,), 1.0 + 2.0**-9)  # a quarter of the way from 1 to the next bf16
    state.encode_(x, seed=0, step=0)
    ups = int((state.decode() > 1.0).sum())
    assert 180 < ups < 320 and state.nbytes == 2000  # about a quarter round up
    nearest = Bf16State(torch.zeros(1000, dtype=torch.bfloat16), stochastic=False)
    nearest.encode_(x)
    assert bool((nearest.decode() == 1.0).all())


@pytest.mark.parametrize("moments", ["int8", "bf16"])
@pytest.mark.parametrize("master", [torch.float32, torch.bfloat16])
def test_the_cuda_kernels_reference_is_the_engines_torch_step(moments, master):
    """kernels.reference.adam_lowp_step (what cuda/adam_lowp.cu must match) equals decoding, torch's own
    AdamW over fp32 scratch (step_stored) and encoding, with the master rounded stochastically."""
    from zero_strategy.kernels import reference

    g = torch.Generator().manual_seed(4)
    n, key, start, seed, step_count = 600, 9, 1000, 5, 3
    p0, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    m0, v0 = torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 1e-3

    def stored():
        if moments == "int8":
            out = {"exp_avg": Int8State.empty(n, True), "exp_avg_sq": Int8State.empty(n, False)}
        else:
            out = {name: Bf16State(torch.empty(n, dtype=torch.bfloat16), key=key, start=start, slot=slot)
                   for slot, name in ((1, "exp_avg"), (2, "exp_avg_sq"))}
        out["exp_avg"].encode_(m0, seed, 0) if moments == "bf16" else out["exp_avg"].encode_(m0)
        out["exp_avg_sq"].encode_(v0, seed, 0) if moments == "bf16" else out["exp_avg_sq"].encode_(v0)
        return out

    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    mine, theirs = stored(), stored()
    param = p0.to(master).float().clone()
    ref_param = p0.to(master).clone()

    def torch_step(state):
        return step_views(torch.optim.AdamW, {"foreach": False}, [(param, grad, (0, hyper), state)])[param]

    step_stored(mine, {"step": torch.tensor(2.0)}, torch_step, seed=seed, step_count=step_count)
    if master == torch.bfloat16:
        param = round_to_bf16(param, True, seed, step_count, key, start)
    reference.adam_lowp_step([ref_param], [grad], [theirs["exp_avg"]], [theirs["exp_avg_sq"]], [3.0], keys=[key],
                             starts=[start], seed=seed, step_count=step_count, lr=1e-2, beta1=0.9, beta2=0.99,
                             eps=1e-8, weight_decay=0.1, decoupled=True)
    assert torch.equal(ref_param, param.to(master))
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(theirs[name].decode(), mine[name].decode()), name
