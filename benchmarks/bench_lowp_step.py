"""The CPU optimizer step with low-precision state against the fp32-state step, interleaved.

One process, no process group: a stack of bf16 Linear layers (``--params-millions``), AdamW, stage
1, bf16-mixed style (fp32 masters) for the state variants, plus bf16 masters; one backward makes the
gradients (kept until ``zero_grad``), then ``ZeroOptimizer.step()`` of each variant is timed
``--rounds`` times, the variants taking turns in a rotating order so that load from other jobs falls
on all alike (after a warm-up step each, which creates the state). Issue 31's goal: the int8 step
at most 1.3x the fp32-state step (paired ratios, median over rounds).

    python benchmarks/bench_lowp_step.py                              # 25M parameters, 7 rounds
    python benchmarks/bench_lowp_step.py --params-millions 1 --rounds 2   # a quick check that it runs
    python benchmarks/bench_lowp_step.py --clock cpu                  # the thread's CPU time: a shared machine

Timing: run it on a quiet machine; figures in benchmarks/RESULTS.md ("Low-precision step time").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch
from torch import nn

from zero_strategy import ZeroConfig, ZeroOptimizer

VARIANTS = {"fp32 state": {}, "bf16 state": {"optimizer_state_dtype": "bf16"},
            "int8 state": {"optimizer_state_dtype": "int8"},
            "int8 state, bf16 masters": {"optimizer_state_dtype": "int8", "master_weights_dtype": "bf16"}}

CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
"""``--clock cpu`` times the thread's CPU time: on a machine shared with other jobs, a step's wall time
includes the time the scheduler gave the core to them (this benchmark runs one thread)."""


def interleaved(steps_of: dict[str, Callable[[], None]], rounds: int,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds per step of each variant, ``rounds`` times, in a rotating order, after a warm-up each."""
    for fn in steps_of.values():
        fn()
    names = list(steps_of)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = clock()
            steps_of[name]()
            times[name].append(clock() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params-millions", type=float, default=25.0)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    layers = max(1, round(args.params_millions * 1e6 / (args.width * args.width + args.width)))
    steps = {}
    for name, options in VARIANTS.items():
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(args.width, args.width) for _ in range(layers))).bfloat16()
        opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), ZeroConfig(stage=1, **options))
        model(torch.randn(4, args.width).bfloat16()).float().square().mean().backward()
        steps[name] = opt.step
    times = interleaved(steps, args.rounds, CLOCKS[args.clock])
    base = times["fp32 state"]
    params = layers * (args.width * args.width + args.width)
    print(f"{params:,} parameters, {args.rounds} rounds, {args.threads} thread(s), {args.clock} clock")
    for name, t in times.items():
        ratios = [v / b for v, b in zip(t, base)]  # paired: the same round, the load alike
        print(f"  {name:42} {statistics.median(t) * 1e3:9.1f} ms   {statistics.median(ratios):5.2f}x the fp32-state "
              f"step  (rounds: {min(ratios):.2f}-{max(ratios):.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": params, "seconds": times}, f, indent=1)


if __name__ == "__main__":
    main()
