"""A mixture-of-experts model at stage-3 defaults against DDP (2 gloo ranks): issue 52.

    python benchmarks/bench_moe.py [--layers 12 --experts 8 --dim 512 --ffn 1024] [--steps 12] [--rounds 3]
                                   [--variants ddp,zero3] [--routing router|hash]

The model is written the common way: each layer an attention-sized mixing Linear and a mixture of
experts (a router Linear and an ``nn.ModuleList`` of expert MLPs, top-2; each expert runs only on
the tokens routed to it), so ranks call different experts. With the defaults (12 layers of 8 experts
of 512-1024-512) it holds 108M parameters. Variants, each in a fresh pair of processes, in turn for
``--rounds`` rounds (interleaved, so that a busy machine weighs on all alike):

- ``ddp``: torch DistributedDataParallel with ``find_unused_parameters=True`` (what MoE needs there);
- ``zero3``: ``ZeroConfig(stage=3)`` with no other option. With ``--routing router`` the plan sees
  each layer's router beside its experts and makes the layer one unit ([Note: leaf modules] in
  zero_strategy/engine/params/plan.py); with ``--routing hash`` (experts chosen by token, no router:
  ``ddp`` then runs the same model) the ranks part in the first pass and the layer is learned
  ([Note: learned leaves] in zero_strategy/engine/params/leaves.py).

Each run trains ``--steps`` steps of fp32 AdamW on per-rank batches of ``--tokens`` tokens and reports
per rank the median step time (the first step left out), the process's peak resident memory (VmHWM),
and for ``zero3`` ``memory_stats()`` (model state against the formula 16 x params / N, and the
workspace: gathered buffers kept free for reuse) and the most bytes of units gathered at once,
sampled at every module's forward and at every unit's gather in backward of the last step, against
one layer's experts. Printed: the medians over rounds and the ratio to DDP.
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

VARIANTS = ("ddp", "zero3")


class Expert(nn.Module):
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, ffn)
        self.down = nn.Linear(ffn, dim)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    """Top-2 routing over a ModuleList of experts, each run on the tokens routed to it."""

    def __init__(self, dim: int, ffn: int, experts: int, routing: str) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False) if routing == "router" else None
        self.experts = nn.ModuleList(Expert(dim, ffn) for _ in range(experts))

    def forward(self, x):  # (T, dim)
        if self.gate is not None:
            weights, idx = torch.softmax(self.gate(x), -1).topk(2, -1)  # (T, 2)
        else:  # by token: the first two features' signs and magnitudes
            idx = (x[:, :2].detach() * 1000).long().abs() % len(self.experts)
            weights = torch.full(idx.shape, 0.5)
        out = torch.zeros_like(x)
        for slot in range(2):
            for e, expert in enumerate(self.experts):
                rows = (idx[:, slot] == e).nonzero().squeeze(1)
                if rows.numel():
                    out = out.index_add(0, rows, weights[rows, slot, None] * expert(x[rows]))
        return out


class Layer(nn.Module):
    def __init__(self, dim: int, ffn: int, experts: int, routing: str) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.mix = nn.Linear(dim, dim)  # an attention's weight, standing in for it
        self.moe = MoE(dim, ffn, experts, routing)

    def forward(self, x):
        x = x + self.mix(self.norm1(x))
        return x + self.moe(self.norm2(x))


class MoEModel(nn.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.dim)
        self.layers = nn.ModuleList(Layer(args.dim, args.ffn, args.experts, args.routing) for _ in range(args.layers))
        self.norm = nn.LayerNorm(args.dim)
        self.head = nn.Linear(args.dim, args.vocab, bias=False)

    def forward(self, ids):  # (T,) -> (T, vocab)
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def _kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _gathered_bytes(sharder) -> int:
    from zero_strategy.engine.params.unit import UnitState

    return sum(g.layout.numel * g.dtype.itemsize for u in sharder.units if u.state is not UnitState.RELEASED
               for g in u.groups)


def run(rank: int, world: int, port: int, args: argparse.Namespace, variant: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from zero_strategy import ZeroConfig, ZeroOptimizer, count_parameters, estimate_memory, memory_stats
    from zero_strategy.engine import shard_module

    torch.manual_seed(0)
    model = MoEModel(args)
    numel = sum(p.numel() for p in model.parameters())
    layer_experts = sum(p.numel() * p.element_size() for p in model.layers[0].moe.experts.parameters())
    sharder = None
    if variant == "ddp":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        forward = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    else:
        config = ZeroConfig(stage=3)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
        sharder = shard_module(model, config)
        opt = ZeroOptimizer(inner, config, sharder=sharder)
        forward = model
    peak_gathered = [0]

    def sample(*_args) -> None:
        peak_gathered[0] = max(peak_gathered[0], _gathered_bytes(sharder))

    times, losses = [], []
    for step in range(args.steps):
        hooks = []
        if sharder is not None and step == args.steps - 1:  # the last step: sample what is gathered
            hooks = [m.register_forward_pre_hook(sample) for m in model.modules()]
            hooks += [m.register_forward_hook(sample) for m in model.modules()]
            hooks += [p.register_hook(lambda grad: sample() or grad) for p in model.parameters() if p.requires_grad
                      and p.numel() > 0]
        g = torch.Generator().manual_seed(1000 * step + rank)
        ids = torch.randint(0, args.vocab, (args.tokens + 1,), generator=g)
        dist.barrier()
        start = time.perf_counter()
        loss = F.cross_entropy(forward(ids[:-1]), ids[1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        for h in hooks:
            h.remove()
    result = {"params": numel, "step_s": times, "losses": losses, "peak_rss": _kib("VmHWM"),
              "layer_experts": layer_experts}
    if sharder is not None:
        stats = memory_stats(model, [opt])
        result.update(model_state=stats["total"], workspace=stats["workspace"], peak_gathered=peak_gathered[0],
                      formula=estimate_memory(count_parameters(model), stage=3, world_size=world)["total"],
                      units=[u.name for u in sharder.units], plan_leaves=len(sharder.plan.leaves),
                      learned=list(sharder.learner.learned) if sharder.learner is not None else [])
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(args: argparse.Namespace, variant: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.start_processes(run, args=(2, _free_port(), args, variant, out), nprocs=2, start_method="spawn")
        return [json.load(open(f"{out}.{r}")) for r in range(2)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per rank per step")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3, help="each variant once per round, in turn")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--routing", default="router", choices=["router", "hash"])
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    if "ddp" not in variants or any(v not in VARIANTS for v in variants):
        parser.error(f"--variants {args.variants}: choose among {', '.join(VARIANTS)}, ddp among them")
    runs: dict[str, list[list[dict]]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for variant in variants:
            runs[variant].append(measure(args, variant))
    first = runs["ddp"][0][0]
    print(f"2 gloo ranks, 1 thread each, fp32 AdamW; {args.layers} layers of {args.experts} experts "
          f"({args.dim}-{args.ffn}-{args.dim}, top-2, routing: {args.routing}), {first['params'] / 1e6:.1f}M "
          f"parameters; {args.tokens} tokens per rank, {args.steps} steps, {args.rounds} rounds; torch "
          f"{torch.__version__}")
    ddp_step = statistics.median(statistics.median(r["step_s"][1:] or r["step_s"]) for ranks in runs["ddp"]
                                 for r in ranks)
    ddp_rss = statistics.median(max(r["peak_rss"] for r in ranks) for ranks in runs["ddp"])
    print(f"{'variant':8} {'step (median)':>14} {'vs DDP':>7} {'peak RSS/rank':>14} {'vs DDP':>7} "
          f"{'max |loss - DDP|':>17}")
    for variant, rounds in runs.items():
        step = statistics.median(statistics.median(r["step_s"][1:] or r["step_s"]) for ranks in rounds for r in ranks)
        rss = statistics.median(max(r["peak_rss"] for r in ranks) for ranks in rounds)
        diff = max(abs(a - b) for ranks, ddp in zip(rounds, runs["ddp"]) for r, d in zip(ranks, ddp)
                   for a, b in zip(r["losses"], d["losses"]))
        print(f"{variant:8} {step:12.3f} s {step / ddp_step:6.2f}x {rss / 2**20:10.0f} MiB {rss / ddp_rss:6.2f}x "
              f"{diff:17.2e}")
    if "zero3" in runs:
        z = runs["zero3"][-1][0]
        print(f"zero3: {len(z['units'])} units ({z['plan_leaves']} leaves planned, learned: {z['learned'] or 'none'}); "
              f"model state (memory_stats) {z['model_state'] / 2**20:.0f} MiB per rank = "
              f"{z['model_state'] / z['formula']:.3f} x the formula ({z['formula'] / 2**20:.0f} MiB); workspace "
              f"{max(r['workspace'] for ranks in runs['zero3'] for r in ranks) / 2**20:.0f} MiB; most gathered at "
              f"once in the last step {max(r['peak_gathered'] for ranks in runs['zero3'] for r in ranks) / 2**20:.0f} "
              f"MiB, one layer's experts {z['layer_experts'] / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
