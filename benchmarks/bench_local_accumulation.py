"""Local accumulation (issue 32) on 2 CPU ranks: per optimizer step of ``--accumulate`` micro-batches,
the reduce-scatter calls and bytes (``comm_stats()``), the gradient bytes held in the middle of the
accumulation (``memory_stats()``, next to ``estimate_memory``), and the median step time, stages 2
and 3, with and without ``local_accumulation``.

    python benchmarks/bench_local_accumulation.py                          # about 25M parameters
    python benchmarks/bench_local_accumulation.py --params-millions 0.3 --steps 2

The bytes and the memory are exact and transferable; the times are CPU gloo on whatever the machine
is doing (run it on a quiet machine): on gloo over loopback a reduction costs little next to the
compute, so the time saved here is a lower bound of what slow links between nodes save.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

if not __package__:  # run as a script: the repository root on sys.path (see bench_stages.py)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.stages_variants import ResidualMLP, make_batches, model_shape  # noqa: E402
from zero_strategy.config import ZeroConfig  # noqa: E402
from zero_strategy.engine import Collectives, ZeroOptimizer, shard_module  # noqa: E402
from zero_strategy.memory import estimate_memory, memory_stats  # noqa: E402

WORLD = 2
VARIANTS = {"stage2": (2, False), "stage2+local": (2, True), "stage3": (3, False), "stage3+local": (3, True)}


def run_rank(rank: int, args: argparse.Namespace) -> dict:
    width = model_shape(args.params_millions, args.layers)
    batches = make_batches(args.accumulate * (args.steps + 1), args.batch, width, rank)
    out = {}
    for name, (stage, local) in VARIANTS.items():
        torch.manual_seed(0)
        model = ResidualMLP(width, args.layers)
        config = ZeroConfig(stage=stage, local_accumulation=local, shard_modules=("ResidualBlock",))
        comm = Collectives()
        calls = [0]
        original = comm.reduce_scatter

        def counted(*a, **k):
            calls[0] += 1
            return original(*a, **k)

        comm.reduce_scatter = counted
        sharder = shard_module(model, config, comm) if stage == 3 else None
        opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), config, comm, sharder=sharder)
        times, per_step, grads = [], 0, 0
        for step in range(args.steps + 1):  # the first step warms up
            dist.barrier()
            start, before = time.perf_counter(), calls[0]
            for micro in range(args.accumulate):
                x, y = batches[step * args.accumulate + micro]
                with opt.no_sync() if micro < args.accumulate - 1 else torch.enable_grad():
                    (F.mse_loss(model(x), y) / args.accumulate).backward()
                if micro == args.accumulate - 2:
                    grads = memory_stats(model, [opt])["grads"]
            opt.step()
            opt.zero_grad()
            dist.barrier()
            if step:
                times.append(time.perf_counter() - start)
            per_step = calls[0] - before
        numel = sum(p.numel() for p in model.parameters()) if stage < 3 else sum(sharder.full_numel.values())
        out[name] = {"reduce_scatter_calls": per_step, "reduce_scatter_bytes": opt.comm_stats()["reduce_scatter"],
                     "grads_bytes": grads, "estimate_grads": estimate_memory(
                         numel, stage, WORLD, local_accumulation=local)["grads"],
                     "step_s": statistics.median(times), "params": numel}
    return out


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    result = run_rank(rank, args)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: Optional[list[str]] = None) -> None:
    import socket
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params-millions", type=float, default=25.0)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rank0.json")
        mp.start_processes(_worker, args=(port, args, out), nprocs=WORLD, start_method="spawn")
        with open(out) as f:
            results = json.load(f)
    print(f"{WORLD} gloo ranks, accumulate {args.accumulate}, {results['stage2']['params']:,} parameters")
    print(f"{'variant':14} {'rs calls':>9} {'rs MiB':>9} {'grads MiB':>10} {'estimate':>9} {'step ms':>9}")
    for name, r in results.items():
        print(f"{name:14} {r['reduce_scatter_calls']:>9} {r['reduce_scatter_bytes'] / 2**20:>9.3f} "
              f"{r['grads_bytes'] / 2**20:>10.3f} {r['estimate_grads'] / 2**20:>9.3f} {r['step_s'] * 1e3:>9.1f}")


if __name__ == "__main__":
    main()
