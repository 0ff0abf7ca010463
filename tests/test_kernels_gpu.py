"""The CUDA kernels against their torch references, on a GPU with CuPy (skipped elsewhere).

Every output is poisoned (NaN) before each kernel run, so an element the kernel forgets shows up.
Run with benchmarks/gpu_check.sh, or: PYTHONPATH=. python -m pytest tests/test_kernels_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from zero_strategy import kernels
from zero_strategy.kernels import reference
from zero_strategy.kernels.loader import cupy_module

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or cupy_module() is None,
                                reason="needs a CUDA device and CuPy")

SIZES = [0, 1, 7, 4097, (1 << 20) + 3]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OUT_DTYPES = [None, torch.bfloat16, torch.float16]
NAN = float("nan")


def _randn(n, seed, dtype=torch.float32, scale=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(n, generator=gen, device="cuda") * scale).to(dtype)


def _poisoned_like(tensors, dtype=None):
    return [None if t is None else torch.full_like(t, NAN, dtype=dtype or t.dtype) for t in tensors]


def _copy_into(dsts, srcs):
    for d, s in zip(dsts, srcs):
        if d is not None:
            d.copy_(s)


def _close(a, b, dtype=torch.float32):
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(a, b, equal_nan=False, **tol)


def test_kernels_are_used_here():
    assert kernels.available(torch.zeros(1, device="cuda"))


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
def test_adam_kernel_matches_reference(grad_dtype, out_dtype, decoupled):
    params = [_randn(n, i) for i, n in enumerate(SIZES)]
    grads = [_randn(n, 100 + i, grad_dtype) for i, n in enumerate(SIZES)]
    m0 = [_randn(n, 200 + i, scale=0.1) for i, n in enumerate(SIZES)]
    v0 = [_randn(n, 300 + i).abs() * 0.01 for i, n in enumerate(SIZES)]
    steps = [1, 2, 5, 10, 1000]  # per-tensor step counts
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=decoupled,
                 grad_scale=torch.tensor(0.5, device="cuda"))
    results = []
    for fn in (kernels.adam_step, reference.adam_step):
        p, m, v = _poisoned_like(params), _poisoned_like(m0), _poisoned_like(v0)  # poison, then fill
        _copy_into(p, params), _copy_into(m, m0), _copy_into(v, v0)
        outs = [torch.full_like(x, NAN, dtype=out_dtype) for x in params] if out_dtype else None
        fn(p, grads, m, v, steps, lowp_out=outs, **hyper)
        results.append((p, m, v, outs))
    (p, m, v, outs), (rp, rm, rv, routs) = results
    for a, b in zip(p + m + v, rp + rm + rv):
        _close(a, b)
    if out_dtype is not None:
        for a, b in zip(outs, routs):
            _close(a.float(), b.float(), out_dtype)
            assert not a.isnan().any()


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("options", [dict(momentum=0.0), dict(momentum=0.9, dampening=0.1, weight_decay=0.01),
                                     dict(momentum=0.9, nesterov=True, maximize=True)], ids=str)
def test_sgd_kernel_matches_reference(grad_dtype, out_dtype, options):
    params = [_randn(n, i) for i, n in enumerate(SIZES)]
    grads = [_randn(n, 100 + i, grad_dtype) for i, n in enumerate(SIZES)]
    bufs0 = [None, None] + [_randn(n, 200 + i) for i, n in enumerate(SIZES[2:])]  # first step for two tensors
    results = []
    for fn in (kernels.sgd_step, reference.sgd_step):
        p = _poisoned_like(params)
        _copy_into(p, params)
        bufs = _poisoned_like(bufs0)
        _copy_into(bufs, bufs0)
        outs = [torch.full_like(x, NAN, dtype=out_dtype) for x in params] if out_dtype else None
        new_bufs = fn(p, grads, bufs, lr=0.1, grad_scale=2.0, lowp_out=outs, **options)
        results.append((p, new_bufs, outs))
    (p, bufs, outs), (rp, rbufs, routs) = results
    for a, b in zip(p, rp):
        _close(a, b)
    for a, b in zip(bufs, rbufs):
        assert (a is None) == (b is None)
        if a is not None:
            _close(a, b)
    for a, b in zip(outs or (), routs or ()):
        _close(a.float(), b.float(), out_dtype)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize("dtypes", [[torch.float32], [torch.bfloat16], [torch.float16],
                                    [torch.float32, torch.bfloat16, torch.float16]], ids=str)
def test_grad_norm_kernel_matches_reference(dtypes, norm_type):
    tensors = [_randn(n, i, dtypes[i % len(dtypes)]) for i, n in enumerate(SIZES)]
    total, nonfinite = kernels.grad_norm_and_overflow(tensors, norm_type)
    expected, expected_bad = reference.grad_norm_and_overflow(tensors, norm_type)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6)
    assert not nonfinite and not expected_bad
    again, _ = kernels.grad_norm_and_overflow(tensors, norm_type)
    assert torch.equal(total, again)  # deterministic
    for bad in (NAN, float("inf")):
        poisoned = [t.clone() for t in tensors]
        poisoned[-1][12345] = bad
        assert kernels.grad_norm_and_overflow(poisoned, norm_type)[1].item()


def test_bf16_and_fp16_rounding_match_torch():
    # lowp_out rounds the updated fp32 weight as torch's cast does: ties to even, overflow to inf,
    # subnormals; NaN stays NaN (torch's CUDA cast gives 0x7FFF, ours 0x7FC0). An SGD step with lr 0 and
    # zero gradients leaves the weights as they are, so lowp_out receives exactly these values rounded.
    x = torch.tensor([1.0, 1.00390625, 1.01171875, -3.3e38, 3.4e38, 65520.0, float("inf"), 1e-40, 3e-8, NAN],
                     device="cuda")
    for dtype in (torch.bfloat16, torch.float16):
        out = torch.empty(x.numel(), dtype=dtype, device="cuda")
        before = kernels.launch_counts().get("fused_sgd", 0)
        kernels.sgd_step([x.clone()], [torch.zeros_like(x)], None, lr=0.0, lowp_out=[out])
        assert kernels.launch_counts().get("fused_sgd", 0) == before + 1  # the kernel wrote it, not torch
        assert torch.equal(out[:-1].view(torch.int16), x[:-1].to(dtype).view(torch.int16)), dtype
        assert out[-1].isnan()


@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd", "sgd_nesterov"])
def test_optimizer_step_matches_torch_optim(kind):
    make = {"adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95)),
            "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1)}[kind]
    init = [_randn(n, i) for i, n in enumerate([5, 4097, 1000])]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    theirs = [torch.nn.Parameter(t.clone()) for t in init]
    opt_ours, opt_theirs = make(ours), make(theirs)
    for step in range(3):
        for i, (a, b) in enumerate(zip(ours, theirs)):
            g = None if (step == 0 and i == 1) else _randn(a.numel(), 10 * step + i)  # torch skips grad None
            a.grad, b.grad = g, None if g is None else g.clone()
        assert kernels.optimizer_step(opt_ours) is True
        opt_theirs.step()
    for a, b in zip(ours, theirs):
        _close(a.detach(), b.detach())
        sa, sb = opt_ours.state[a], opt_theirs.state[b]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert sa[key].dtype == sb[key].dtype and sa[key].device == sb[key].device
            _close(sa[key], sb[key])
    opt_ours.step()  # torch carries on from the state the kernels left


def test_optimizer_step_declines_what_it_does_not_reproduce():
    p = torch.nn.Parameter(_randn(8, 0))
    p.grad = _randn(8, 1)
    assert kernels.optimizer_step(torch.optim.Adam([p], amsgrad=True)) is False
    assert kernels.optimizer_step(torch.optim.RMSprop([p])) is False
    opt = torch.optim.Adam([p])
    opt.register_step_post_hook(lambda *a: None)
    assert kernels.optimizer_step(opt) is False
    kernels.set_backend("torch")
    try:
        assert kernels.optimizer_step(torch.optim.Adam([p])) is False
    finally:
        kernels.set_backend(None)


def test_optimizer_step_with_bf16_grads_scale_and_lowp_out():
    # the engine's call: narrow gradients by mapping, loss unscale times clip coefficient as a device scalar
    init = [_randn(n, i) for i, n in enumerate([7, 4097])]
    ours, theirs = [torch.nn.Parameter(t.clone()) for t in init], [torch.nn.Parameter(t.clone()) for t in init]
    opt_ours, opt_theirs = (torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1) for ps in (ours, theirs))
    outs = {p: torch.full_like(p, NAN, dtype=torch.bfloat16) for p in ours}
    scale = torch.tensor(0.125, device="cuda")
    for step in range(3):
        grads = {p: _randn(p.numel(), 50 + step + i, torch.bfloat16, scale=8.0) for i, p in enumerate(ours)}
        for p, q in zip(ours, theirs):
            q.grad = grads[p].float() * 0.125
        assert kernels.optimizer_step(opt_ours, grad_scale=scale, lowp_out=outs, grads=grads)
        opt_theirs.step()
    for a, b in zip(ours, theirs):
        _close(a.detach(), b.detach())
        _close(outs[a].float(), b.detach().bfloat16().float(), torch.bfloat16)


# ---- block quantization (cuda/quantize.cu against engine/comm/quantize.py's reference) --------------

@pytest.mark.parametrize("bits,block", [(8, 256), (8, 7), (4, 64), (4, 5)])
@pytest.mark.parametrize("dtype", GRAD_DTYPES)
def test_quantize_kernels_match_the_reference(bits, block, dtype):
    from zero_strategy.engine.comm.quantize import (QuantSpec, dequantize_into, dequantize_sum, quantize_rows,
                                                    reference_dequantize_rows, reference_quantize_rows)

    spec = QuantSpec(bits, block)
    for rows, numel in [(1, 2), (3, 70), (8, 4098), (4, (1 << 18) + 2)]:
        x = _randn(rows * numel, rows + numel, dtype).view(rows, numel)
        x[0, : min(numel, 9)] = 0
        before = kernels.launch_counts().get("quantize", 0)
        packed = quantize_rows(x, spec, out=torch.full((rows, reference_quantize_rows(x, spec).shape[1]), 0xAB,
                                                       dtype=torch.uint8, device="cuda"))
        assert kernels.launch_counts()["quantize"] == before + 2, "the kernels did not run"
        assert torch.equal(packed, reference_quantize_rows(x, spec)), (rows, numel)  # every byte, padding too
        buffer = torch.full((rows, numel + 3), NAN, dtype=dtype, device="cuda")
        dequantize_into(packed, numel, spec, buffer[:, :numel])
        want = reference_dequantize_rows(packed, numel, spec)
        assert torch.equal(buffer[:, :numel], want.to(dtype)) and buffer[:, numel:].isnan().all()
        torch.testing.assert_close(dequantize_sum(packed, numel, spec), want.sum(dim=0), rtol=1e-6, atol=1e-6)


def test_quantize_kernel_rounds_stochastically_without_bias_and_keeps_non_finite():
    from zero_strategy.engine.comm.quantize import QuantSpec, dequantize_rows, quantize_rows

    spec = QuantSpec(4, 64)
    x = _randn(64, 5).view(1, 64)
    step = x.abs().max() / spec.qmax
    noise = torch.Generator(device="cuda").manual_seed(3)
    draws = torch.stack([dequantize_rows(quantize_rows(x, spec, noise=noise), 64, spec)[0] for _ in range(4000)])
    assert torch.all((draws - x[0]).abs() < step * (1 + 1e-5))
    assert torch.all((draws.mean(dim=0) - x[0]).abs() <= 4 * (step / 2) / 4000 ** 0.5 + 1e-6)
    y = torch.ones(2, 64, device="cuda")
    y[0, 3], y[1, 40] = float("inf"), NAN
    for rounding in (None, noise):
        back = dequantize_rows(quantize_rows(y, QuantSpec(8, 32), noise=rounding), 64, QuantSpec(8, 32))
        assert not back[0, :32].isfinite().any() and not back[1, 32:].isfinite().any()
        assert torch.equal(back[0, 32:], y[0, 32:]) and torch.equal(back[1, :32], y[1, :32])
