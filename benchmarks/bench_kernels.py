"""GPU benchmark of the fused kernels (zero_strategy.kernels); without CUDA and CuPy it says so and exits 0.

1. Bandwidth: bytes the fused Adam step moves per second, against torch's device-to-device copy
   (``dst.copy_(src)``, reads + writes) on the same GPU. Goal: at least 80% of the copy.
   Timed as in training, steps back to back (``BATCH`` calls between two events), so the host's
   enqueueing of a step (Python, the table's copy, the launch: tens of microseconds) overlaps the GPU's
   work on the previous one, as it overlaps the backward pass in a real step. The ``ms alone`` column
   times single calls from an idle GPU, host enqueueing included, for reference.
2. The whole mixed-precision optimizer step (norm + clip + unscale + update + cast to bf16) over the
   same pieces: the kernels (``grad_norm_and_overflow`` + one ``adam_step`` with ``lowp_out``) against
   torch's fused AdamW with separate passes (cast grads to fp32, foreach norm, foreach mul,
   ``AdamW(fused=True).step()``, foreach copy to bf16).

3. Quantization (cuda/quantize.cu): bytes read + written per second by quantize (fp32/bf16 rows to
   packed int8/int4 rows, blocks of 256) and by the dequantizing copy-out into a bf16/fp32 buffer,
   and the same through the torch reference (engine/comm/quantize.py's ``reference_*``), side by side;
   each kernel's bytes are checked equal to the reference's first.

Both paths are checked against each other after one step before anything is timed.

    PYTHONPATH=. python benchmarks/bench_kernels.py [--numel 67108864] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the working tree's package

from zero_strategy import kernels  # noqa: E402
from zero_strategy.kernels.loader import cupy_module  # noqa: E402

LR, BETAS, EPS, WD, MAX_NORM, LOSS_SCALE = 1e-4, (0.9, 0.95), 1e-8, 0.1, 1.0, 1024.0


BATCH = 5
"""Calls between the two events of one timing (see the module's docstring)."""


def timed(fn, iters: int, batch: int = BATCH) -> float:
    """Median seconds per call over ``iters`` timings (CUDA events) of ``batch`` calls back to back, after
    two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / batch)
    return statistics.median(times)


def piece_sizes(numel: int, count: int = 16) -> list[int]:
    """Uneven pieces (as the engine's are), none a multiple of 4, summing to about ``numel``."""
    weights = [1 + (i % 5) for i in range(count)]
    return [max(1, numel * w // sum(weights)) | 1 for w in weights]


def copy_bandwidth(numel: int, iters: int) -> float:
    src = torch.randn(numel, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.nbytes / timed(lambda: dst.copy_(src), iters)


def quantize_bandwidth(numel: int, dtype: torch.dtype, bits: int, iters: int) -> dict:
    """Quantize and dequantize-into-buffer of 8 rows (a world of 8's all-gather) through the kernels
    and through the torch reference: GB/s of bytes read + written, and the reference's time over the
    kernel's."""
    from zero_strategy.engine.comm.quantize import (QuantSpec, dequantize_into, packed_row_bytes, quantize_rows,
                                                    reference_dequantize_rows, reference_quantize_rows)

    spec, rows = QuantSpec(bits, 256), 8
    x = torch.randn(rows, numel // rows, device="cuda").to(dtype)
    packed = quantize_rows(x, spec)
    if not torch.equal(packed, reference_quantize_rows(x, spec)):
        raise SystemExit(f"quantize_rows<{dtype}, int{bits}>: the kernel's bytes differ from the reference's")
    out = torch.empty_like(x)
    moved = x.nbytes + packed.nbytes  # read the values, write the rows (dequantize: the other way)
    assert packed.shape[1] == packed_row_bytes(x.shape[1], spec)
    kernel_q = timed(lambda: quantize_rows(x, spec, out=packed), iters)
    torch_q = timed(lambda: reference_quantize_rows(x, spec, packed), iters)
    kernel_d = timed(lambda: dequantize_into(packed, x.shape[1], spec, out), iters)
    torch_d = timed(lambda: out.copy_(reference_dequantize_rows(packed, x.shape[1], spec)), iters)
    return {"dtype": str(dtype).replace("torch.", ""), "bits": bits, "quantize_GB/s": moved / kernel_q / 1e9,
            "dequantize_GB/s": moved / kernel_d / 1e9, "quantize_vs_torch": torch_q / kernel_q,
            "dequantize_vs_torch": torch_d / kernel_d}


def adam_bandwidth(sizes, grad_dtype, out_dtype, iters: int) -> dict:
    params = [torch.randn(n, device="cuda") for n in sizes]
    grads = [torch.randn(n, device="cuda").to(grad_dtype) for n in sizes]
    m = [torch.zeros(n, device="cuda") for n in sizes]
    v = [torch.zeros(n, device="cuda") for n in sizes]
    outs = [torch.empty(n, device="cuda", dtype=out_dtype) for n in sizes] if out_dtype else None
    steps = [1] * len(sizes)

    def step():
        steps[:] = [s + 1 for s in steps]
        kernels.adam_step(params, grads, m, v, steps, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                          weight_decay=WD, decoupled=True, lowp_out=outs)

    per_param = 24 + torch.finfo(grad_dtype).bits // 8 + (torch.finfo(out_dtype).bits // 8 if out_dtype else 0)
    seconds = timed(step, iters)
    alone = timed(step, iters, batch=1)
    return {"grad": str(grad_dtype).split(".")[-1], "out": str(out_dtype).split(".")[-1] if out_dtype else "-",
            "bytes_per_param": per_param, "ms": seconds * 1e3, "GB/s": per_param * sum(sizes) / seconds / 1e9,
            "ms_alone": alone * 1e3}


class WholeStep:
    """One mixed-precision step over bf16 grads, fp32 master weights and moments, bf16 working weights."""

    def __init__(self, sizes):
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.init = [torch.randn(n, device="cuda", generator=gen) for n in sizes]
        self.grads = [(torch.randn(n, device="cuda", generator=gen) * LOSS_SCALE).bfloat16() for n in sizes]
        self.masters = [t.clone() for t in self.init]
        self.m = [torch.zeros_like(t) for t in self.init]
        self.v = [torch.zeros_like(t) for t in self.init]
        self.working = [t.bfloat16() for t in self.init]
        self.step_count = 0
        self.torch_masters = [torch.nn.Parameter(t.clone()) for t in self.init]
        self.torch_opt = torch.optim.AdamW(self.torch_masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
        self.torch_working = [t.bfloat16() for t in self.init]

    def ours(self):
        total, nonfinite = kernels.grad_norm_and_overflow(self.grads)  # scaled grads: sum of squares
        norm = total.sqrt() / LOSS_SCALE
        coef = (MAX_NORM / (norm + 1e-6)).clamp(max=1.0) / LOSS_SCALE  # clip coefficient times unscale
        self.step_count += 1
        kernels.adam_step(self.masters, self.grads, self.m, self.v, [self.step_count] * len(self.grads), lr=LR,
                          beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD, decoupled=True,
                          grad_scale=coef, lowp_out=self.working)
        return nonfinite

    def theirs(self):
        grads = [g.float() for g in self.grads]
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) / LOSS_SCALE
        coef = (MAX_NORM / (norm + 1e-6)).clamp(max=1.0) / LOSS_SCALE
        torch._foreach_mul_(grads, coef)
        for p, g in zip(self.torch_masters, grads):
            p.grad = g
        self.torch_opt.step()
        torch._foreach_copy_(self.torch_working, [p.detach() for p in self.torch_masters])

    def check(self):
        self.ours()
        self.theirs()
        for a, b in zip(self.masters, self.torch_masters):
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
        for a, b in zip(self.working, self.torch_working):
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=1 << 26, help="parameters in the pieces (default 64M)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT") or "benchmarks/results_gpu", "bench_kernels.json"),
                        help="JSON results (default: $OUT/bench_kernels.json, else benchmarks/results_gpu/)")
    args = parser.parse_args()
    if not torch.cuda.is_available() or cupy_module() is None:
        print("bench_kernels: no GPU available (needs CUDA and CuPy); nothing measured.")
        return 0
    torch.manual_seed(0)
    sizes = piece_sizes(args.numel)
    device = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth(sum(sizes), args.iters)
    rows = [adam_bandwidth(sizes, g, o, args.iters) for g, o in
            [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]]
    print(f"{device}: {sum(sizes):,} parameters in {len(sizes)} pieces; device copy {copy_bw / 1e9:.0f} GB/s")
    print(f"{'grad':>9} {'out':>9} {'B/param':>8} {'ms':>8} {'GB/s':>8} {'of copy':>8} {'ms alone':>9}")
    for r in rows:
        r["fraction_of_copy"] = r["GB/s"] * 1e9 / copy_bw
        print(f"{r['grad']:>9} {r['out']:>9} {r['bytes_per_param']:>8} {r['ms']:>8.3f} {r['GB/s']:>8.0f} "
              f"{r['fraction_of_copy']:>8.0%} {r['ms_alone']:>9.3f}")

    whole = WholeStep(sizes)
    whole.check()
    ours_s, theirs_s = timed(whole.ours, args.iters), timed(whole.theirs, args.iters)
    print(f"whole step (norm + clip + unscale + AdamW + cast to bf16): kernels {ours_s * 1e3:.3f} ms, "
          f"torch fused AdamW with separate passes {theirs_s * 1e3:.3f} ms, speed-up {theirs_s / ours_s:.2f}x")
    quant = [quantize_bandwidth(args.numel, dtype, bits, args.iters)
             for dtype in (torch.float32, torch.bfloat16) for bits in (8, 4)]
    print(f"{'values':>9} {'codes':>6} {'quantize GB/s':>14} {'vs torch':>9} {'dequantize GB/s':>16} {'vs torch':>9}")
    for q in quant:
        print(f"{q['dtype']:>9} {'int' + str(q['bits']):>6} {q['quantize_GB/s']:>14.0f} {q['quantize_vs_torch']:>8.1f}x "
              f"{q['dequantize_GB/s']:>16.0f} {q['dequantize_vs_torch']:>8.1f}x")
    result = {"device": device, "numel": sum(sizes), "pieces": len(sizes), "copy_GB/s": copy_bw / 1e9, "quantize": quant,
              "adam": rows, "whole_step_ms": {"kernels": ours_s * 1e3, "torch_fused_separate_passes": theirs_s * 1e3},
              "whole_step_speedup": theirs_s / ours_s, "goal_met": min(r["fraction_of_copy"] for r in rows) >= 0.8}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
