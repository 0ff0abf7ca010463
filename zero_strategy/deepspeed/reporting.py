"""DeepSpeed's reports of an engine's steps: ``wall_clock_breakdown``, ``steps_per_print`` and
``flops_profiler``, read from the config and printed by ``initialize``'s engine.

[Note: DeepSpeed's reports]
``initialize``'s engine honours the three keys with DeepSpeed 0.19's meaning, printing on rank 0 the
lines DeepSpeed prints, laid out as DeepSpeed lays them out, for scripts that read them:
- ``wall_clock_breakdown: true``: after each ``step()`` call the milliseconds of that micro-step's
  ``forward``, ``backward`` (of which the gradients' reduction, ``bwd_allreduce``: the reduce-scatters
  waited for, see [Note: the step breakdown] in engine/diagnose/breakdown.py, and the rest,
  ``bwd_inner``) and ``step`` calls, as ``[Rank 0] time (ms) | fwd_microstep: ... | step_microstep:
  ...``; at an accumulation boundary the same summed over the micro-steps of the optimizer step (``fwd``,
  ``bwd``, ``bwd_inner``, ``bwd_allreduce``, ``step``). On CUDA each call is timed between two device
  synchronizations, as DeepSpeed's synchronized timers are.
- ``steps_per_print: N``: every N optimizer steps, ``[Rank 0] step=..., skipped=..., lr=[...],
  mom=[...]`` and DeepSpeed's throughput line (``RunningAvgSamplesPerSec`` over the steps after the
  first two, ``CurrSamplesPerSec`` of the last, the device's allocated memory). ``epoch`` stays 0: the
  engine does not see the data loader's epochs.
- ``flops_profiler: {"enabled": true, ...}`` (which turns ``wall_clock_breakdown`` on, as in DeepSpeed):
  at optimizer step ``profile_step``, the profile's summary: the forward's FLOPs and MACs (counted by
  torch's FLOP counter on the first step: see [Note: counting FLOPs] in engine/diagnose/flops.py), the
  latencies of that step's forward, backward and optimizer step, and the FLOP/s DeepSpeed derives from
  them (backward = ``2 + recompute_fwd_factor`` times the forward's FLOPs). To ``output_file`` when
  given. The per-module tree DeepSpeed prints after the summary (``module_depth``, ``top_modules``,
  ``detailed``) is not printed; those keys are read and checked only.
The Trainer and Fabric take the keys without effect: they log the step breakdown through their own
loggers (``step_breakdown``).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Optional, TextIO

import torch

from ..engine.diagnose.breakdown import REDUCE
from .keys import Findings, read_flag, read_integer, read_number, read_section

TIMERS = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")
"""DeepSpeed's timer names, in the order it prints them (``_microstep`` for a micro-step's)."""

_PROFILER_KEYS = {"enabled", "recompute_fwd_factor", "profile_step", "module_depth", "top_modules", "detailed",
                  "output_file"}


@dataclass(frozen=True)
class FlopsProfiler:
    """The ``flops_profiler`` section, with DeepSpeed 0.19's defaults."""

    profile_step: int = 1
    recompute_fwd_factor: float = 0.0
    output_file: Optional[str] = None


@dataclass(frozen=True)
class Reporting:
    """What a config asks to be printed as training goes (see [Note: DeepSpeed's reports])."""

    wall_clock_breakdown: bool = False
    steps_per_print: Optional[int] = None
    flops_profiler: Optional[FlopsProfiler] = None  # None: not enabled

    @property
    def any(self) -> bool:
        return self.wall_clock_breakdown or self.steps_per_print is not None or self.flops_profiler is not None


def read_reporting(config: dict, findings: Findings, front_end: str) -> Reporting:
    """The three keys of [Note: DeepSpeed's reports], checked; for ``initialize`` they leave the list of
    keys without effect."""
    wall = read_flag(config.get("wall_clock_breakdown", False), "wall_clock_breakdown")
    every = config.get("steps_per_print")
    every = None if every is None else read_integer(every, "steps_per_print", 1)
    section = read_section(config.get("flops_profiler") or {}, "flops_profiler")
    unknown = sorted(set(section) - _PROFILER_KEYS)
    findings.problems += [f"flops_profiler.{key}: unknown key (DeepSpeed's are {sorted(_PROFILER_KEYS)})"
                          for key in unknown]
    profiler = None
    if read_flag(section.get("enabled", False), "flops_profiler.enabled"):
        for key in ("module_depth", "top_modules"):
            if key in section and (type(section[key]) is not int or section[key] < -1):
                findings.problems.append(f"flops_profiler.{key}={section[key]!r}: an integer (-1: every level)")
        read_flag(section.get("detailed", True), "flops_profiler.detailed")
        output = section.get("output_file")
        if output is not None and not isinstance(output, str):
            findings.problems.append(f"flops_profiler.output_file={output!r}: a file path, or null for stdout")
        profiler = FlopsProfiler(read_integer(section.get("profile_step", 1), "flops_profiler.profile_step"),
                                 read_number(section.get("recompute_fwd_factor", 0.0),
                                             "flops_profiler.recompute_fwd_factor"), output or None)
        wall = True  # as DeepSpeed: the profiler's latencies are the wall-clock timers'
    if front_end == "initialize":
        for key in ("wall_clock_breakdown", "steps_per_print", "flops_profiler"):
            findings.ignored.pop(key, None)
    return Reporting(wall, every, profiler)


def number(value: float, unit: str = "") -> str:
    """``value`` with an SI prefix, two decimals at most, as DeepSpeed's profile writes numbers: ``1.23 G``."""
    for size, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"), (1.0, ""), (1e-3, "m")):
        if abs(value) >= size or (size == 1.0 and value == 0):
            return f"{round(value / size, 2):g} {prefix}{unit}"
    return f"{round(value / 1e-6, 2):g} u{unit}"


class EngineReports:
    """The timers and prints of [Note: DeepSpeed's reports] for one ``initialize`` engine."""

    def __init__(self, engine: Any, reporting: Reporting) -> None:
        self.engine = engine
        self.reporting = reporting
        self.micro = dict.fromkeys(TIMERS, 0.0)  # seconds, this micro-step
        self.whole = dict.fromkeys(TIMERS, 0.0)  # seconds, this optimizer step
        self._started: Optional[float] = None  # the running call's start
        self._micro_started: Optional[float] = None  # the micro-step's first forward
        self._mark: Any = None
        self._steps_timed = 0  # optimizer steps after the first two, for the running average
        self._seconds_timed = 0.0
        self._step_seconds = 0.0  # this optimizer step's micro-steps, each from its forward to its step()
        self.rank0 = engine.global_rank == 0

    def _now(self) -> float:
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)
        return time.perf_counter()

    def began(self, call: str) -> None:
        """``forward``, ``backward`` or ``step`` of the engine began."""
        self._started = self._now()
        if call == "forward" and self._micro_started is None:
            self._micro_started = self._started
        if call == "backward":
            self._mark = self.engine.comm.breakdown.mark()

    def ended(self, call: str) -> None:
        """The call ``began`` timed ended: its time into the timers."""
        if self._started is None:
            return
        seconds, self._started = self._now() - self._started, None
        name = {"forward": "fwd", "backward": "bwd", "step": "step"}[call]
        self.micro[name] += seconds
        if call == "backward":
            reduce = self.engine.comm.breakdown.waited_since(self._mark, REDUCE) if self._mark is not None else 0.0
            self.micro["bwd_allreduce"] += reduce
            self.micro["bwd_inner"] += seconds - reduce

    def step_ended(self, boundary: bool) -> None:
        """After the engine's ``step()``: the micro-step's timers, and at a ``boundary`` the step's."""
        for name in TIMERS:
            self.whole[name] += self.micro[name]
        if self.reporting.wall_clock_breakdown and self.rank0:
            self._print_timers(self.micro, "_microstep")
        self.micro = dict.fromkeys(TIMERS, 0.0)
        if self._micro_started is not None:  # DeepSpeed's throughput: from each forward to its step() ending
            self._step_seconds += time.perf_counter() - self._micro_started
            self._micro_started = None
        if not boundary:
            return
        engine = self.engine
        step = engine.global_steps  # before this step counts: DeepSpeed's numbering
        if step >= 2:  # the first two are left out of the running average, as in DeepSpeed
            self._steps_timed += 1
            self._seconds_timed += self._step_seconds
        profiler = self.reporting.flops_profiler
        if profiler is not None and step == profiler.profile_step and self.rank0:
            self._print_profile(profiler, step)
        if self.reporting.wall_clock_breakdown and self.rank0:
            self._print_timers(self.whole, "")
        every = self.reporting.steps_per_print
        if every is not None and (step + 1) % every == 0 and self.rank0:
            print(f"[Rank 0] step={step + 1}, skipped={engine.skipped_steps}, lr={engine.get_lr()}, "
                  f"mom={_momenta(engine)}", flush=True)
            self._print_throughput(step + 1)
        self.whole = dict.fromkeys(TIMERS, 0.0)
        self._step_seconds = 0.0

    def _print_timers(self, seconds: dict[str, float], suffix: str) -> None:
        print("[Rank 0] time (ms)" + "".join(f" | {name}{suffix}: {1e3 * seconds[name]:.2f}" for name in TIMERS),
              flush=True)

    def _print_throughput(self, step: int) -> None:
        engine = self.engine
        batch = engine.train_batch_size()
        average = batch / (self._seconds_timed / self._steps_timed) if self._steps_timed else float("-inf")
        current = batch / (self._step_seconds + 1e-12)
        cuda = engine.device.type == "cuda"
        allocated = round(torch.cuda.memory_allocated(engine.device) / 2**30, 2) if cuda else 0.0
        peak = round(torch.cuda.max_memory_allocated(engine.device) / 2**30, 2) if cuda else 0.0
        print(f"epoch=0/micro_step={engine.micro_steps + 1}/global_step={step}, RunningAvgSamplesPerSec={average}, "
              f"CurrSamplesPerSec={current}, MemAllocated={allocated}GB, MaxMemAllocated={peak}GB", flush=True)

    def _print_profile(self, profiler: FlopsProfiler, step: int) -> None:
        from ..memory import count_parameters

        engine = self.engine
        counted = engine.comm.breakdown.flops
        if counted.forward_per_step is None:
            why = counted.skipped or "the FLOPs are counted over the first optimizer step, which has not ended"
            print(f"[Rank 0] flops_profiler: no profile at step {step}: {why}.", flush=True)
            return
        fwd, bwd, opt = (max(self.whole[name], 1e-9) for name in ("fwd", "bwd", "step"))
        flops, factor = counted.forward_per_step, 2 + profiler.recompute_fwd_factor
        params = count_parameters(engine.module)
        rows = [("world size: ", engine.world_size), ("data parallel size: ", engine.world_size),
                ("model parallel size: ", 1), ("batch size per GPU: ", engine.train_micro_batch_size_per_gpu()),
                ("params per GPU: ", number(params).strip()),
                ("params of model = params per GPU * mp_size: ", number(params).strip()),
                ("fwd MACs per GPU: ", number(flops / 2, "MACs")), ("fwd flops per GPU: ", number(flops)),
                ("fwd flops of model = fwd flops per GPU * mp_size: ", number(flops)),
                ("fwd latency: ", number(fwd, "s")),
                ("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ", number(flops / fwd, "FLOPS")),
                ("bwd latency: ", number(bwd, "s")),
                (f"bwd FLOPS per GPU = {factor:g} * fwd flops per GPU / bwd latency: ",
                 number(factor * flops / bwd, "FLOPS")),
                (f"fwd+bwd FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
                 number((factor + 1) * flops / (fwd + bwd), "FLOPS")),
                ("step latency: ", number(opt, "s")), ("iter latency: ", number(fwd + bwd + opt, "s")),
                (f"FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / iter latency: ",
                 number((factor + 1) * flops / (fwd + bwd + opt), "FLOPS")),
                ("samples/second: ", round(engine.train_micro_batch_size_per_gpu() * engine.world_size
                                           / (fwd + bwd + opt), 2))]
        text = "\n".join(["", "-------------------------- DeepSpeed Flops Profiler --------------------------",
                          f"Profile Summary at step {step}:", *(f"{label:<70}  {value!s:<8}" for label, value in rows),
                          "------------------------------------------------------------------------------"])
        if profiler.output_file:
            with open(profiler.output_file, "w") as out:
                _write(out, text)
        else:
            _write(sys.stdout, text)


def _write(out: TextIO, text: str) -> None:
    out.write(text + "\n")
    out.flush()


def _momenta(engine: Any) -> list:
    """Each param group's momentum as DeepSpeed's ``get_mom`` gives it: Adam's betas, SGD's momentum."""
    groups = engine.optimizer.param_groups if engine.optimizer is not None else []
    return [g["betas"] if "betas" in g else g.get("momentum") for g in groups]
