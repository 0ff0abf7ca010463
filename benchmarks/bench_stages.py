"""Step time and memory of DDP, ZeRO stages 1-3, FSDP2 (and DeepSpeed ZeRO-3), on CPU or CUDA.

On CPU the ranks are gloo processes (2 by default, one per core here); with CUDA they are NCCL
processes, one per GPU (``--device``, ``--world-size``). Every variant trains its own copy of one
model (built fresh from the same seed, on the CPU, then moved) on the same batches; the variants
take turns step by step, in a rotating order, so machine noise falls on all of them alike. Each
step is timed barrier to barrier on every rank (the device synchronised first); the table gives
the median.

    python benchmarks/bench_stages.py --steps 10                   # 50M parameters, every variant
    python benchmarks/bench_stages.py --params-millions 2 --steps 2  # quick check
    python benchmarks/bench_stages.py --variants ddp,zero3,fsdp2 --comm --json out.json
    python benchmarks/bench_stages.py --steps 10 --out benchmarks/results_cpu  # JSON, markdown, PNG

``--out DIR`` writes ``results.json`` (everything measured), ``results.md`` (the printed report,
markdown tables) and ``results.png`` (step-time ratio against DDP, model-state bytes against the
formula and peak memory per variant; needs matplotlib: ``pip install -e ".[bench]"``).

Variants: ``ddp`` (torch DDP, the baseline), ``zero1``/``zero2``/``zero3`` (this package's engine;
stage 3 with one unit per ``ResidualBlock``, ``param_persistence_threshold`` at its default so the
biases stay whole), ``fsdp2`` (``torch.distributed.fsdp.fully_shard`` on every block, then on the
root), ``deepspeed3`` (DeepSpeed ZeRO-3, only where ``import deepspeed`` works; left out with a note
otherwise) and ``local`` (the same training without any communication, the compute floor).

"paired ratio" is the median over rounds of a variant's step over DDP's step in the same round,
which cancels noise that hits a whole round (other jobs on the machine). Each step is also cut
into phases (forward, backward, optimizer step; inside the engine: gradient reduction, the inner
optimizer's update, the parameter all-gathers; inside FSDP2: unshard, reshard, post-backward),
timed on rank 0 by wrappers set on the benchmark's own objects (no library file is changed), with
the minor page faults the step caused. ``--comm`` times each collective alone on one bucket;
``--profile ROWS`` prints torch.profiler's busiest ops per variant.

Memory, two columns:

- model-state bytes per rank, counted from live tensors after a backward (gradients present):
  ``zero_strategy.memory_stats`` for DDP and the engine; for FSDP2 the local shards (DTensor
  ``to_local()``) of parameters, gradients and optimizer state; for DeepSpeed ZeRO-3 the tensors
  its optimizer holds, by role (``stages_measure.DEEPSPEED3_ROLES``: its fp32 copy of the
  partition is master weights, in fp32 training too). Each storage is counted once, padding
  included.
- peak memory per rank. ``ru_maxrss`` only grows and counts the whole process, so a shared
  process cannot say which variant caused a peak. After the timed run, each variant therefore
  runs again alone in fresh processes (on CPU forked from the launcher, which holds no tensors;
  spawned on CUDA; ``--memory-steps`` steps): the resident size is read before the model is built,
  the peak (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``) after building and then
  per phase of every step, and the table gives the training peak above that pre-model baseline
  (the init peak is in the JSON), plus the last step phase by phase. Each variant runs twice:
  with malloc as a user gets it (glibc's as it comes, but for the engine's variants, which set its
  mmap threshold to 4 MiB as their default ``cpu_mmap_threshold_mb`` does) and with the threshold
  at 128 KiB for every variant, so that freed tensors go back to the OS at once and the resident
  size follows the live tensors (``--rss-malloc``). The timed run shares one process among the
  variants, so there the engine leaves glibc's rule as it comes (``cpu_mmap_threshold_mb=None``). Where ``clear_refs`` is refused,
  the whole process's ``ru_maxrss`` is reported instead. On CUDA the same runs also read device
  memory: ``torch.cuda.memory_allocated`` before the model is built, and the peak
  (``torch.cuda.max_memory_allocated``, reset per phase) above it.

The code: this file is the command line and the orchestration (the timed run, the fresh processes);
``stages_variants.py`` the model, the variants and the timed step; ``stages_measure.py`` memory,
parity, collectives and profiles; ``stages_report.py`` the markdown, JSON and PNG.

Workers leave through ``os._exit`` once their results are written (see ``_worker``).
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

# Run as a script (`python benchmarks/bench_stages.py`) there is no package and only benchmarks/ is on
# sys.path: add the repository root, so that one absolute form, `benchmarks.stages_*`, works here, under
# `python -m benchmarks.bench_stages` and on import (the sibling modules use it too; relative imports
# would fail in a script, and bare `import stages_*` under -m).
if not __package__:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.stages_measure import (MMAP_THRESHOLD, comm_bench, formula_bytes, full_parameters,  # noqa: E402
                                       max_param_diff, model_state_bytes, peak_rss_rank, profile_ops)
# plot_results: not used here, kept importable from this module (tests/test_bench_harness.py)
from benchmarks.stages_report import (NO_MATPLOTLIB, matplotlib_available, plot_results,  # noqa: E402,F401
                                      render_report, write_outputs)
from benchmarks.stages_variants import (DEFAULT_VARIANTS, VARIANTS, ResidualMLP, build_variants,  # noqa: E402
                                        device_name, make_batches, model_shape, rank_device, train_step,
                                        unavailable)
from zero_strategy.engine.buffers.malloc import set_mmap_threshold  # noqa: E402


# ---- the timed run on each rank ----------------------------------------------------------------

def run_rank(rank: int, args: argparse.Namespace) -> Optional[dict[str, Any]]:
    world = dist.get_world_size()
    width = model_shape(args.params_millions, args.layers)
    variants, failed = build_variants(args.variants, args, width)
    if not variants:
        raise RuntimeError(f"no variant could be built: {failed}")
    n_params = sum(p.numel() for p in ResidualMLP(width, args.layers).parameters())
    total_steps = args.warmup + args.steps
    device = rank_device(args)
    batches = make_batches(total_steps, args.batch, width, rank, device)
    for step, (x, y) in enumerate(batches):  # rotate who goes first: no variant always follows another
        k = step % len(variants)
        for v in variants[k:] + variants[:k]:
            train_step(v, x, y)

    base = next((v for v in variants if v.name == "ddp"), variants[0])  # the baseline of the ratios
    base_params = [p.clone() for p in full_parameters(base)]
    diffs = {}
    for v in variants:  # worst over ranks: gather the local figures
        loss_diff = max(abs(a - b) for a, b in zip(v.losses, base.losses))
        local = torch.tensor([loss_diff, max_param_diff(v, base_params)], dtype=torch.float64, device=device)
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        diffs[v.name] = local.tolist()
    del base_params
    # every variant takes the profiled step on the same batch, so parameters stay comparable
    profiles = {v.name: profile_ops(v, *batches[-1], args.profile) for v in variants} if args.profile else {}
    memory = {}
    for v in variants:  # the largest over ranks, key by key
        stats = model_state_bytes(v, *batches[-1])
        per_rank: list[Optional[dict]] = [None] * world
        dist.all_gather_object(per_rank, stats)
        memory[v.name] = None if stats is None else {k: max(s[k] for s in per_rank) for k in stats}
    comm = comm_bench(int(args.bucket_cap_mb * 2**20) // 4 // world * world, 3, device) if args.comm else None
    if rank != 0:
        return None

    t = slice(args.warmup, None)
    result = {
        "config": {**vars(args), "world_size": world, "width": width, "parameters": n_params,
                   "torch": torch.__version__, "threads_per_rank": torch.get_num_threads(), "baseline": base.name,
                   "backend": dist.get_backend(), "device_name": device_name(device),
                   "command": " ".join(["python benchmarks/bench_stages.py", *args.argv])},
        "left_out": failed,
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
            "peak_rss": {},
        }
    return result


# ---- launch ------------------------------------------------------------------------------------

def _worker(rank: int, world: int, port: int, args: argparse.Namespace, job: str, out_path: str) -> None:
    """``job``: "time" (every variant, the timed run) or "rss:MODE:VARIANT" (one variant's RSS run)."""
    mmap_set = None
    if job.startswith("rss:mmap:"):
        mmap_set = set_mmap_threshold(MMAP_THRESHOLD / 2**20)  # the engine's own call (and trim at twice it)
    args.engine_sets_malloc = job.startswith("rss:default:")  # its default, as users meet it, in a variant alone
    torch.set_num_threads(args.threads)
    # what a launcher sets, which DeepSpeed reads (deepspeed3), and its CPU accelerator on CPU
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), RANK=str(rank), WORLD_SIZE=str(world))
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.device == "cuda":  # one GPU per rank (NCCL refuses two ranks on one device)
        torch.cuda.set_device(rank % torch.cuda.device_count())
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        if job == "time":
            result = run_rank(rank, args)
        else:
            mine = {**peak_rss_rank(args, job.split(":")[2]), "mmap_threshold_set": mmap_set}
            per_rank: list[Optional[dict]] = [None] * world
            dist.all_gather_object(per_rank, mine)
            result = {"per_rank": per_rank} if rank == 0 else None
        if result is not None:
            with open(out_path, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()
    # With FSDP2 in the process, gloo's worker threads outlive destroy_process_group (something in
    # torch still holds the group: 7 threads before and after, against 7 -> 3 without FSDP2). One
    # of them can then drop a tensor during interpreter shutdown, needing the GIL, and abort the
    # process ("terminate called without an active exception", 1 run in 3 here). The results are
    # written: leave without the interpreter's shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(args: argparse.Namespace, job: str, start_method: str = "spawn") -> dict[str, Any]:
    """Run ``job`` on fresh processes. The RSS runs fork on CPU (this process has imported torch and
    zero_strategy but holds no tensors or process group): a spawned child spends ~5 s importing.
    On CUDA they spawn too: a forked child cannot initialise CUDA once the parent has asked it
    anything."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(_worker, args=(args.world_size, free_port(), args, job, out), nprocs=args.world_size,
                           join=True, start_method=start_method)
        with open(out) as f:
            return json.load(f)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params-millions", type=float, default=50.0, help="model size, at least this many (default 50)")
    p.add_argument("--layers", type=int, default=11,
                   help="residual blocks, one Linear each (+1 head); the width follows from the size (default 11)")
    p.add_argument("--batch", type=int, default=32, help="rows per rank per step (default 32)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS,
                   help=f"comma-separated, of {','.join(VARIANTS)} (default {DEFAULT_VARIANTS}); "
                        "one that cannot run here is left out with a note")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket and ZeRO segment size (default 25)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cpu: gloo ranks; cuda: NCCL ranks, one GPU each (default auto: cuda where there is one)")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks (default: 2 on CPU, one per core here; every GPU with CUDA)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory-steps", type=int, default=3,
                   help="training steps of each variant's own peak-RSS run (default 3; 0: no RSS runs)")
    p.add_argument("--rss-malloc", choices=("both", "default", "mmap"), default=None,
                   help="the peak-RSS runs: with glibc's default malloc, with its mmap threshold at 128 KiB "
                        "(freed tensors go back to the OS: RSS follows live tensors), or both (default: both on "
                        "CPU; default with CUDA, where the device memory is the point and each run spawns)")
    p.add_argument("--comm", action="store_true", help="also time each collective on one bucket")
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="print torch.profiler's top ROWS ops of one extra step per variant (default 0: off)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--out", metavar="DIR",
                   help="write results.json, results.md (the report's tables) and results.png (a plot; needs "
                        "matplotlib) into DIR, made if missing")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    args.argv = argv  # recorded in the results: the command that made them
    args.variants = list(dict.fromkeys(v.strip() for v in args.variants.split(",") if v.strip()))
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or not args.variants:
        p.error(f"--variants {bad or 'empty'}: choose from {', '.join(VARIANTS)}")
    if args.steps < 1 or args.warmup < 0 or args.memory_steps < 0:
        p.error(f"--steps {args.steps} must be >= 1, --warmup {args.warmup} and --memory-steps "
                f"{args.memory_steps} >= 0")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False here (a CPU build of torch, or no GPU); "
                "use --device cpu")
    gpus = torch.cuda.device_count() if args.device == "cuda" else None
    if args.world_size is None:
        args.world_size = gpus or 2
    if args.rss_malloc is None:
        args.rss_malloc = "default" if args.device == "cuda" else "both"
    if args.world_size < 1 or (gpus and args.world_size > gpus):
        p.error(f"--world-size {args.world_size}: must be >= 1" + (f" and at most the {gpus} GPU(s) here, one "
                                                                    "rank per GPU" if gpus else ""))
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    left_out = {name: why for name in args.variants if (why := unavailable(name))}
    args.variants = [name for name in args.variants if name not in left_out]
    if not args.variants:
        raise SystemExit(f"no variant can run here: {left_out}")
    if args.out and not matplotlib_available():
        print(f"note: {NO_MATPLOTLIB}; --out will write results.json and results.md but no results.png",
              file=sys.stderr)
    result = _spawn(args, "time")
    result["config"]["date"] = time.strftime("%Y-%m-%d %H:%M")
    result["left_out"] = {**left_out, **result["left_out"]}
    memory_start = "fork" if args.device == "cpu" else "spawn"
    for mode in (("default", "mmap") if args.rss_malloc == "both" else (args.rss_malloc,)) if args.memory_steps else ():
        for name, variant in result["variants"].items():
            per_rank = _spawn(args, f"rss:{mode}:{name}", memory_start)["per_rank"]
            worst = max(per_rank, key=lambda r: r["train_peak_over_baseline"])
            variant.setdefault("peak_rss", {})[mode] = {**worst, "per_rank": per_rank}
            if per_rank[0].get("device") and "peak_device" not in variant:  # malloc's mode does not matter here
                worst = max(per_rank, key=lambda r: r["device"]["train_peak_over_baseline"])
                variant["peak_device"] = {**worst["device"], "per_rank": [r["device"] for r in per_rank],
                                          "last_step_phases_over_baseline": worst["last_step_phases_over_baseline"]}
    report = render_report(result)
    print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {args.json}")
    if args.out:
        for path in write_outputs(result, report, args.out):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
