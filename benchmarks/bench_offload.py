"""The host side of optimizer offload: how fast the host steps, and what disk offload costs.

Three measurements, side by side in one run (one process, no process group), printed as ratios:

1. The host optimizer step on one rank's shard (``--params-millions``, 100M by default, cut into
   the tensors of a GPT-2-small-shaped model: 8 blocks plus the token and position embeddings,
   the pieces a ZeroOptimizer would step): torch's Adam with ``fused=True`` (what the engine
   picks for offload, see zero_strategy/engine/optim/step/host.py), with ``foreach=True``, and the plain
   for-loop (``foreach=False``), on the same tensors and gradients. Goal of issue 7: fused at
   least 3x faster than the for-loop.
2. A whole ``ZeroOptimizer.step()`` with the optimizer offloaded to host memory, against the same
   step with its state in ``offload_dir`` files (``--disk-params-millions``, 25M by default, a
   stack of Linear layers, Adam), stepped in tiles of ``--tile-mb``; and, for reference, the step
   without offload. ``--drop-cache`` asks the kernel to drop the files' pages after every step
   (fsync, then POSIX_FADV_DONTNEED), so the reads come from the disk and not the page cache.
3. A whole training step (forward, backward, ``step()``) of a stack of Linear + Tanh layers
   (``--overlap-params-millions``, batch ``--overlap-batch``) at stage 2 with the optimizer
   offloaded, with and without ``offload_overlap``, on CUDA where there is a GPU: the step, the part
   of it in ``step()`` (what is left after backward), and whether both end on the same weights.
   ``--threads 1`` leaves the second core of a 2-core machine to the overlap's worker.

    python benchmarks/bench_offload.py                              # both, default sizes
    python benchmarks/bench_offload.py --params-millions 10 --steps 2 --disk-params-millions 4  # quick
    python benchmarks/bench_offload.py --json out.json --offload-dir /nvme/tmp --drop-cache
    python benchmarks/bench_offload.py --skip host --cuda-memory 2000   # on a GPU: device bytes per parameter
    python benchmarks/bench_offload.py --skip host disk --threads 1 --overlap-batch 256  # offload_overlap only

Each variant is warmed up by one step (which also creates the optimizer state) and then timed
``--steps`` times, the variants taking turns in a rotating order so that load from other jobs falls
on all of them alike; the table gives the median, ratios are the median over rounds of the ratio
within a round. All variants are alive at once (three times the memory of one). Memory: a
100M-parameter fp32 shard holds 0.8 GB of weights and gradients and 0.8 GB of Adam moments per
optimizer (3.2 GB in all here); the disk part writes and reads 8 bytes per parameter per step.

Measured (2 shared CPU cores, torch 2.13 CPU, load average about 5 from other jobs; 7 rounds):
96.1M parameters in 98 tensors: fused 212 ms, foreach 673 ms, for-loop 1054 ms per step: fused
5.9x the for-loop's speed (paired; 5.0x by the medians), foreach 1.1x. The step is bound by memory
bandwidth (28 bytes per parameter per pass): fused reads and writes each tensor once, foreach in
several vectorised passes, the for-loop in several passes per tensor. ZeroOptimizer.step() on
25.2M parameters: 140 ms offloaded to host memory (fused), 288 ms with the state on disk (2.1x;
2.7x, 360 ms, with the page cache dropped after every step), 339 ms without offload (the user's
for-loop Adam on the same CPU: offload alone is 2.4x faster here, because it picks the fused kernel).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import tempfile
import time
from typing import Any, Callable

import torch
from torch import nn

from zero_strategy import ZeroConfig, ZeroOptimizer
from zero_strategy.engine.optim.step.disk import DiskStep


def gpt2_like_sizes(target: int) -> list[int]:
    """Tensor sizes of a GPT-2-small-shaped model (d=768), with as many blocks as fit ``target``."""
    d, vocab, positions = 768, 50257, 1024
    block = [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]  # ln, attn, ln, mlp
    sizes = [vocab * d, positions * d]
    if sum(sizes) > target:  # a small --params-millions: blocks only
        sizes = []
    while sum(sizes) + sum(block) <= target or not sizes:
        sizes += block
    return sizes


def interleaved(steps_of: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each variant's step, ``rounds`` times, the variants taking turns in a rotating
    order (so load from other jobs on a shared machine falls on all of them alike), after one
    warm-up step each (which creates the optimizer state and faults the memory in)."""
    for fn in steps_of.values():
        fn()
    names = list(steps_of)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            steps_of[name]()
            times[name].append(time.perf_counter() - start)
    return times


def summarize(times: dict[str, list[float]], baseline: str) -> dict[str, Any]:
    """Medians, and the median over rounds of baseline time / variant time (paired: same round)."""
    return {"seconds": {k: statistics.median(v) for k, v in times.items()},
            "speedup_over_" + baseline.replace(" ", "_").replace("-", "_"):
                {k: statistics.median(b / t for b, t in zip(times[baseline], v)) for k, v in times.items()},
            "all_seconds": times}


def host_step(params_millions: float, steps: int) -> dict[str, Any]:
    sizes = gpt2_like_sizes(int(params_millions * 1e6))
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=gen) * 0.02 for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    # three optimizers over the same tensors (each its own state: 0.8 GB at 100M parameters)
    optimizers = {name: torch.optim.Adam(params, lr=1e-4, **kwargs) for name, kwargs in
                  (("fused", {"fused": True}), ("foreach", {"foreach": True}), ("for-loop", {"foreach": False}))}
    out = summarize(interleaved({k: o.step for k, o in optimizers.items()}, steps), "for-loop")
    return {"tensors": len(sizes), "params": sum(sizes), **out}


def _drop_cache(opt: ZeroOptimizer) -> None:
    for fd, _ in opt.step_backend.disk.files.values():  # type: ignore[attr-defined]
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def disk_step(params_millions: float, steps: int, tile_mb: float, folder: str, drop_cache: bool) -> dict[str, Any]:
    width = 2048
    layers = max(1, round(params_millions * 1e6 / (width * width + width)))
    variants = {"no offload": {}, "host memory": {"offload_optimizer": True},
                "disk": {"offload_optimizer": True, "offload_dir": folder, "offload_tile_mb": tile_mb}}
    optimizers = {}
    for name, options in variants.items():
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
        opt = ZeroOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4), ZeroConfig(stage=2, **options))
        model(torch.randn(4, width)).square().mean().backward()  # gradients stay until zero_grad
        optimizers[name] = opt

    def stepper(opt: ZeroOptimizer) -> Callable[[], None]:
        def step() -> None:
            opt.step()
            if drop_cache and isinstance(opt.step_backend, DiskStep):
                _drop_cache(opt)
        return step

    out = summarize(interleaved({k: stepper(o) for k, o in optimizers.items()}, steps), "host memory")
    for opt in optimizers.values():
        opt.close()
    times = out["all_seconds"]
    out["disk_over_host_memory"] = statistics.median(d / h for d, h in zip(times["disk"], times["host memory"]))
    out["host_memory_over_no_offload"] = statistics.median(
        h / n for h, n in zip(times["host memory"], times["no offload"]))
    return {"params": layers * (width * width + width), "tile_mb": tile_mb, "folder": folder,
            "drop_cache": drop_cache, **out}


def overlap_step(params_millions: float, steps: int, device: torch.device, batch: int) -> dict[str, Any]:
    """A whole training step (forward, backward, ``step()``) at stage 2 with the optimizer offloaded,
    with and without ``offload_overlap``, on one rank without a process group: the time of the step
    and of ``step()`` alone (what is left after backward), and whether both end on the same weights."""
    width = 2048
    layers = max(1, round(params_millions * 1e6 / (width * width + width)))
    variants = {"offload": {"offload_optimizer": True}, "overlap": {"offload_optimizer": True, "offload_overlap": True}}
    runs, after_backward = {}, {name: [] for name in variants}
    for name, options in variants.items():
        torch.manual_seed(0)
        with torch.device(device):
            model = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)))
            x = torch.randn(batch, width, generator=torch.Generator(device).manual_seed(1), device=device)
        runs[name] = (model, ZeroOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4), ZeroConfig(stage=2, **options)), x)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def trainer(name: str) -> Callable[[], None]:
        model, opt, x = runs[name]

        def train_step() -> None:
            opt.zero_grad()
            model(x).square().mean().backward()
            sync()
            start = time.perf_counter()
            opt.step()
            sync()
            after_backward[name].append(time.perf_counter() - start)
        return train_step

    out = summarize(interleaved({k: trainer(k) for k in variants}, steps), "offload")
    out["step_only_seconds"] = {k: statistics.median(v[1:]) for k, v in after_backward.items()}  # without the warm-up
    (plain, opt_plain, _), (overlapped, opt_overlap, _) = runs["offload"], runs["overlap"]
    out["same_weights"] = all(torch.equal(p, q) for p, q in zip(plain.parameters(), overlapped.parameters()))
    out["overlap_stats"] = opt_overlap.offload_overlap_stats()
    for opt in (opt_plain, opt_overlap):
        opt.close()
    return {"params": layers * (width * width + width), "device": str(device), "batch": batch, **out}


def cuda_memory(params_millions: float, stage: int) -> dict[str, Any]:
    """Peak device bytes per parameter of a bf16 model trained one step with the optimizer (and at
    stage 3 the parameters) offloaded, on one GPU without a process group. Not yet run on a GPU
    (the machines this was written on have none): issue 7 asks for stage 2 to be within 10% of
    4 bytes per parameter (bf16 weights and gradients)."""
    from zero_strategy.engine import shard_module

    gc.collect()  # the previous stage's model and engine are reference cycles: free them before measuring
    torch.cuda.empty_cache()
    width = 4096
    layers = max(1, round(params_millions * 1e6 / (width * width + width)))
    device = torch.device("cuda")
    with torch.device(device):
        model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers))).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    config = ZeroConfig(stage=stage, offload_optimizer=True, offload_params=stage == 3,
                        shard_modules=("Linear",), param_persistence_threshold=width + 1)
    user_opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sharder = shard_module(model, config, device=device) if stage == 3 else None
    opt = ZeroOptimizer(user_opt, config, sharder=sharder)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, width, device=device, dtype=torch.bfloat16)).float().square().mean().backward()
        opt.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    host = _host_rss()
    return {"stage": stage, "params": n, "device_bytes_before_steps": before, "device_peak": peak,
            "peak_bytes_per_param": peak / n, "resident_bytes_per_param": before / n,
            "host_rss_bytes": host, "host_bytes_per_param": host / n}


def _host_rss() -> int:
    """This process's resident host memory (Linux), 0 where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params-millions", type=float, default=100.0, help="host-step shard size (default 100)")
    parser.add_argument("--disk-params-millions", type=float, default=25.0, help="disk-step model size (default 25)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant, after one warm-up")
    parser.add_argument("--tile-mb", type=float, default=64.0, help="offload_tile_mb of the disk variant")
    parser.add_argument("--offload-dir", default=None, help="folder for the disk variant (default: a temp folder)")
    parser.add_argument("--drop-cache", action="store_true", help="drop the files' page cache after each step")
    parser.add_argument("--overlap-params-millions", type=float, default=25.0,
                        help="model size of the offload_overlap measurement (default 25)")
    parser.add_argument("--overlap-batch", type=int, default=64, help="its batch (rows of width 2048)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads for the whole run (default: torch's)")
    parser.add_argument("--skip", choices=("host", "disk", "overlap"), nargs="*", default=(),
                        help="leave these measurements out")
    parser.add_argument("--cuda-memory", type=float, metavar="MILLIONS",
                        help="also measure peak device memory at stages 2 and 3 with offload (a GPU model this big)")
    parser.add_argument("--cuda-stages", type=int, nargs="+", default=(2, 3), choices=(2, 3),
                        help="the stages --cuda-memory measures (default 2 3)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                               "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    if "host" not in args.skip:
        h = host_step(args.params_millions, args.steps)
        results["host_step"] = h
        print(f"Host Adam step, {h['params'] / 1e6:.1f}M parameters in {h['tensors']} tensors, "
              f"{results['threads']} threads (median of {args.steps}):")
        for name, sec in h["seconds"].items():
            print(f"  {name:>9}: {sec * 1e3:9.1f} ms   {h['speedup_over_for_loop'][name]:5.2f}x the for-loop's speed "
                  "(paired)")
    if "disk" not in args.skip:
        with tempfile.TemporaryDirectory(dir=args.offload_dir) as folder:
            d = disk_step(args.disk_params_millions, args.steps, args.tile_mb, folder, args.drop_cache)
        results["disk_step"] = d
        print(f"ZeroOptimizer.step(), stage 2, one rank, {d['params'] / 1e6:.1f}M parameters, Adam, tiles of "
              f"{d['tile_mb']:g} MiB{', page cache dropped' if d['drop_cache'] else ''} (median of {args.steps}):")
        for name, sec in d["seconds"].items():
            print(f"  {name:>11}: {sec * 1e3:9.1f} ms")
        print(f"  disk / host memory: {d['disk_over_host_memory']:.2f}x   "
              f"host memory / no offload: {d['host_memory_over_no_offload']:.2f}x")
    if "overlap" not in args.skip:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        o = overlap_step(args.overlap_params_millions, args.steps, device, args.overlap_batch)
        results["overlap_step"] = o
        print(f"Training step, stage 2, optimizer offloaded, one rank, {o['params'] / 1e6:.1f}M parameters, Adam, "
              f"batch {o['batch']}, {o['device']} (median of {args.steps}):")
        for name, sec in o["seconds"].items():
            print(f"  {name:>8}: {sec * 1e3:9.1f} ms a step, {o['step_only_seconds'][name] * 1e3:9.1f} ms of it in "
                  f"step()   {o['speedup_over_offload'][name]:5.2f}x offload's speed (paired)")
        print(f"  same weights: {o['same_weights']}   overlap: {o['overlap_stats']}")
    if args.cuda_memory:
        results["cuda_memory"] = [cuda_memory(args.cuda_memory, stage) for stage in args.cuda_stages]
        for row in results["cuda_memory"]:
            print(f"CUDA, stage {row['stage']} with offload, {row['params'] / 1e6:.0f}M bf16 parameters: peak "
                  f"{row['peak_bytes_per_param']:.2f} bytes per parameter ({row['resident_bytes_per_param']:.2f} "
                  f"between steps); host RSS {row['host_bytes_per_param']:.1f} bytes per parameter")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
