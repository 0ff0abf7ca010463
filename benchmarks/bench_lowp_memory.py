"""Model state per rank with low-precision optimizer state and bf16 masters, against the formula.

For each combination (optimizer_state_dtype, master_weights_dtype), a bf16 MLP at ZeRO stage 3 on 2
gloo ranks, AdamW, a few training steps; then each rank's ``memory_stats()`` model state (weights,
gradients, masters, optimizer state) beside ``estimate_memory(...)``'s, in bytes per parameter of
the whole model (so 16 / N is ZeRO's 16 bytes per parameter split over N ranks), and the process's
peak resident memory (VmHWM; imports included, so only its differences between rows mean much).

    python benchmarks/bench_lowp_memory.py                        # the 8-block 67.1M MLP, 2 ranks
    python benchmarks/bench_lowp_memory.py --width 256 --steps 1  # a quick check that it runs

A byte benchmark: the numbers do not depend on the load of the machine (timing is not measured).
Each combination runs in fresh processes, so the peaks do not carry over from one to the next.
``optimizer_state_min_numel`` is left at its default (4096): biases keep fp32 state, which the
formula does not count (it counts every parameter as large), the difference the table shows.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

COMBOS = (("fp32", "fp32"), ("bf16", "fp32"), ("int8", "fp32"), ("fp32", "bf16"), ("bf16", "bf16"), ("int8", "bf16"))
KEYS = ("params", "grads", "master_params", "optimizer_states")


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


def _kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def run(rank: int, world: int, port: int, args: argparse.Namespace, state: str, master: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from zero_strategy import ZeroConfig, ZeroOptimizer, estimate_memory, memory_stats
    from zero_strategy.engine import shard_module

    torch.manual_seed(0)
    d = args.width
    model = nn.Sequential(*[Block(d) for _ in range(args.blocks)]).bfloat16()
    numel = sum(p.numel() for p in model.parameters())
    config = ZeroConfig(stage=3, shard_modules=(Block,), param_persistence_threshold=args.persistence,
                        optimizer_state_dtype=state, master_weights_dtype=master)
    sharder = shard_module(model, config)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), config, sharder=sharder)
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(4, d, generator=g).bfloat16(), torch.randn(4, d, generator=g).bfloat16()
        opt.zero_grad()
        F.mse_loss(model(x).float(), y.float()).backward()
        opt.step()
    stats = memory_stats(model, [opt])
    formula = estimate_memory(numel, 3, world, "bf16-mixed", optimizer_state_dtype=state, master_weights_dtype=master)
    result = {"numel": numel, "measured": {k: stats[k] for k in KEYS}, "formula": {k: formula[k] for k in KEYS},
              "peak_rss": _kib("VmHWM")}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024, help="d of the d-4d-d blocks (1024: 67.1M parameters)")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--persistence", type=int, default=100_000,
                        help="param_persistence_threshold (the default's: biases stay whole on every rank)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = {}
    print(f"{'state':5} {'master':6} {'measured B/param':>17} {'formula B/param':>16} {'x world':>8} "
          f"{'states B':>12} {'masters B':>12} {'peak RSS/rank':>14}")
    for state, master in COMBOS:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result")
            mp.start_processes(run, args=(2, _free_port(), args, state, master, out), nprocs=2, start_method="spawn")
            ranks = [json.load(open(f"{out}.{r}")) for r in range(2)]
        numel = ranks[0]["numel"]
        measured = max(sum(r["measured"].values()) for r in ranks)
        formula = sum(ranks[0]["formula"].values())
        peak = max(r["peak_rss"] for r in ranks)
        results[f"{state}/{master}"] = ranks
        print(f"{state:5} {master:6} {measured / numel:17.3f} {formula / numel:16.3f} {2 * measured / numel:8.2f} "
              f"{ranks[0]['measured']['optimizer_states']:12,} {ranks[0]['measured']['master_params']:12,} "
              f"{peak / 2**20:10.0f} MiB")
    print(f"({numel:,} parameters, stage 3, 2 ranks; 'x world' is the measured bytes per parameter times the "
          "ranks: ZeRO's 16 for fp32 state and masters)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
