"""Step time of ZeRO stages 1 and 2 against DDP, side by side on 2 gloo ranks (CPU).

Every variant trains its own copy of one model (built fresh from the same seed) on the same
batches; the variants take turns step by step, in a rotating order, so machine noise falls on all
of them alike. Each step is timed barrier to barrier on every rank; the table gives the median.

    python benchmarks/bench_stages.py                              # 50M parameters, 5 timed steps
    python benchmarks/bench_stages.py --params-millions 2 --steps 2  # quick check
    python benchmarks/bench_stages.py --variants ddp,zero1,zero2,local --comm --json out.json

"paired ratio" is the median over rounds of a variant's step over DDP's step in the same round,
which cancels noise that hits a whole round (other jobs on the machine). Each step is also cut
into phases (forward, backward, optimizer step; inside the engine: gradient reduction, the inner
optimizer's update, the parameter all-gather), timed on rank 0 by wrappers set on the benchmark's
own ZeroOptimizer instances, with the minor page faults the step caused. ``--comm`` times each
collective alone on one bucket; ``--profile ROWS`` prints torch.profiler's busiest ops per variant.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import resource
import socket
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from zero_strategy import ZeroConfig, ZeroOptimizer
from zero_strategy.engine import Collectives

try:  # written in parallel; the memory columns are left out where it does not exist
    from zero_strategy.memory import estimate_memory, memory_stats
except ImportError:
    estimate_memory = memory_stats = None

VARIANTS = ("ddp", "zero1", "zero2", "local")
"""local: the same training without any communication (each rank alone), the compute floor."""


# ---- model and data ----------------------------------------------------------------------------

class ResidualMLP(nn.Module):
    """``layers`` residual blocks ``x + gelu(Linear(x))`` of width ``width``, then a head."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, width) -> (B, width)
        for block in self.blocks:
            x = x + F.gelu(block(x)) / math.sqrt(len(self.blocks))
        return self.head(x)


def model_shape(params_millions: float, layers: int) -> int:
    """Width (a multiple of 64) giving at least ``params_millions`` over layers + 1 square Linears."""
    per_layer = params_millions * 1e6 / (layers + 1)
    return max(64, math.ceil(math.sqrt(per_layer) / 64) * 64)


def make_batches(n: int, batch: int, width: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` distinct (input, target) pairs for this rank, the same for every variant."""
    out = []
    for step in range(n):
        g = torch.Generator().manual_seed(1000 * step + rank)
        out.append((torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)))
    return out


# ---- phase timers --------------------------------------------------------------------------------

def timed(phases: dict[str, float], key: str, fn: Callable) -> Callable:
    """``fn`` that adds its wall time to ``phases[key]``."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[key] = phases.get(key, 0.0) + time.perf_counter() - t0
    return wrapper


def instrument_zero(opt: ZeroOptimizer, phases: dict[str, float]) -> None:
    """Time the engine's parts by wrapping attributes of this one instance (no file changes).

    Stage 1 reduces in ``reducer.reduce`` (called from step); stage 2 launches each segment's
    reduce-scatter from the gradient hooks (``_launch``) and waits for them when backward ends
    (``_finish_inflight``), so those two land inside the backward phase.
    """
    parts = [(opt.reducer, "reduce", "step.reduce_scatter(s1)"), (opt.reducer, "_launch", "bwd.launch_rs(s2)"),
             (opt.reducer, "_finish_inflight", "bwd.wait_rs(s2)"),
             (opt.reducer, "received_anywhere", "step.flags_allreduce"),
             (opt.inner, "step", "step.inner_adamw"), (opt, "_all_gather_params", "step.all_gather")]
    for obj, attr, key in parts:  # the engine is being edited: a part renamed there is just not timed
        if callable(getattr(obj, attr, None)):
            setattr(obj, attr, timed(phases, key, getattr(obj, attr)))


# ---- one variant -------------------------------------------------------------------------------

@dataclass
class Variant:
    name: str
    model: nn.Module  # the module the user holds (parameters compared across variants)
    forward: Callable[[torch.Tensor], torch.Tensor]
    opt: torch.optim.Optimizer
    step_times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    phases: list[dict[str, float]] = field(default_factory=list)
    _current: dict[str, float] = field(default_factory=dict)


def build_variant(name: str, args: argparse.Namespace, width: int) -> Variant:
    torch.manual_seed(args.seed)
    model = ResidualMLP(width, args.layers)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if name == "ddp":
        ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
        return Variant(name, model, ddp, inner)
    if name == "local":
        return Variant(name, model, model, inner)
    stage = int(name[-1])
    opt = ZeroOptimizer(inner, ZeroConfig(stage=stage, bucket_cap_mb=args.bucket_cap_mb))
    v = Variant(name, model, model, opt)
    instrument_zero(opt, v._current)
    return v


def train_step(v: Variant, x: torch.Tensor, y: torch.Tensor, record: bool = True) -> None:
    """One step, timed barrier to barrier; phases timed locally; kept unless ``record`` is False."""
    v._current.clear()
    dist.barrier()
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    loss = F.mse_loss(v.forward(x), y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    v.opt.step()
    t3 = time.perf_counter()
    v.opt.zero_grad(set_to_none=True)
    t4 = time.perf_counter()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0  # fresh pages touched, all threads
    dist.barrier()
    t5 = time.perf_counter()
    if not record:
        return
    v.losses.append(loss.item())
    v.step_times.append(t5 - t0)
    v.phases.append({"forward": t1 - t0, "backward": t2 - t1, "opt.step": t3 - t2, "zero_grad": t4 - t3,
                     "barrier_wait": t5 - t4, **v._current, "minor_page_faults": faults})


# ---- measurements besides time -----------------------------------------------------------------

def model_state_bytes(v: Variant, x: torch.Tensor, y: torch.Tensor) -> Optional[dict[str, int]]:
    """``memory_stats`` for this rank while gradients are live (after a backward), or None.

    Untimed; the gradients are dropped again. DDP's own bucket copy of the gradients is not a
    tensor of the model or optimizer, so it is not counted.
    """
    if memory_stats is None:
        return None
    F.mse_loss(v.forward(x), y).backward()
    if isinstance(v.opt, ZeroOptimizer):
        v.opt.reduce_gradients()  # stage 1 reduces in step; this is where its gradients end up
    stats = memory_stats(v.model, [v.opt])
    v.opt.zero_grad(set_to_none=True)
    return stats


def formula_bytes(name: str, n_params: int, world: int) -> Optional[int]:
    """The ZeRO paper's per-rank model-state bytes for this variant (fp32 Adam), or None."""
    if estimate_memory is None:
        return None
    stage, n = {"ddp": (0, world), "local": (0, 1), "zero1": (1, world), "zero2": (2, world)}[name]
    return estimate_memory(n_params, stage=stage, world_size=n, precision="32-true")["total"]


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    with torch.no_grad():
        return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def comm_bench(numel: int, repeats: int) -> dict[str, dict[str, float]]:
    """Median seconds of each collective the variants use, on one bucket of ``numel`` fp32.

    ``issue_s`` is how long the asynchronous call holds the calling thread (time that cannot
    overlap backward), ``total_s`` the call plus its wait.
    """
    comm = Collectives()  # the engine's own calls
    full = torch.randn(numel)
    shard = torch.empty(numel // comm.world_size)
    ops = {
        "all_reduce": lambda: dist.all_reduce(full, async_op=True),
        "reduce_scatter": lambda: comm.reduce_scatter(shard, full),
        "all_gather": lambda: comm.all_gather(full, shard),
    }
    out = {}
    for name, op in ops.items():
        issue, total = [], []
        for _ in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            work = op()
            t1 = time.perf_counter()
            work.wait()
            issue.append(t1 - t0)
            total.append(time.perf_counter() - t0)
        out[name] = {"issue_s": statistics.median(issue[1:]), "total_s": statistics.median(total[1:])}
    return out


def profile_ops(v: Variant, x: torch.Tensor, y: torch.Tensor, rows: int) -> str:
    """torch.profiler's busiest ops (self CPU time) in one unrecorded step of ``v``, this rank."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(v, x, y, record=False)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


# ---- the run on each rank ----------------------------------------------------------------------

def run_rank(rank: int, args: argparse.Namespace) -> Optional[dict[str, Any]]:
    world = dist.get_world_size()
    width = model_shape(args.params_millions, args.layers)
    variants = [build_variant(name, args, width) for name in args.variants]
    n_params = sum(p.numel() for p in variants[0].model.parameters())
    total_steps = args.warmup + args.steps
    batches = make_batches(total_steps, args.batch, width, rank)
    for step, (x, y) in enumerate(batches):  # rotate who goes first: no variant always follows another
        k = step % len(variants)
        for v in variants[k:] + variants[:k]:
            train_step(v, x, y)

    base = next((v for v in variants if v.name == "ddp"), variants[0])  # the baseline of the ratios
    diffs = {}
    for v in variants:  # worst over ranks: gather the local figures
        loss_diff = max(abs(a - b) for a, b in zip(v.losses, base.losses))
        local = torch.tensor([loss_diff, max_param_diff(v.model, base.model)], dtype=torch.float64)
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        diffs[v.name] = local.tolist()
    # every variant takes the profiled step on the same batch, so parameters stay comparable
    profiles = {v.name: profile_ops(v, *batches[-1], args.profile) for v in variants} if args.profile else {}
    memory = {v.name: model_state_bytes(v, *batches[-1]) for v in variants}
    comm = comm_bench(int(args.bucket_cap_mb * 2**20) // 4 // world * world, 3) if args.comm else None
    if rank != 0:
        return None

    t = slice(args.warmup, None)
    result = {
        "config": {**vars(args), "world_size": world, "width": width, "parameters": n_params,
                   "torch": torch.__version__, "threads_per_rank": torch.get_num_threads(), "baseline": base.name},
        "variants": {},
        "comm_bucket_s": comm,
        "profiles_rank0": profiles,
    }
    base_median = statistics.median(base.step_times[t])
    for v in variants:
        median = statistics.median(v.step_times[t])
        keys = list(dict.fromkeys(k for p in v.phases[t] for k in p))
        result["variants"][v.name] = {
            "median_step_s": median,
            "ratio_to_baseline": median / base_median,
            # each round's step over DDP's step of the same round: noise that hits a round cancels
            "paired_ratio_to_baseline": statistics.median(a / b for a, b in zip(v.step_times[t], base.step_times[t])),
            "step_times_s": v.step_times[t],
            "phases_median": {k: statistics.median(p.get(k, 0.0) for p in v.phases[t]) for k in keys},
            "losses_rank0": v.losses,
            "final_loss_rank0": v.losses[-1],
            "max_loss_diff_vs_baseline": diffs[v.name][0],
            "max_param_diff_vs_baseline": diffs[v.name][1],
            "model_state_bytes": memory[v.name],
            "formula_bytes": formula_bytes(v.name, n_params, world),
        }
    return result


def print_report(result: dict[str, Any]) -> None:
    c = result["config"]
    vs, base = result["variants"], c["baseline"]
    print(f"\n### ZeRO stages vs {base}: {c['parameters'] / 1e6:.1f}M parameters "
          f"({c['layers'] + 1} Linear {c['width']}x{c['width']}), "
          f"fp32 AdamW, batch {c['batch']}/rank, {c['world_size']} gloo ranks x {c['threads_per_rank']} thread, "
          f"bucket {c['bucket_cap_mb']} MiB, {c['warmup']} warm-up + {c['steps']} timed steps, torch {c['torch']}\n")
    has_mem = any(v["model_state_bytes"] for v in vs.values())
    has_formula = any(v["formula_bytes"] for v in vs.values())
    head = ["variant", "median step (s)", f"ratio vs {base}", "paired ratio", "final loss (rank 0)",
            f"max |Δloss| vs {base}", f"max |Δparam| vs {base}"]
    if has_mem:
        head.append("model-state MiB/rank (measured)")
    if has_formula:
        head.append("MiB/rank (formula)")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for name, v in vs.items():
        row = [name, f"{v['median_step_s']:.3f}", f"{v['ratio_to_baseline']:.2f}x",
               f"{v['paired_ratio_to_baseline']:.2f}x", f"{v['final_loss_rank0']:.6f}"]
        row += (["n/a (no averaging)"] * 2 if name == "local"
                else [f"{v['max_loss_diff_vs_baseline']:.2e}", f"{v['max_param_diff_vs_baseline']:.2e}"])
        if has_mem:
            m = v["model_state_bytes"]
            row.append(f"{m['total'] / 2**20:.1f} (p {m['params'] / 2**20:.0f}, g {m['grads'] / 2**20:.0f}, "
                       f"os {m['optimizer_states'] / 2**20:.0f})")
        if has_formula:
            row.append(f"{v['formula_bytes'] / 2**20:.1f}")
        print("| " + " | ".join(row) + " |")
    if not has_mem:
        print("\n(zero_strategy.memory.memory_stats is not available: measured bytes left out)")

    keys = []
    for v in vs.values():
        keys += [k for k in v["phases_median"] if k not in keys]
    print("\nPhases, rank 0, median seconds per step (bwd.* are inside backward, step.* inside opt.step; "
          "page faults: a count, the whole process):\n")
    print("| phase | " + " | ".join(vs) + " |")
    print("|---|" + "|".join("---" for _ in vs) + "|")
    for k in keys:
        cells = [f"{v['phases_median'][k]:{'.0f' if 'faults' in k else '.4f'}}" if k in v["phases_median"] else ""
                 for v in vs.values()]
        print(f"| {k} | " + " | ".join(cells) + " |")
    if result["comm_bucket_s"]:
        print(f"\nCollectives on one {c['bucket_cap_mb']} MiB bucket, median s "
              "(issue: how long the async call holds the caller):\n")
        print("| collective | issue | issue + wait |\n|---|---|---|")
        for k, t in result["comm_bucket_s"].items():
            print(f"| {k} | {t['issue_s']:.4f} | {t['total_s']:.4f} |")
    for name, table in result["profiles_rank0"].items():
        print(f"\ntorch.profiler, one step of {name}, rank 0:\n{table}")


# ---- launch ------------------------------------------------------------------------------------

def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = run_rank(rank, args)
        if result is not None:
            print_report(result)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=2)
                print(f"\nwrote {args.json}")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params-millions", type=float, default=50.0, help="model size, at least this many (default 50)")
    p.add_argument("--layers", type=int, default=11,
                   help="residual Linear blocks (+1 head); the width follows from the size (default 11)")
    p.add_argument("--batch", type=int, default=32, help="rows per rank per step (default 32)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--variants", default="ddp,zero1,zero2", help=f"comma-separated, of {','.join(VARIANTS)}")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket and ZeRO segment size (default 25)")
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2: one per core here)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--comm", action="store_true", help="also time each gloo collective on one bucket")
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="print torch.profiler's top ROWS ops of one extra step per variant (default 0: off)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or not args.variants:
        p.error(f"--variants {bad or 'empty'}: choose from {', '.join(VARIANTS)}")
    if args.steps < 1 or args.warmup < 0:
        p.error(f"--steps {args.steps} must be >= 1 and --warmup {args.warmup} >= 0")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    mp.spawn(_worker, args=(args.world_size, free_port(), args), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
