"""The step breakdown's cost: stage-3 step time with ``step_breakdown`` measuring and without.

    python benchmarks/bench_breakdown.py [--ranks 2] [--blocks 8] [--width 1024] [--batch 16]
                                         [--rounds 8] [--steps 4] [--warmup 3] [--threads 1]

Every rank trains the CPU stage-3 benchmark model of bench_stage3_defaults.py (by default the 8-block
1024-4096-1024 MLP of 67.1M parameters) at stage 3 with ``ZeroConfig(stage=3)``'s defaults (units cut by
size), fp32 AdamW, on gloo. After ``--warmup`` steps (the first of which counts the FLOPs), it runs
``--rounds`` rounds; each round times ``--steps`` steps with the breakdown measuring and as many without,
on the same model, the order of the two halves alternating from round to round. The switch is
``comm.breakdown.enable(on, device)``, for this benchmark only (``step_breakdown=False`` is the user's): off,
the engine's hooks return at their first test. It prints, per rank, the ratio of the median step times
(on / off) of each round, their median and their spread (min and max), then rank 0's breakdown of the
steps measured.

Timing needs a quiet machine: on a loaded host the spread across rounds says how far to trust it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):  # (B, d) -> (B, d)
        return x + self.fc2(torch.relu(self.fc1(x)))


def run(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from zero_strategy import ZeroConfig
    from zero_strategy.engine import Collectives, ZeroOptimizer, shard_module
    from zero_strategy.step_report import mean_ms, summarize

    torch.manual_seed(0)
    model = nn.Sequential(*[Block(args.width) for _ in range(args.blocks)])
    config = ZeroConfig(stage=3, collective_timeout=600.0)
    comm = Collectives(collective_timeout=600.0)
    sharder = shard_module(model, config, comm)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), config, comm, sharder=sharder)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, args.width, generator=g)
    cpu = torch.device("cpu")

    def step() -> float:
        start = time.perf_counter()
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        step()
    ratios, measured = [], []
    for r in range(args.rounds):
        times = {True: [], False: []}
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            comm.breakdown.enable(on, cpu)
            times[on] += [step() for _ in range(args.steps)]
            if on:
                measured += list(comm.breakdown.records)[-args.steps:]
        ratios.append(statistics.median(times[True]) / statistics.median(times[False]))
    comm.breakdown.enable(True, cpu)
    summary = summarize(comm.breakdown, config, world)
    summary.ms = mean_ms(measured)  # the steps of the rounds, not the warm-up
    summary.steps, summary.which = len(measured), "steps measured in the rounds"
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"ratios": ratios, "table": summary.table()}, f)
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4, help="steps per half-round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.start_processes(run, args=(args.ranks, port, args, out), nprocs=args.ranks, start_method="spawn")
        results = [json.load(open(f"{out}.{r}")) for r in range(args.ranks)]
    params = args.blocks * (8 * args.width * args.width + 5 * args.width)
    print(f"{args.ranks} gloo ranks, {args.blocks} blocks of width {args.width} ({params / 1e6:.1f}M parameters), "
          f"batch {args.batch}, {args.threads} thread(s) per rank, {args.rounds} rounds of {args.steps}+{args.steps} "
          f"steps; torch {torch.__version__}")
    for rank, r in enumerate(results):
        ratios = r["ratios"]
        print(f"rank {rank}: step time with the breakdown / without, per round: "
              + " ".join(f"{x:.3f}" for x in ratios)
              + f"; median {statistics.median(ratios):.3f}, spread {min(ratios):.3f}-{max(ratios):.3f}")
    print(results[0]["table"])


if __name__ == "__main__":
    main()
