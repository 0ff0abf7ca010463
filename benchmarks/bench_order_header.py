"""The order guard's cost: stage-3 step time with its headers in the all-gathers and without.

    python benchmarks/bench_order_header.py [--ranks 2] [--layers 6] [--width 512] [--rounds 8]
                                            [--steps 4] [--quantized] [--threads 1]

Every rank trains one stack of equal blocks at stage 3 (``shard_modules=["Block"]``, fp32, AdamW,
gloo, ``--threads`` threads per rank: with one, the gathers of 1 MiB or more go as broadcasts). After
warm-up steps it runs ``--rounds`` rounds; each round times
``--steps`` steps with the headers on and as many with them off, the order of the two halves
alternating from round to round, on the same model (``sharder.guard.enabled`` is the switch, for
this benchmark only: ``check_unit_order=False`` is the user's). It prints, per rank, the ratio of
the median step times (on / off) of each round, their median and their spread (min and max), and
the bytes a step sends with and without the headers (``comm_stats()``): 16 (n - 1) more per
all-gather under 1 MiB (the head's); on gloo a pass's gathers of 1 MiB or more send none, the guard
keeping their tags and comparing them by a digest in the step's all-reduce, which carries it with
the guard on or off (see [Note: headers left out on gloo] in zero_strategy/engine/comm/order_guard.py).

Timing needs a quiet machine: on a loaded host the spread across rounds says how far to trust it.
"""

from __future__ import annotations

import argparse
import json
import os
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
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.norm(x))))


def run(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from zero_strategy import ZeroConfig
    from zero_strategy.engine import Collectives, ZeroOptimizer, shard_module

    torch.manual_seed(0)
    model = nn.Sequential(*[Block(args.width) for _ in range(args.layers)], nn.Linear(args.width, 1))
    config = ZeroConfig(stage=3, shard_modules=("Block",), param_persistence_threshold=0,
                        quantized_weights=args.quantized)
    comm = Collectives(collective_timeout=600.0)
    sharder = shard_module(model, config, comm)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), config, comm, sharder=sharder)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, 1, generator=g)

    def step() -> float:
        start = time.perf_counter()
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        return time.perf_counter() - start

    stats = {}
    for on in (True, False):
        sharder.guard.enabled = on
        for _ in range(args.warmup):
            step()
        stats["on" if on else "off"] = opt.comm_stats()
    ratios = []
    for r in range(args.rounds):
        times = {True: [], False: []}
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            sharder.guard.enabled = on
            times[on] += [step() for _ in range(args.steps)]
        ratios.append(statistics.median(times[True]) / statistics.median(times[False]))
    sharder.guard.enabled = True
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"ratios": ratios, "stats": stats}, f)
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4, help="steps per half-round")
    parser.add_argument("--quantized", action="store_true", help="quantized_weights (qwZ)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per rank; with more than one, no gather goes by broadcasts")
    args = parser.parse_args(argv)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.start_processes(run, args=(args.ranks, port, args, out), nprocs=args.ranks, start_method="spawn")
        results = [json.load(open(f"{out}.{r}")) for r in range(args.ranks)]
    print(f"{args.ranks} gloo ranks, {args.layers} blocks of width {args.width}, batch {args.batch}, "
          f"{args.rounds} rounds of {args.steps}+{args.steps} steps{', qwZ' if args.quantized else ''}; "
          f"torch {torch.__version__}")
    for rank, r in enumerate(results):
        ratios = r["ratios"]
        print(f"rank {rank}: step time with headers / without, per round: "
              + " ".join(f"{x:.3f}" for x in ratios)
              + f"; median {statistics.median(ratios):.3f}, spread {min(ratios):.3f}-{max(ratios):.3f}")
        extra = r["stats"]["on"]["all_gather"] - r["stats"]["off"]["all_gather"]
        print(f"rank {rank}: all-gather bytes a step sends: {r['stats']['off']['all_gather']} without, "
              f"{r['stats']['on']['all_gather']} with (+{extra}: 16 (n - 1) per gather under 1 MiB; on gloo the "
              "larger send none)")


if __name__ == "__main__":
    main()
