"""Block-wise quantization (engine/comm/quantize.py): the packed layout, the error bound, the launch path of
cuda/quantize.cu (through tests/kernel_emulator.py: the same bytes as the torch reference), and the
quantized gathers of a world of one (exact outside forward and backward). No process group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero_strategy.config import ZeroConfig
from zero_strategy.engine import shard_module
from zero_strategy.engine.comm.order_guard import FORWARD
from zero_strategy.engine.comm.quantize import (QuantSpec, code_bytes, dequantize_into, dequantize_rows, dequantize_sum,
                                                num_blocks, packed_row_bytes, quantize_rows, reference_dequantize_rows,
                                                reference_quantize_rows)

from .kernel_emulator import emulated_device, emulated_kernels  # noqa: F401,F811  (a fixture)

SPECS = [QuantSpec(8, 256), QuantSpec(8, 7), QuantSpec(4, 64), QuantSpec(4, 5)]


def _values(rows: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(rows * 1000 + numel)
    x = torch.randn(rows, numel, generator=g) * torch.logspace(-3, 2, numel).pow(0.5)  # blocks of unlike scale
    x[0, : min(numel, 9)] = 0.0  # a block that starts with zeros (an all-zero block when block <= 9)
    return x.to(dtype)


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel", [1000, 256, 6])
def test_each_element_is_within_half_a_step_of_its_block(spec, dtype, numel):
    x = _values(3, numel, dtype)
    packed = quantize_rows(x, spec)
    assert packed.dtype == torch.uint8 and packed.shape == (3, packed_row_bytes(numel, spec))
    back = dequantize_rows(packed, numel, spec)
    exact = x.float()
    blocks = num_blocks(numel, spec)
    padded = torch.zeros(3, blocks * spec.block)
    padded[:, :numel] = exact
    absmax = padded.view(3, blocks, spec.block).abs().amax(dim=2)  # (rows, blocks)
    step = (absmax / spec.qmax).repeat_interleave(spec.block, dim=1)[:, :numel]
    # half a step, and the fp32 rounding of x / scale (an ulp of a quotient up to 127: 1e-5 step)
    assert torch.all((back - exact).abs() <= step * (0.5 + 1e-5))
    # the largest element of each block is exact up to fp32 rounding: the scale is built from it
    assert torch.allclose(back.abs().view(-1).max(), exact.abs().view(-1).max(), rtol=1e-6)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_packed_rows_are_codes_then_fp32_scales(spec):
    numel = 42
    x = _values(2, numel, torch.float32)
    packed = quantize_rows(x, spec)
    start = code_bytes(numel, spec)
    assert start % 4 == 0 and start >= numel * spec.bits / 8
    scales = packed[:, start:].contiguous().view(torch.float32)
    blocks = torch.nn.functional.pad(x, (0, num_blocks(numel, spec) * spec.block - numel)).view(2, -1, spec.block)
    torch.testing.assert_close(scales, blocks.abs().amax(dim=2) / spec.qmax, rtol=0, atol=0)
    padding = packed[:, numel * spec.bits // 8 : start]
    assert torch.equal(padding, torch.zeros_like(padding))


def test_same_input_same_bytes_and_sum_is_the_sum_of_rows():
    spec = QuantSpec(4, 16)
    x = _values(4, 96, torch.float32)
    packed = quantize_rows(x, spec)
    assert torch.equal(packed, quantize_rows(x.clone(), spec))  # every rank derives the same codes
    out = torch.empty_like(packed)
    assert quantize_rows(x, spec, out=out) is out and torch.equal(out, packed)
    torch.testing.assert_close(dequantize_sum(packed, 96, spec), dequantize_rows(packed, 96, spec).sum(dim=0))


def test_stochastic_rounding_is_unbiased_and_within_one_step():
    spec = QuantSpec(4, 32)
    x = _values(1, 64, torch.float32)
    step = x.view(2, 32).abs().amax(dim=1).repeat_interleave(32) / spec.qmax
    noise = torch.Generator().manual_seed(0)
    draws = torch.stack([dequantize_rows(quantize_rows(x, spec, noise=noise), 64, spec)[0] for _ in range(4000)])
    assert torch.all((draws - x[0]).abs() < step * (1 + 1e-5))  # the code below or above x / scale
    # the mean of 4000 draws: within 4 standard errors (each draw's spread is at most step / 2)
    assert torch.all((draws.mean(dim=0) - x[0]).abs() <= 4 * (step / 2) / 4000 ** 0.5 + 1e-6)
    nearest = dequantize_rows(quantize_rows(x, spec), 64, spec)[0]
    # to nearest errs the same way at every call: its error does not average away
    assert (nearest - x[0]).abs().mean() > 10 * (draws.mean(dim=0) - x[0]).abs().mean()
    again = [quantize_rows(x, spec, noise=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(*again)  # the same seed, the same codes: runs repeat


def test_a_non_finite_value_stays_non_finite():
    # an fp16 overflow must reach the loss scaler's check after the reduction, not become a number
    x = torch.ones(2, 64)
    x[0, 3], x[1, 40] = float("inf"), float("nan")
    for noise in (None, torch.Generator().manual_seed(0)):
        back = dequantize_rows(quantize_rows(x, QuantSpec(4, 32), noise=noise), 64, QuantSpec(4, 32))
        assert not back[0, :32].isfinite().any() and not back[1, 32:].isfinite().any()  # the blocks that held them
        assert torch.equal(back[0, 32:], x[0, 32:]) and torch.equal(back[1, :32], x[1, :32])  # the others exact


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="bits=3"):
        QuantSpec(3, 256)
    with pytest.raises(ValueError, match="block=0"):
        QuantSpec(8, 0)
    with pytest.raises(ValueError, match="must be even"):
        quantize_rows(torch.ones(1, 5), QuantSpec(4, 8))
    with pytest.raises(ValueError, match="do not hold 4 elements"):
        dequantize_rows(quantize_rows(torch.ones(1, 8), QuantSpec(8, 4)), 4, QuantSpec(8, 4))


# ---- the kernels' launch path (cuda/quantize.cu, emulated on host memory) ---------------------

@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_path_writes_the_references_bytes_and_values(emulated_device, spec, dtype):
    x = _values(3, 70, dtype)
    packed = quantize_rows(x, spec)
    assert torch.equal(packed, reference_quantize_rows(x, spec))
    buffer = torch.full((3, 80), -1.0, dtype=dtype)  # the gathered buffer: rows 80 apart, 70 written
    dequantize_into(packed, 70, spec, buffer[:, :70])
    assert torch.equal(buffer[:, :70], reference_dequantize_rows(packed, 70, spec).to(dtype))
    assert torch.all(buffer[:, 70:] == -1.0)  # nothing past each row
    assert torch.equal(dequantize_sum(packed, 70, spec), reference_dequantize_rows(packed, 70, spec).sum(dim=0))
    bits = spec.bits
    name = {torch.float32: "float", torch.bfloat16: "bf16_t", torch.float16: "f16_t"}[dtype]
    assert emulated_device == {f"quant_scales<{name}>": 1, f"quant_codes<{name}, {bits}>": 1,
                               f"dequant_rows<{name}, {bits}>": 1, f"dequant_sum<{bits}>": 1}


def test_kernel_path_rounds_stochastically_without_bias(emulated_device):
    spec = QuantSpec(4, 64)
    x = _values(1, 64, torch.float32)
    step = x.abs().max() / spec.qmax
    noise = torch.Generator().manual_seed(3)
    draws = torch.stack([dequantize_rows(quantize_rows(x, spec, noise=noise), 64, spec)[0] for _ in range(2000)])
    assert torch.all((draws - x[0]).abs() < step * (1 + 1e-5))
    assert torch.all((draws.mean(dim=0) - x[0]).abs() <= 4 * (step / 2) / 2000 ** 0.5 + 1e-6)
    again = [quantize_rows(x, spec, noise=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(*again)
    x = torch.ones(2, 64)
    x[0, 3], x[1, 40] = float("inf"), float("nan")
    back = dequantize_rows(quantize_rows(x, spec, noise=noise), 64, spec)
    assert not back[0, :64].isfinite().any() and not back[1, :64].isfinite().any()  # one block per row here


def test_stage3_quantized_gathers_train_the_same_on_the_kernel_path():
    def losses() -> list[float]:
        torch.manual_seed(0)
        model = nn.Sequential(_Block(), _Block(), _Block())
        config = ZeroConfig(stage=3, shard_modules=("_Block",), param_persistence_threshold=0,
                            quantized_weights=True, quantization_block_size=48)
        from zero_strategy.engine import ZeroOptimizer  # noqa: PLC0415

        opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), config, sharder=shard_module(model, config))
        out = []
        for step in range(3):
            loss = model(torch.randn(4, 40, generator=torch.Generator().manual_seed(step))).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    reference = losses()
    with emulated_kernels() as launched:
        assert losses() == reference
    assert launched["dequant_rows<float, 8>"] >= 3 * 2 * 3  # every unit, forward and backward, every step


# ---- a world of one: the quantized gathers are used in training passes only -------------------

class _Block(nn.Module):
    def __init__(self, d: int = 40) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def test_training_passes_see_quantized_weights_and_state_dicts_exact_ones():
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    exact = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 40)
    want_exact = model(x)
    config = ZeroConfig(stage=3, shard_modules=("_Block",), param_persistence_threshold=0, quantized_weights=True,
                        quantization_block_size=32)
    sharder = shard_module(model, config)
    seen = {}
    model[0].register_forward_pre_hook(lambda m, args: seen.__setitem__("weight", m.fc.weight.detach().clone()))
    got = model(x)
    spec = config.weight_quantization
    rows = exact["0.fc.weight"].view(1, -1)
    quantized = dequantize_rows(quantize_rows(rows, spec), rows.shape[1], spec).view(40, 40)
    assert torch.equal(seen["weight"], quantized)  # what the forward computed with
    assert not torch.equal(got, want_exact)
    state = sharder.full_state_dict()  # gathered exactly: the shards are not rounded
    for key, value in exact.items():
        assert torch.equal(state[key], value), key
    unit = sharder.units[0]
    sharder.gather(unit, FORWARD)  # as a training forward gathers it: quantized
    with pytest.raises(RuntimeError, match="gathered quantized"):
        unit.groups[0].commit_gathered()  # keeping it would round the exact shard
    unit.release()
