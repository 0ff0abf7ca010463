"""The optimizer phase of a whole bf16-mixed step through the engine, against torch's AdamW(fused=True) path.

A stage-2 model of ``--params-millions`` parameters (1,000 by default: ``Linear(8192, 8192)`` layers
with biases, bf16 weights) trains through ``ZeroOptimizer`` (AdamW, fp32 master weights, clipping by
the 2-norm), one GPU, one process. Each step runs forward and backward (stage 2 reduces the bf16
gradients into the gradient shard during backward), then the two optimizer phases, each timed alone
with CUDA events from an idle GPU, its host work (Python, launch tables, one host sync) included:

- engine: ``opt.clip_grad_norm_(1.0); opt.step()`` with the fused kernels (see [Note: the fused mixed-precision step]
in zero_strategy/engine/optim/step/grads.py): the norm kernel reads the bf16
  gradients (2 bytes per parameter), the AdamW kernel reads them with the fp32 master and moments and
  writes those and the bf16 working weights (28): **30 bytes per parameter** (cuda/README.md).
- torch: the same step as torch users write it, on copies of the same fp32 masters, moments and bf16
  weights, reading the engine's own bf16 gradients: copy them into fp32 ``.grad`` (2 + 4),
  ``clip_grad_norm_`` (norm 4, multiply 8), ``AdamW(fused=True).step()`` (28), copy the masters into
  the bf16 weights (4 + 2): **52 bytes per parameter**.

Both are checked against each other after the first step before anything is timed, and the engine's
kernel launches are counted (``kernels.launch_counts()``): the check fails unless the fused path ran.
The bandwidth column is bytes per parameter times parameters over the median time, next to a device
copy's (``dst.copy_(src)``, read + write); when the engine's figure is near the copy's, its phase
moved no more than the 30 bytes it promises, since no pass can beat the copy.

World size 1 keeps the measurement to the optimizer phase itself: stage 2's reduce-scatter then is
a copy during backward, and the all-gather after the step a no-op (the owned shard is the buffer).

    python benchmarks/bench_fused_step.py [--params-millions 1000] [--steps 5] [--out results.json]

Without CUDA and CuPy it says so and exits 0. Memory: about 16 bytes per parameter for the engine
and 18 for torch's copies (34 GB at 1B parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the working tree's package

from zero_strategy import ZeroConfig, ZeroOptimizer, kernels  # noqa: E402
from zero_strategy.kernels.loader import cupy_module  # noqa: E402

LR, BETAS, EPS, WD, MAX_NORM = 1e-4, (0.9, 0.95), 1e-8, 0.1, 1.0
ENGINE_BYTES = 2 + 28  # norm pass over bf16 gradients; AdamW kernel with a bf16 output
TORCH_BYTES = (2 + 4) + 4 + 8 + 28 + (4 + 2)  # cast grads; norm; clip multiply; fused AdamW; cast weights
BATCH = 16  # rows per step: the optimizer phase does not depend on it


def stage2_model(params_millions: float, width: int, device: torch.device) -> nn.Sequential:
    """``Linear(width, width)`` layers with biases, as many as make about ``params_millions``, in bf16."""
    layers = max(1, round(params_millions * 1e6 / (width * width + width)))
    return nn.Sequential(*[nn.Linear(width, width, device=device, dtype=torch.bfloat16) for _ in range(layers)])


class Phase:
    """Times one phase from an idle device: CUDA events on a GPU, the wall clock elsewhere (dry runs)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds: list[float] = []

    def run(self, fn) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            self.seconds.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            self.seconds.append(time.perf_counter() - began)


class TorchPath:
    """torch's mixed-precision AdamW step on copies of the engine's pieces (see the module's docstring)."""

    def __init__(self, opt: ZeroOptimizer) -> None:
        refs = list(opt.pieces())
        self.grads = [opt.reducer.piece_grad(ref.group_index, ref.piece) for ref in refs]  # the engine's, bf16
        self.masters = [nn.Parameter(ref.tensor.detach().clone()) for ref in refs]
        self.working = [ref.group.weights(ref.piece).clone() for ref in refs]
        for master in self.masters:
            master.grad = torch.empty_like(master)
        self.opt = torch.optim.AdamW(self.masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)

    def step(self) -> None:
        torch._foreach_copy_([m.grad for m in self.masters], self.grads)
        torch.nn.utils.clip_grad_norm_(self.masters, MAX_NORM, foreach=True)
        self.opt.step()
        torch._foreach_copy_(self.working, [m.detach() for m in self.masters])


def engine_step(opt: ZeroOptimizer) -> None:
    opt.clip_grad_norm_(MAX_NORM)
    if not opt._step.deferred:
        raise RuntimeError("the engine did not take the fused path (its gradients were copied to fp32): are the "
                           "kernels available here (CUDA, CuPy, ZERO_STRATEGY_KERNELS unset)?")
    opt.step()


def check_agreement(opt: ZeroOptimizer, torch_path: TorchPath) -> None:
    """Masters to fp32 rounding of the norm; working weights to one bf16 ulp (bench_kernels.py's tolerances)."""
    for ref, master, working in zip(opt.pieces(), torch_path.masters, torch_path.working):
        torch.testing.assert_close(ref.tensor, master.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ref.group.weights(ref.piece).float(), working.float(), rtol=1e-2, atol=1e-3)


def copy_bandwidth(numel: int, device: torch.device, repeats: int = 5) -> float:
    """Bytes per second of ``dst.copy_(src)`` (read + write), the median of ``repeats``."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    phase = Phase(device)
    for _ in range(repeats + 1):
        phase.run(lambda: dst.copy_(src))
    return 2 * src.nbytes / statistics.median(phase.seconds[1:])


def measure(params_millions: float, width: int, steps: int, device: torch.device) -> dict:
    """Build, check, then time ``steps`` steps (after one untimed); see the module's docstring."""
    torch.manual_seed(0)
    model = stage2_model(params_millions, width, device)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD),
                        ZeroConfig(stage=2))
    torch_path = TorchPath(opt)
    numel = sum(ref.piece.numel for ref in opt.pieces())
    x = torch.randn(BATCH, width, device=device, dtype=torch.bfloat16)
    engine, theirs = Phase(device), Phase(device)
    launched: dict[str, int] = {}
    for step in range(steps + 1):
        opt.zero_grad()
        model(x).float().square().mean().backward()
        before = kernels.launch_counts()
        engine.run(lambda: engine_step(opt))
        launched = {k: n - before.get(k, 0) for k, n in kernels.launch_counts().items() if n != before.get(k, 0)}
        theirs.run(torch_path.step)
        if step == 0:
            check_agreement(opt, torch_path)
    engine_s, torch_s = statistics.median(engine.seconds[1:]), statistics.median(theirs.seconds[1:])
    return {"parameters": numel, "layers": len(model), "width": width, "pieces": len(torch_path.masters),
            "engine_ms": engine_s * 1e3, "torch_ms": torch_s * 1e3, "speedup": torch_s / engine_s,
            "engine_bytes_per_param": ENGINE_BYTES, "torch_bytes_per_param": TORCH_BYTES,
            "engine_GB/s": ENGINE_BYTES * numel / engine_s / 1e9, "torch_GB/s": TORCH_BYTES * numel / torch_s / 1e9,
            "engine_launches_per_step": launched, "steps_timed": steps}


def report(r: dict, device_name: str, copy_bw: float) -> None:
    print(f"{device_name}: {r['parameters']:,} parameters ({r['layers']} x Linear({r['width']}, {r['width']}), "
          f"{r['pieces']} pieces), ZeRO stage 2, world size 1, bf16 weights, fp32 masters, AdamW, clip {MAX_NORM}; "
          f"median of {r['steps_timed']} steps; device copy {copy_bw / 1e9:.0f} GB/s")
    print(f"{'optimizer phase':<50} {'ms':>9} {'B/param':>8} {'GB/s':>7} {'of copy':>8}")
    for name, key in (("engine: fused kernels (norm + AdamW)", "engine"),
                      ("torch: cast, clip_grad_norm_, AdamW(fused), cast", "torch")):
        print(f"{name:<50} {r[key + '_ms']:>9.3f} {r[key + '_bytes_per_param']:>8} {r[key + '_GB/s']:>7.0f} "
              f"{r[key + '_GB/s'] * 1e9 / copy_bw:>8.0%}")
    print(f"speed-up {r['speedup']:.2f}x (the bytes alone predict {TORCH_BYTES / ENGINE_BYTES:.2f}x); engine kernel "
          f"launches per step: {r['engine_launches_per_step']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params-millions", type=float, default=1000.0, help="model size (default 1000: 1B)")
    parser.add_argument("--width", type=int, default=8192, help="features of each Linear layer (default 8192)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps, after one untimed (default 5)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT") or "benchmarks/results_gpu",
                                                      "bench_fused_step.json"),
                        help="JSON results (default: $OUT/bench_fused_step.json, else benchmarks/results_gpu/)")
    args = parser.parse_args()
    if not torch.cuda.is_available() or cupy_module() is None:
        print("bench_fused_step: no GPU available (needs CUDA and CuPy); nothing measured.")
        return 0
    if args.steps < 1 or args.params_millions <= 0 or args.width < 1:
        parser.error(f"--steps {args.steps}, --params-millions {args.params_millions} and --width {args.width} must "
                     "be positive")
    device = torch.device("cuda", torch.cuda.current_device())
    result = measure(args.params_millions, args.width, args.steps, device)
    copy_bw = copy_bandwidth(1 << 28, device)
    result.update(device=torch.cuda.get_device_name(), copy_GB_per_s=copy_bw / 1e9)
    report(result, result["device"], copy_bw)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
