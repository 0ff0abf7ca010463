"""DeepSpeed's tutorial loop through ``zero_strategy.initialize`` against the same loop through
DeepSpeed 0.19, on CPU (gloo) or CUDA, ZeRO stages 2 and 3: step time and peak resident memory.

    python benchmarks/bench_deepspeed_loop.py                           # 20M parameters, 2 CPU ranks
    python benchmarks/bench_deepspeed_loop.py --params-millions 0.2 --steps 2 --memory-steps 1   # quick check

Both engines get the same DeepSpeed config (micro batch, stage, AdamW from the config with
``"torch_adam": true`` so DeepSpeed needs no compiled op, clipping at 1.0) and run the same loop::

    loss = engine(inputs, labels=labels).loss; engine.backward(loss); engine.step()

on copies of one model (an MLP of residual blocks, built from the same seed) and the same batches.
Variants are ``zero_strategy-s<stage>`` and ``deepspeed-s<stage>``; the DeepSpeed ones run where
``import deepspeed`` works (``DS_ACCELERATOR=cpu`` is set on CPU) and are left out, with the reason,
elsewhere. In the timed run every variant lives in the same processes and they take turns step by
step in a rotating order, so machine noise falls on all alike; each step is timed barrier to
barrier. "ratio" is the median over rounds of zero_strategy's step over DeepSpeed's at the same
stage in the same round. "loss diff" is the largest relative difference of the two engines' losses
(the same arithmetic up to summation order). Peak RSS per rank: each variant then runs alone in
fresh processes; the peak (Linux VmHWM, reset through /proc/self/clear_refs after the imports)
over the resident size before the model was built, the largest over the ranks.
"""

from __future__ import annotations

import argparse
import json
import math
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
from torch import nn

ENGINES = ("zero_strategy", "deepspeed")


class Output:
    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss


class ResidualMLP(nn.Module):
    """``layers`` residual Linear blocks of ``width``, then a 10-way head; answers ``.loss``."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, 10)

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> Output:
        h = inputs
        for block in self.blocks:
            h = h + torch.tanh(block(h))  # (B, width)
        return Output(F.cross_entropy(self.head(h).float(), labels))


def width_for(params_millions: float, layers: int) -> int:
    """The width whose model has at least ``params_millions`` million parameters."""
    return max(8, math.ceil(math.sqrt(params_millions * 1e6 / layers)))


def ds_config(stage: int, batch: int) -> dict:
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "steps_per_print": 10**9, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}


def unavailable(engine: str) -> Optional[str]:
    if engine == "deepspeed":
        try:
            import deepspeed  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any failure to import: leave DeepSpeed out
            return f"`import deepspeed` failed ({type(e).__name__}: {e})"
    return None


def build(name: str, args: argparse.Namespace, device: torch.device) -> Any:
    """The engine of variant ``name`` (``<engine>-s<stage>``) over a fresh copy of the model."""
    engine_name, stage = name.rsplit("-s", 1)
    torch.manual_seed(args.seed)
    model = ResidualMLP(width_for(args.params_millions, args.layers), args.layers)
    config = ds_config(int(stage), args.batch)
    if engine_name == "deepspeed":
        import deepspeed

        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                               dist_init_required=False)
    else:
        from zero_strategy.deepspeed import initialize

        engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def batch(step: int, rank: int, args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    width = width_for(args.params_millions, args.layers)
    inputs, labels = torch.randn(args.batch, width, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    return inputs.to(device), labels.to(device)


def loop_step(engine: Any, inputs: torch.Tensor, labels: torch.Tensor) -> float:
    loss = engine(inputs, labels=labels).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_run(rank: int, names: list[str], args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    engines = {name: build(name, args, device) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    losses: dict[str, list[float]] = {name: [] for name in names}
    for step in range(args.warmup + args.steps):
        inputs, labels = batch(step, rank, args, device)
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:  # a rotating order: noise falls on every variant alike
            synchronize(device)
            dist.barrier()
            start = time.perf_counter()
            loss = loop_step(engines[name], inputs, labels)
            synchronize(device)
            dist.barrier()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
            losses[name].append(loss)
    return {"times": times, "losses": losses}


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss_run(rank: int, name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Peak resident bytes of one variant alone, over the resident size before its model was built."""
    baseline = _status_bytes("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM back to the current resident size
        resettable = True
    except OSError:
        resettable = False
    engine = build(name, args, device)
    for step in range(args.memory_steps):
        loop_step(engine, *batch(step, rank, args, device))
    peak = _status_bytes("VmHWM")
    return {"peak_over_baseline": peak - baseline if resettable else None, "peak": peak, "baseline": baseline}


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, job: str, names: list[str],
            out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(args.threads)
    from zero_strategy.deepspeed import init_distributed, initialize  # noqa: F401 - imported before RSS baselines

    init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    if any(n.startswith("deepspeed") for n in names):
        import deepspeed

        deepspeed.init_distributed(dist_backend=dist.get_backend())  # adopts the running group
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    result = timed_run(rank, names, args, device) if job == "time" else rss_run(rank, names[0], args, device)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # results written; DeepSpeed's and gloo's threads need not see interpreter shutdown


def spawn(args: argparse.Namespace, job: str, names: list[str]) -> list[Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_worker, args=(args.world_size, port, args, job, names, out), nprocs=args.world_size,
                           join=True, start_method="spawn")
        with open(out) as f:
            return json.load(f)


def report(names: list[str], timed: list[dict], rss: dict[str, list[dict]], args: argparse.Namespace) -> dict:
    rows, out = [], {}
    for stage in args.stages:
        ours, theirs = f"zero_strategy-s{stage}", f"deepspeed-s{stage}"
        med = {n: statistics.median(t for r in timed for t in r["times"][n]) for n in (ours, theirs) if n in names}
        entry: dict[str, Any] = {"step_ms": {n: 1e3 * v for n, v in med.items()},
                                 "peak_rss_mib": {n: max(r["peak_over_baseline"] or r["peak"] for r in rss[n]) / 2**20
                                                  for n in rss if n.endswith(f"-s{stage}")}}
        if theirs in names:
            rounds = [max(r["times"][ours][i] for r in timed) / max(r["times"][theirs][i] for r in timed)
                      for i in range(args.steps)]  # the slowest rank sets a round's step time
            entry["ratio"] = statistics.median(rounds)
            entry["loss_diff"] = max(abs(a - b) / abs(b) for r in timed
                                     for a, b in zip(r["losses"][ours], r["losses"][theirs]))
        out[stage] = entry
        rss_text = ", ".join(f"{n.split('-')[0]} {v:.0f}" for n, v in entry["peak_rss_mib"].items()) or "not run"
        ratio = f"{entry['ratio']:.2f}" if "ratio" in entry else "-"
        times = ", ".join(f"{n.split('-')[0]} {v:.1f}" for n, v in entry["step_ms"].items())
        diff = f"{entry['loss_diff']:.1e}" if "loss_diff" in entry else "-"
        rows.append(f"| {stage} | {times} | {ratio} | {rss_text} | {diff} |")
    print(f"\n{args.world_size} ranks, {args.params_millions:g}M parameters "
          f"(width {width_for(args.params_millions, args.layers)} x {args.layers} blocks), micro batch {args.batch}, "
          f"{args.steps} timed steps after {args.warmup}, {'CUDA' if torch.cuda.is_available() else 'CPU'}\n")
    print("| stage | median step ms | ratio zero_strategy / DeepSpeed | peak RSS per rank, MiB | loss diff |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    return out


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params-millions", type=float, default=20.0, help="model size, at least (default 20)")
    p.add_argument("--layers", type=int, default=8, help="residual blocks (default 8)")
    p.add_argument("--batch", type=int, default=32, help="micro batch per rank (default 32)")
    p.add_argument("--stages", type=lambda s: [int(x) for x in s.split(",")], default=[2, 3],
                   help="comma-separated ZeRO stages (default 2,3)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--memory-steps", type=int, default=3, help="steps of each variant's peak-RSS run (0: none)")
    p.add_argument("--world-size", type=int, default=None, help="ranks (default: 2 on CPU, every GPU with CUDA)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    if args.world_size is None:
        args.world_size = torch.cuda.device_count() if torch.cuda.is_available() else 2
    bad = [s for s in args.stages if s not in (1, 2, 3)]
    if bad or args.steps < 1 or args.world_size < 1:
        p.error(f"--stages takes 1, 2 or 3 (got {bad}); --steps and --world-size must be positive")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    left_out = {e: why for e in ENGINES if (why := unavailable(e))}
    for engine, why in left_out.items():
        print(f"{engine} left out: {why}")
    names = [f"{e}-s{s}" for s in args.stages for e in ENGINES if e not in left_out]
    timed = spawn(args, "time", names)
    rss = {name: spawn(args, "rss", [name]) for name in names} if args.memory_steps > 0 else {}
    results = report(names, timed, rss, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "left_out": left_out, "stages": results}, f, indent=1)


if __name__ == "__main__":
    main()
