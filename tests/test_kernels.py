"""zero_strategy.kernels on CPU: the torch references equal torch.optim, the public functions fall back
to them, the loader's source handling works without CUDA, and the launch path (dtype grouping, table,
arguments) runs against the kernel emulator (tests/kernel_emulator.py). Kernels vs references on a GPU:
test_kernels_gpu.py; the engine's fused step through the emulator: test_fused_step.py."""

from __future__ import annotations

import re

import pytest
import torch

from zero_strategy import kernels
from zero_strategy.kernels import loader, reference

from .kernel_emulator import emulated_device  # noqa: F401  (a fixture)

SIZES = [0, 1, 3, 7, 8, 13, 129]  # not multiples of the vector width (4) or of 8, and empty


def _tensors(seed: int, sizes=SIZES, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(dtype) for n in sizes]


def _run_torch(make_optimizer, params, grads_per_step):
    params = [p.clone().requires_grad_(True) for p in params]
    opt = make_optimizer(params)
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params], opt


ADAM_CASES = [
    dict(cls=torch.optim.Adam, kw=dict(lr=1e-2)),
    dict(cls=torch.optim.Adam, kw=dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, maximize=True)),
    dict(cls=torch.optim.AdamW, kw=dict(lr=1e-2, weight_decay=0.05)),
    dict(cls=torch.optim.AdamW, kw=dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)),
]


@pytest.mark.parametrize("case", ADAM_CASES, ids=lambda c: f"{c['cls'].__name__}-{c['kw']}")
def test_adam_reference_equals_torch(case):
    params, steps = _tensors(0), [_tensors(s + 1) for s in range(4)]
    expected, _ = _run_torch(lambda ps: case["cls"](ps, **case["kw"]), params, steps)

    kw = case["kw"]
    beta1, beta2 = kw.get("betas", (0.9, 0.999))
    ours = [p.clone() for p in params]
    m, v = [torch.zeros_like(p) for p in ours], [torch.zeros_like(p) for p in ours]
    for step, grads in enumerate(steps, start=1):
        kernels.adam_step(ours, grads, m, v, [step] * len(ours), lr=kw["lr"], beta1=beta1, beta2=beta2,
                          eps=kw.get("eps", 1e-8), weight_decay=kw.get("weight_decay", 0.0 if case["cls"] is torch.optim.Adam else 1e-2),
                          decoupled=case["cls"] is torch.optim.AdamW, maximize=kw.get("maximize", False))
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_adam_per_tensor_steps_and_lowp_out():
    # two tensors at different step counts: each gets its own bias correction, as in torch
    params, grads = _tensors(1, [5, 9]), _tensors(2, [5, 9])
    expected = []
    for p, g, step in zip(params, grads, (1, 7)):
        q = p.clone().requires_grad_(True)
        opt = torch.optim.Adam([q], lr=0.1)
        opt.state[q] = {"step": torch.tensor(float(step - 1)), "exp_avg": torch.full_like(p, 0.1),
                        "exp_avg_sq": torch.full_like(p, 0.2)}
        q.grad = g.clone()
        opt.step()
        expected.append(q.detach())
    ours = [p.clone() for p in params]
    outs = [torch.full((5,), float("nan"), dtype=torch.bfloat16), None]
    kernels.adam_step(ours, grads, [torch.full_like(p, 0.1) for p in ours], [torch.full_like(p, 0.2) for p in ours],
                      [torch.tensor(1.0), 7], lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, lowp_out=outs)
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.equal(outs[0], ours[0].to(torch.bfloat16))


@pytest.mark.parametrize("kw", [dict(lr=0.1), dict(lr=0.1, momentum=0.9), dict(lr=0.05, momentum=0.9, dampening=0.1,
                                weight_decay=0.01), dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.1,
                                maximize=True)], ids=str)
def test_sgd_reference_equals_torch(kw):
    params, steps = _tensors(3), [_tensors(s + 10) for s in range(3)]
    expected, opt = _run_torch(lambda ps: torch.optim.SGD(ps, **kw), params, steps)
    ours, buffers = [p.clone() for p in params], None
    for grads in steps:
        buffers = kernels.sgd_step(ours, grads, buffers, lr=kw["lr"], momentum=kw.get("momentum", 0.0),
                                   dampening=kw.get("dampening", 0.0), weight_decay=kw.get("weight_decay", 0.0),
                                   nesterov=kw.get("nesterov", False), maximize=kw.get("maximize", False))
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    if kw.get("momentum"):
        for buf, p in zip(buffers, opt.param_groups[0]["params"]):
            torch.testing.assert_close(buf, opt.state[p]["momentum_buffer"], rtol=0, atol=0)
    else:
        assert buffers == [None] * len(params)


@pytest.mark.parametrize("scale", [0.5, torch.tensor([0.25])], ids=["float", "tensor"])
def test_grad_scale_multiplies_the_gradient(scale):
    params, grads = _tensors(4, [6, 11]), _tensors(5, [6, 11])
    factor = float(scale) if not isinstance(scale, torch.Tensor) else float(scale.item())
    bf16_grads = [g.to(torch.bfloat16) for g in grads]
    a, b = [p.clone() for p in params], [p.clone() for p in params]
    state = lambda: ([torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params])  # noqa: E731
    kernels.adam_step(a, bf16_grads, *state(), [1, 1], lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, grad_scale=scale)
    kernels.adam_step(b, [g.float() * factor for g in bf16_grads], *state(), [1, 1], lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert all(torch.equal(g.float(), h) for g, h in zip(grads, grads))  # grads untouched
    c, d = [p.clone() for p in params], [p.clone() for p in params]
    kernels.sgd_step(c, grads, None, lr=0.1, grad_scale=scale)
    kernels.sgd_step(d, [g * factor for g in grads], None, lr=0.1)
    for x, y in zip(c, d):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grad_norm_and_overflow(norm_type, dtype):
    tensors = _tensors(6, dtype=dtype)
    total, nonfinite = kernels.grad_norm_and_overflow(tensors, norm_type)
    whole = torch.cat([t.float() for t in tensors])
    norm = torch.linalg.vector_norm(whole, norm_type)
    expected = norm if norm_type == float("inf") else norm.pow(norm_type)
    assert total.dtype == torch.float32 and total.dim() == 0
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6)
    assert nonfinite.dtype == torch.bool and not nonfinite
    for bad in (float("nan"), float("inf"), -float("inf")):
        poisoned = [t.clone() for t in tensors]
        poisoned[3][2] = bad
        assert kernels.grad_norm_and_overflow(poisoned, norm_type)[1]


def test_grad_norm_of_nothing_is_zero():
    total, nonfinite = kernels.grad_norm_and_overflow([torch.zeros(0)], device=torch.device("cpu"))
    assert total.item() == 0 and not nonfinite
    assert kernels.grad_norm_and_overflow([])[0].item() == 0


def test_mismatched_lists_are_named():
    p = [torch.zeros(3)]
    with pytest.raises(ValueError, match=r"exp_avgs\[0\] has 4 elements"):
        kernels.adam_step(p, [torch.zeros(3)], [torch.zeros(4)], [torch.zeros(3)], [1], lr=1, beta1=0.9, beta2=0.9, eps=1)
    with pytest.raises(ValueError, match="2 grads for 1 params"):
        kernels.sgd_step(p, [torch.zeros(3)] * 2, None, lr=1)


def test_optimizer_step_declines_on_cpu():
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    opt = torch.optim.AdamW([p], lr=0.1)
    assert kernels.optimizer_step(opt) is False
    assert not opt.state and torch.equal(p.detach(), torch.ones(4))  # nothing changed


def test_backend_switch(monkeypatch):
    monkeypatch.setenv(loader.ENV_VAR, "torch")
    assert kernels.backend() == "torch"
    monkeypatch.setenv(loader.ENV_VAR, "cupy-please")
    with pytest.raises(ValueError, match="ZERO_STRATEGY_KERNELS='cupy-please'"):
        kernels.backend()
    kernels.set_backend("auto")
    try:
        assert kernels.backend() == "auto"
    finally:
        kernels.set_backend(None)
    with pytest.raises(ValueError, match="not one of"):
        kernels.set_backend("fast")


# ---- the loader, without CUDA -----------------------------------------------------------------

def test_sources_are_found_and_prefixed_with_their_path():
    stems = [p.stem for p in loader.source_files()]
    assert stems == sorted(loader.KERNELS)
    text = loader.read_source("fused_adam")
    first, rest = text.split("\n", 1)
    assert first == f'#line 1 "{loader.source_dir() / "fused_adam.cu"}"'
    assert rest == (loader.source_dir() / "fused_adam.cu").read_text()
    assert loader.with_line_directive("x", "C:\\a \"b\".cu").startswith('#line 1 "C:\\\\a \\"b\\".cu"\n')
    assert "-std=c++17" in loader.compile_options()
    with pytest.raises(FileNotFoundError, match="the sources are"):
        loader.read_source("nope")


def test_every_kernel_name_is_instantiated_in_its_source():
    # CuPy looks kernels up by these names; each must be an explicit instantiation (or a plain kernel)
    for stem, names in loader.KERNELS.items():
        text = (loader.source_dir() / f"{stem}.cu").read_text()
        macros = re.findall(r"#define (\w+)\(\w+(?:, \w+)*\)", text)
        for name in names:
            base, _, args = name.partition("<")
            if not args:
                assert re.search(rf"__global__ void (__launch_bounds__\(\w+\) )?{base}\(", text), name
                continue
            types = [a.strip() for a in args.rstrip(">").split(",")]
            explicit = rf"template __global__ void {base}<{', '.join(types)}>"
            by_macro = any(re.search(rf"\b{macro}\({', '.join(types)}\)", text) for macro in macros)
            assert re.search(re.escape(explicit), text) or by_macro, f"{stem}.cu does not instantiate {name}"


# ---- the launch path, with the kernels emulated on host memory (tests/kernel_emulator.py) ---------

def test_launch_path_adam_and_sgd(emulated_device):
    sizes = [0, 1, 7, 5000, 16384 * 2 + 3]  # several blocks per tensor
    params = _tensors(20, sizes)
    grads = [g.to(dt) for g, dt in zip(_tensors(21, sizes), [torch.float32, torch.bfloat16, torch.float16] * 2)]
    for decoupled in (False, True):
        results = []
        for fn in (kernels.adam_step, reference.adam_step):
            p, m, v = [x.clone() for x in params], [torch.full_like(x, 0.1) for x in params], [torch.full_like(x, 0.3) for x in params]
            outs = [torch.full_like(x, float("nan"), dtype=torch.bfloat16) if i % 2 else None for i, x in enumerate(p)]
            fn(p, grads, m, v, [1, 2, 3, 4, 5], lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1,
               decoupled=decoupled, maximize=decoupled, grad_scale=torch.tensor(0.5), lowp_out=outs)
            results.append((p + m + v, [o for o in outs if o is not None]))
        for a, b in zip(results[0][0], results[1][0]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for a, b in zip(results[0][1], results[1][1]):  # bf16: one rounding step apart at most
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-5)
    results = []
    for fn in (kernels.sgd_step, reference.sgd_step):
        p = [x.clone() for x in params]
        bufs = [None if i % 2 else torch.ones_like(x) for i, x in enumerate(p)]
        outs = [torch.full_like(x, float("nan"), dtype=torch.float16) for x in p]
        new = fn(p, grads, bufs, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01, nesterov=True,
                 grad_scale=2.0, lowp_out=outs)
        results.append((p + new, outs))
    for a, b in zip(results[0][0], results[1][0]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(results[0][1], results[1][1]):  # a weight a hair apart may round to the next fp16
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    # one launch per (gradient, output) dtype pair present, empty tensors in none: see [Note: when the kernels run]
    assert emulated_device == {"adam_step<bf16_t, bf16_t>": 2, "adam_step<f16_t, no_out_t>": 2,
                               "adam_step<float, bf16_t>": 2, "adam_step<bf16_t, no_out_t>": 2,
                               "sgd_step<bf16_t, f16_t>": 1, "sgd_step<f16_t, f16_t>": 1, "sgd_step<float, f16_t>": 1}


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_launch_path_grad_norm(emulated_device, norm_type):
    sizes = [0, 3, 16384 + 1, 40000]
    tensors = [t.to(dt) for t, dt in zip(_tensors(30, sizes), [torch.float32, torch.bfloat16, torch.float16, torch.float32])]
    total, bad = kernels.grad_norm_and_overflow(tensors, norm_type)
    expected, _ = reference.grad_norm_and_overflow(tensors, norm_type)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6)
    assert not bad
    # one partials launch per dtype present, over its tensors' blocks, then one final reduction
    assert emulated_device == {"grad_norm_partials<float>": 1, "grad_norm_partials<bf16_t>": 1,
                               "grad_norm_partials<f16_t>": 1, "grad_norm_final": 1}
    tensors[3][39999] = float("nan")
    assert kernels.grad_norm_and_overflow(tensors, norm_type)[1]


@pytest.mark.parametrize("make", [lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01),
                                  lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.8, 0.9), maximize=True),
                                  lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True)],
                         ids=["adam", "adamw", "sgd"])
def test_launch_path_optimizer_step_keeps_torch_state(emulated_device, make):
    init = _tensors(40, [5, 20000, 3])
    ours, theirs = [torch.nn.Parameter(t.clone()) for t in init], [torch.nn.Parameter(t.clone()) for t in init]
    opt_ours, opt_theirs = make(ours), make(theirs)
    outs = {p: torch.full_like(p, float("nan"), dtype=torch.bfloat16) for p in ours}
    for step in range(3):
        grads = _tensors(41 + step, [5, 20000, 3])
        bf16 = {p: (g * 4).bfloat16() for p, g, i in zip(ours, grads, range(3)) if not (step == 0 and i == 1)}
        for p, g in zip(theirs, grads):  # torch gets the same values: the bf16 gradient, unscaled
            p.grad = None if (step == 0 and p is theirs[1]) else (g * 4).bfloat16().float() / 4
        assert kernels.optimizer_step(opt_ours, grad_scale=0.25, lowp_out=outs, grads=bf16) is True
        opt_theirs.step()
    step_kernel = "sgd_step" if isinstance(opt_ours, torch.optim.SGD) else "adam_step"
    assert emulated_device == {f"{step_kernel}<bf16_t, bf16_t>": 3}  # one launch per step: one group, one dtype pair
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(outs[a].float(), b.detach().bfloat16().float(), rtol=1e-2, atol=1e-5)
        sa, sb = opt_ours.state[a], opt_theirs.state[b]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert sa[key].dtype == sb[key].dtype and sa[key].device == sb[key].device
            torch.testing.assert_close(sa[key], sb[key], rtol=1e-6, atol=1e-7)


# ---- the emulator's address check (see [Note: the emulator's address check]) -------------------

def _launch_norm_partials(holds: list[torch.Tensor], entries: list[tuple[int, int]], numels: list[int]) -> None:
    """A grad_norm_partials launch over fp32 arrays at ``entries`` (address, element size) of ``numels``
    elements, as ops.grad_norm_and_overflow makes it, by a launcher that holds ``holds``."""
    from zero_strategy.kernels import ops  # noqa: PLC0415

    np = ops._np()
    table, grid = ops._table(torch.device("cpu"), [entries], numels)
    partials, flags = torch.empty(grid), torch.empty(grid, dtype=torch.uint8)
    ops.launch("grad_norm", "grad_norm_partials<float>", torch.device("cpu"), grid, ops.THREADS, (
        np.uint64(table.data_ptr()), np.int32(len(numels)), np.int64(ops.CHUNK), np.int32(0),
        np.uint64(partials.data_ptr()), np.uint64(flags.data_ptr()), np.int64(0)))


def test_the_emulator_refuses_memory_the_launch_does_not_hold(emulated_device):
    held = torch.ones(1000)
    _launch_norm_partials([held], [(held.data_ptr(), 4)], [1000])  # what the launcher holds: fine
    assert emulated_device == {"grad_norm_partials<float>": 1}
    freed = torch.ones(1000)
    address = freed.data_ptr()
    del freed  # its address sits in the table of a launch that no longer holds it
    with pytest.raises(AssertionError, match="inside no tensor the launching function holds"):
        _launch_norm_partials([held], [(address, 4)], [1000])
    with pytest.raises(AssertionError, match="inside no tensor the launching function holds"):
        _launch_norm_partials([held], [(held.data_ptr(), 4)], [1001])  # one element past its end


def test_the_quantize_kernels_refuse_an_output_they_would_overrun(emulated_device):
    from zero_strategy.engine.comm.quantize import QuantSpec, code_bytes, packed_row_bytes  # noqa: PLC0415
    from zero_strategy.kernels import ops  # noqa: PLC0415

    spec, numel = QuantSpec(8, 16), 40
    x, packed = torch.randn(3, numel), torch.empty(3, packed_row_bytes(numel, spec), dtype=torch.uint8)
    codes = code_bytes(numel, spec)
    assert ops.quantize_rows(x, 8, 16, packed, codes)
    with pytest.raises(ValueError, match=r"out must be uint8 of shape \(3, 52\)"):
        ops.quantize_rows(x, 8, 16, packed[:2], codes)  # two rows for three
    with pytest.raises(ValueError, match=r"out must be of shape \(3, 40\)"):
        ops.dequantize_rows(packed, numel, 8, 16, codes, torch.empty(2, numel))  # two rows for three
    with pytest.raises(ValueError, match=r"out must be of shape \(3, 40\)"):
        ops.dequantize_rows(packed, numel, 8, 16, codes, torch.empty(3, 48)[:, :39])  # rows too short
    with pytest.raises(ValueError, match=r"out must have 40 elements"):
        ops.dequantize_sum(packed, numel, 8, 16, codes, torch.empty(39))
    with pytest.raises(ValueError, match=r"packed rows of 52 bytes"):
        ops.dequantize_sum(packed, numel, 8, 16, codes + 4, torch.empty(numel))  # codes and scales overrun a row
