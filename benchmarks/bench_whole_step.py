"""Muon under ZeRO stage 3 (each matrix stepped whole on one rank: [Note: whole-parameter step]) next to
AdamW under stage 3 and next to DDP with Muon, on 2 gloo ranks: step time, optimizer-state bytes per
rank and the step's bytes sent, the three variants taking turns step by step in the same processes.

    python benchmarks/bench_whole_step.py                       # GPT-2 small's shape, 124M parameters
    python benchmarks/bench_whole_step.py --layers 2 --width 256 --steps 3
    python benchmarks/bench_whole_step.py --muon deepspeed      # DeepSpeed's Muon (fp32 iterations on a CPU)

The model is zero_strategy.models.GPT (``--layers`` blocks of ``--width``, GPT-2's 50257-token
vocabulary, tied embeddings). Muon takes the blocks' matrices, AdamW the rest (embeddings, norms,
biases), as Muon's users split them; "AdamW" steps every parameter with AdamW. ``--muon torch`` (the
default) is torch's Muon beside torch's AdamW, whose Newton-Schulz iterations run in bf16;
``--muon deepspeed`` is zero_strategy.DeepSpeedMuon's Muon (DeepSpeed 0.19's update) on the same
matrices beside torch's AdamW, whose default "gram" iterations run in fp16 where the device computes
fp16 and in fp32 elsewhere (this benchmark's CPU, with AVX2 only, multiplies bf16 about 9x slower than
fp32). Stage 3 runs with its defaults. The time is the median over ``--steps`` steps after one warm-up step, barrier to barrier.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

WORLD = 2
VARIANTS = ("zero3 + AdamW", "zero3 + Muon", "DDP + Muon")


def _optimizers(model: torch.nn.Module, muon: Optional[str]) -> list[torch.optim.Optimizer]:
    if muon is None:
        return [torch.optim.AdamW(model.parameters(), lr=1e-4)]
    matrices = [p for name, p in model.named_parameters() if p.dim() == 2 and ".blocks." in f".{name}"]
    rest = [p for p in model.parameters() if all(p is not m for m in matrices)]
    if muon == "deepspeed":  # its Muon half alone: the rest under AdamW, sharded elementwise as with torch's Muon
        from zero_strategy import DeepSpeedMuon

        return [DeepSpeedMuon([{"params": matrices, "use_muon": True}], muon={"lr": 0.02}),
                torch.optim.AdamW(rest, lr=1e-4)]
    return [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-4)]


def _state_bytes(optimizers) -> int:
    return sum(v.numel() * v.element_size() for opt in optimizers for s in opt.state.values()
               for v in s.values() if isinstance(v, torch.Tensor))


def _build(variant: str, args: argparse.Namespace):
    from zero_strategy import ZeroConfig, ZeroOptimizer
    from zero_strategy.engine import shard_module
    from zero_strategy.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=50257, n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64),
                block_size=args.seq)
    optimizers = _optimizers(model, args.muon if "Muon" in variant else None)
    if variant.startswith("DDP"):
        return DistributedDataParallel(model), optimizers
    config = ZeroConfig(stage=3)
    sharder = shard_module(model, config, optimizers=optimizers)
    return model, [ZeroOptimizer(opt, config, sharder=sharder) for opt in optimizers]


def _rank(rank: int, args: argparse.Namespace) -> dict:
    runs = {variant: _build(variant, args) for variant in VARIANTS}
    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    sent: dict[str, int] = {}  # all-to-all bytes this rank sent in the last step
    for step in range(args.steps + 1):
        g = torch.Generator().manual_seed(step * WORLD + rank)
        tokens = torch.randint(0, 50257, (args.batch, args.seq + 1), generator=g)
        for variant, (model, optimizers) in runs.items():  # the variants take turns, step by step
            dist.barrier()
            start = time.perf_counter()
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            sent[variant] = 0
            for opt in optimizers:
                opt.step()
                if hasattr(opt, "comm_stats"):  # each ZeroOptimizer's step closes the count: read it after each
                    sent[variant] += opt.comm_stats()["all_to_all"]
                opt.zero_grad()
            dist.barrier()
            if step:  # the first step builds the state
                times[variant].append(time.perf_counter() - start)
    out = {}
    for variant, (model, optimizers) in runs.items():
        out[variant] = {"step_s": statistics.median(times[variant]), "spread": [min(times[variant]), max(times[variant])],
                        "state_bytes": _state_bytes(optimizers), "all_to_all": sent[variant]}
    return out


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    result = _rank(rank, args)
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--muon", choices=("torch", "deepspeed"), default="torch",
                        help="torch's Muon beside AdamW, or DeepSpeed's Muon (zero_strategy.DeepSpeedMuon)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "result.json")
        mp.start_processes(_worker, args=(port, args, out), nprocs=WORLD, start_method="spawn")
        with open(out) as f:
            ranks = json.load(f)
    from zero_strategy.models.gpt import GPT

    n = sum(p.numel() for p in GPT(vocab_size=50257, n_layer=args.layers, n_embd=args.width,
                                   n_head=max(1, args.width // 64), block_size=args.seq).parameters())
    print(f"GPT, {args.layers} layers of {args.width}: {n / 1e6:.1f}M parameters; 2 ranks; batch {args.batch} x "
          f"{args.seq} tokens per rank; median of {args.steps} steps; Muon: {args.muon}'s")
    print("| variant | step (s) [min, max] | optimizer state per rank (MiB) rank 0 / rank 1 | all-to-all sent (MiB) |")
    print("|---|---|---|---|")
    for variant in VARIANTS:
        r0, r1 = ranks[0][variant], ranks[1][variant]
        sent = r0["all_to_all"] / 2**20
        print(f"| {variant} | {r0['step_s']:.2f} [{r0['spread'][0]:.2f}, {r0['spread'][1]:.2f}] | "
              f"{r0['state_bytes'] / 2**20:.1f} / {r1['state_bytes'] / 2**20:.1f} | {sent:.1f} |")


if __name__ == "__main__":
    main()
