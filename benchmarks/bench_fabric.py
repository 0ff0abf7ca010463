"""Step time of Lightning Fabric loops with ZeroFabricStrategy (ZeRO-1/2/3) against Fabric's DDP strategy,
side by side on the stage benchmark's model (benchmarks/stages_variants.py: residual Linear blocks and a
head, ~50M parameters by default), 2 gloo ranks on CPU.

    python benchmarks/bench_fabric.py --steps 10                       # 50M parameters: DDP, ZeRO-2, ZeRO-3
    python benchmarks/bench_fabric.py --params-millions 1 --steps 3    # quick check
    python benchmarks/bench_fabric.py --variants ddp,zero1,zero2,zero3 --json fabric.json

Each variant is a Fabric object with its own copy of the model (built from the same seed), setting up
the model and AdamW with ``fabric.setup`` and training with ``fabric.backward`` and ``optimizer.step()``
on the same batches. The variants take turns step by step in a rotating order, so machine noise falls
on all alike; each step is timed barrier to barrier on every rank, and the table gives the median, its
ratio to DDP's, and the paired ratio (the median over rounds of the step over DDP's step in the same
round, which cancels noise that hits a whole round). Stage 3 has one unit per ``ResidualBlock``, as in
bench_stages.py. The losses are checked against DDP's (fp32: equal to about 1e-6).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

if not __package__:  # run as a script: the repository root on the path (see bench_stages.py)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.stages_variants import ResidualBlock, ResidualMLP, make_batches, model_shape  # noqa: E402

VARIANTS = ("ddp", "zero1", "zero2", "zero3")


def build(name: str, args: argparse.Namespace, width: int, world: int) -> dict[str, Any]:
    """A launched Fabric with ``name``'s strategy, and its set-up model and optimizer."""
    import lightning as L

    from zero_strategy.fabric import ZeroFabricStrategy

    if name == "ddp":
        strategy: Any = "ddp"
    else:
        stage = int(name[-1])
        strategy = ZeroFabricStrategy(stage=stage, bucket_cap_mb=args.bucket_cap_mb,
                                      shard_modules=[ResidualBlock.__name__] if stage == 3 else ())
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=world)
    fabric.launch()  # the processes and the gloo group exist already: this joins them
    torch.manual_seed(args.seed)
    model = ResidualMLP(width, args.layers)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=args.lr))
    return {"name": name, "fabric": fabric, "model": model, "optimizer": optimizer, "times": [], "losses": []}


def step(v: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> None:
    dist.barrier()
    start = time.perf_counter()
    loss = F.mse_loss(v["model"](x), y)
    v["fabric"].backward(loss)
    v["optimizer"].step()
    v["optimizer"].zero_grad()
    dist.barrier()
    v["times"].append(time.perf_counter() - start)
    v["losses"].append(loss.item())


def run_rank(rank: int, world: int, args: argparse.Namespace) -> Optional[dict[str, Any]]:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # Fabric finds its processes started
    width = model_shape(args.params_millions, args.layers)
    variants = [build(name, args, width, world) for name in args.variants]
    batches = make_batches(args.warmup + args.steps, args.batch, width, rank)
    for i, (x, y) in enumerate(batches):  # rotate who goes first: no variant always follows another
        k = i % len(variants)
        for v in variants[k:] + variants[:k]:
            step(v, x, y)
    if rank != 0:
        return None
    base = variants[0]
    timed = slice(args.warmup, None)
    n_params = sum(p.numel() for p in ResidualMLP(width, args.layers).parameters())
    out: dict[str, Any] = {"config": {**vars(args), "world_size": world, "width": width, "parameters": n_params,
                                      "torch": torch.__version__, "threads_per_rank": torch.get_num_threads(),
                                      "baseline": base["name"]}, "variants": {}}
    base_median = statistics.median(base["times"][timed])
    for v in variants:
        median = statistics.median(v["times"][timed])
        out["variants"][v["name"]] = {
            "median_step_s": median, "ratio": median / base_median,
            "paired_ratio": statistics.median(a / b for a, b in zip(v["times"][timed], base["times"][timed])),
            "max_loss_diff": max(abs(a - b) for a, b in zip(v["losses"], base["losses"])),
            "step_times_s": v["times"][timed]}
    return out


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = run_rank(rank, world, args)
        if result is not None:
            with open(out_path, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def report(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [f"Fabric loops, {c['parameters'] / 1e6:.1f}M parameters ({c['layers']} residual blocks of width "
             f"{c['width']} and a head), fp32 AdamW, batch {c['batch']} per rank, {c['world_size']} gloo ranks x "
             f"{c['threads_per_rank']} thread, {c['warmup']} warm-up and {c['steps']} timed steps, torch {c['torch']}",
             "", "| strategy | median step (s) | ratio vs Fabric DDP | paired ratio | max Δloss vs DDP |",
             "|---|---|---|---|---|"]
    for name, v in result["variants"].items():
        label = "Fabric DDP" if name == "ddp" else f"ZeroFabricStrategy(stage={name[-1]})"
        lines.append(f"| {label} | {v['median_step_s']:.3f} | {v['ratio']:.2f}x | {v['paired_ratio']:.2f}x | "
                     f"{v['max_loss_diff']:.2g} |")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params-millions", type=float, default=50.0, help="model size, at least this many (default 50)")
    p.add_argument("--layers", type=int, default=11, help="residual blocks (default 11, as bench_stages.py)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (2 ranks on 2 cores: 1)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default="ddp,zero2,zero3", help=f"comma-separated, DDP first; from {VARIANTS}")
    p.add_argument("--json", default=None, help="also write everything measured to this file")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not args.variants or args.variants[0] != "ddp":
        p.error(f"--variants {','.join(args.variants)}: give a comma-separated list starting with ddp, from {VARIANTS}"
                + (f" ({unknown} unknown)" if unknown else ""))
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(_worker, args=(args.world_size, free_port(), args, out), nprocs=args.world_size,
                           join=True, start_method="spawn")
        with open(out) as f:
            result = json.load(f)
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
