"""The training stall of a checkpoint save: synchronous against ``async_save``, side by side.

    python benchmarks/bench_async_save.py                        # 100M parameters, 2 ranks, stage 3
    python benchmarks/bench_async_save.py --params-millions 1 --layers 4 --rounds 1   # a quick check that it runs

The model is bench_checkpoint.py's (a stack of square Linear layers, AdamW). Each round trains the
same window of steps three times, in an order that rotates from round to round: without a save,
with a synchronous save after its first step, and with a background save there (``BackgroundSaver``,
what ``async_save=True`` gives the front ends). The stall of a variant is its window's wall time
less the window without a save, so a background writer that slows the steps after the save is
counted, not only the time ``save_sharded`` takes to return. The window ends when the background
save has committed. Prints the medians over rounds and async's stall over the synchronous one
(goal: at most 0.10). Runs on gloo processes on CPU; the files go to --dir (a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench_checkpoint import build
from zero_strategy.checkpoint import save_sharded
from zero_strategy.checkpoint.background import BackgroundSaver
from zero_strategy.engine import Collectives

VARIANTS = ("none", "sync", "async")


def window(model, opt, sharder, stage: int, steps: int, batch: torch.Tensor, variant: str, path: Path,
           saver: BackgroundSaver) -> float:
    """Seconds for ``steps`` training steps with the variant's save after the first."""
    dist.barrier()
    start = time.perf_counter()
    call = 0.0
    for step in range(steps):
        model(batch).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step == 0 and variant != "none":
            called = time.perf_counter()
            save_sharded(path, {"optimizer_states": [{}]}, model, [opt], sharder, Collectives(), stage,
                         background=saver if variant == "async" else None)
            call = time.perf_counter() - called
    saver.wait()  # the window ends with the checkpoint committed
    dist.barrier()
    return time.perf_counter() - start, call


def worker(rank: int, world_size: int, port: int, args: argparse.Namespace, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    width = int((args.params_millions * 1e6 / args.layers) ** 0.5)
    model, opt, sharder = build(args.stage, width, args.layers)
    batch = torch.randn(args.batch, width)
    saver = BackgroundSaver(model)
    folder = Path(args.dir)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    calls: dict[str, list[float]] = {v: [] for v in VARIANTS}  # how long save_sharded took to return
    window(model, opt, sharder, args.stage, 2, batch, "async", folder / "warm", saver)  # buffers and group made
    for r in range(args.rounds):
        order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
        for variant in order:
            took, call = window(model, opt, sharder, args.stage, args.steps, batch, variant, folder / f"{variant}{r}",
                                saver)
            times[variant].append(took)
            calls[variant].append(call)
    if rank == 0:
        med = {v: statistics.median(t) for v, t in times.items()}
        stall = {v: med[v] - med["none"] for v in ("sync", "async")}
        result = {"params_millions": args.params_millions, "stage": args.stage, "world_size": world_size,
                  "steps": args.steps, "rounds": args.rounds, "window_s": med, "stall_s": stall,
                  "async_over_sync": stall["async"] / stall["sync"] if stall["sync"] > 0 else None,
                  "call_s": {v: statistics.median(c) for v, c in calls.items()},
                  "buffer_mib": saver.buffer_bytes() / 2**20, "all_s": times}
        Path(out).write_text(json.dumps(result, indent=1))
    saver.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-millions", type=float, default=100.0)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--stage", type=int, default=3, choices=[1, 2, 3])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="steps per window (the save after the first)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    made = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="bench_async_save_")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(args.dir) / "result.json"
    try:
        mp.spawn(worker, args=(args.world_size, port, args, str(out)), nprocs=args.world_size)
        result = json.loads(out.read_text())
    finally:
        if made:
            shutil.rmtree(args.dir, ignore_errors=True)
    med, stall = result["window_s"], result["stall_s"]
    print(f"{args.params_millions:g}M parameters, stage {args.stage}, {args.world_size} ranks, {args.steps} steps "
          f"a window, {args.rounds} rounds (medians); host buffers {result['buffer_mib']:.0f} MiB per rank")
    print(f"  window without a save  {med['none']:.3f} s")
    call = result["call_s"]
    print(f"  synchronous save       {med['sync']:.3f} s   stall {stall['sync']:.3f} s   (the save call {call['sync']:.3f} s)")
    print(f"  async_save             {med['async']:.3f} s   stall {stall['async']:.3f} s   (the save call {call['async']:.3f} s)")
    if result["async_over_sync"] is not None:
        print(f"  async stall / sync stall: {result['async_over_sync']:.3f} (goal: at most 0.10)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
