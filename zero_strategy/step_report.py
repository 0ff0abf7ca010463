"""What the step breakdown says: figures for a logger, the table printed at the end of training,
throughput and MFU, and advice from the figures.

The measurements are the engine's (see [Note: the step breakdown] in
engine/diagnose/breakdown.py); this module only reads them, so every front end (the Trainer,
Fabric, ``initialize``) reports the same numbers under the same names.

[Note: advice from the breakdown]
Some shapes of the breakdown have a known cause and an option that addresses it; ``advise`` names
them, and the front ends log each once (after ``ADVICE_AFTER_STEPS`` measured steps, and at the end):
- stage 3's gathers waited for, ``EXPOSED_SHARE`` of the step or more: with ``prefetch=False``, turn
  it on (the next unit's all-gather then runs while this one computes); with it on and units under
  ``LATENCY_BOUND_MB`` on average, each gather pays a collective's fixed latency on little data:
  fewer, larger units (``shard_modules``, ``unit_params``); with larger units, the gathers move more
  bytes than the computation hides: fewer bytes per gather (``quantized_weights``), or, across nodes,
  backward's gathers inside the node (``secondary_partition_size``);
- the reductions waited for as much, with buckets under ``LATENCY_BOUND_MB``: each collective then
  pays its fixed latency on little data; raise ``bucket_cap_mb``;
- with ``offload_optimizer`` at stage 2 or 3 without ``offload_overlap``, a host step that takes longer
  than the backward: ``offload_overlap=True`` starts it during backward;
- gathers waited for while one unit holds ``LARGE_UNIT`` times the median unit's parameters or more:
  nothing overlaps that unit's gather, and it holds the most memory; split it (``shard_modules`` naming
  its inner blocks, or ``unit_params``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from .config import ZeroConfig
from .engine.diagnose.breakdown import (BACKWARD, COMM_OTHER, FORWARD, GATHER, OFFLOAD, OPTIMIZER, PARTS, REDUCE,
                                        REST, STEP_GATHER, StepBreakdown, StepTimes)

LABELS = {FORWARD: "forward (computation)", BACKWARD: "backward (computation)", GATHER: "stage-3 gathers waited for",
          REDUCE: "gradient reductions waited for", STEP_GATHER: "the step's all-gather waited for",
          COMM_OTHER: "other collectives waited for", OPTIMIZER: "optimizer step", OFFLOAD: "offload copies",
          REST: "rest (data, loss, logging, loop)"}
"""How the table names each part (see [Note: the step breakdown])."""

EXPOSED_SHARE = 0.10
"""A wait this large a share of the step is worth an advice (see [Note: advice from the breakdown])."""

LATENCY_BOUND_MB = 4.0
"""Buckets below this many MiB are latency-bound: a collective costs about 15 us before its first byte
moves, and a 25 GB/s link moves 4 MiB in 170 us, so below 4 MiB the fixed cost is more than a tenth."""

LARGE_UNIT = 4.0
"""A unit this many times the median unit's size is worth an advice."""

ADVICE_AFTER_STEPS = 10
"""Steps measured (after the first) before the front ends give advice."""


@dataclass
class StepSummary:
    """The mean step of a run (``steps`` of them, after the first) on this rank, in milliseconds by part."""

    steps: int
    ms: dict[str, float]  # PARTS and "step"
    world_size: int = 1
    samples_per_s: Optional[float] = None  # over all ranks (every rank steps the same batch size)
    tokens_per_s: Optional[float] = None
    flops_per_step: Optional[int] = None  # this rank's, counted once: see [Note: counting FLOPs]
    forward_flops_per_step: Optional[int] = None
    flops_not_counted: Optional[str] = None
    peak_flops: Optional[float] = None  # of one device
    ranks_ms: list[dict[str, float]] = field(default_factory=list)  # every rank's ``ms``, when gathered
    comm_bytes: Optional[dict[str, float]] = None  # comm_stats() of the last step
    predicted_bytes: Optional[dict[str, int]] = None  # the communication model's, for one step
    advice: list[str] = field(default_factory=list)
    which: str = "steps after the first"  # what ``steps`` counts, for the table's title

    @property
    def model_tflops(self) -> Optional[float]:
        """This rank's model TFLOP/s (counted FLOPs per second)."""
        if self.flops_per_step is None or not self.ms.get("step"):
            return None
        return self.flops_per_step / (self.ms["step"] / 1e3) / 1e12

    @property
    def mfu(self) -> Optional[float]:
        """Model FLOPs utilisation: the counted FLOPs per second over the device's peak (0 to 1)."""
        tflops = self.model_tflops
        return tflops * 1e12 / self.peak_flops if tflops is not None and self.peak_flops else None

    def metrics(self, prefix: str = "zero/") -> dict[str, float]:
        """The figures as a logger takes them: ``zero/<part>_ms`` for each part and the step, and the
        throughput, TFLOP/s and MFU where known."""
        out = {f"{prefix}{part}_ms": self.ms[part] for part in (*PARTS, "step")}
        for key, value in (("samples_per_sec", self.samples_per_s), ("tokens_per_sec", self.tokens_per_s),
                           ("model_tflops", self.model_tflops), ("mfu", self.mfu)):
            if value is not None:
                out[prefix + key] = value
        return out

    def table(self) -> str:
        """The breakdown as text: each part in ms per step and as a share of the step (the slowest rank
        beside it when the ranks were gathered), then throughput, FLOPs, communication and advice."""
        step = self.ms["step"] or float("nan")
        ranks = len(self.ranks_ms) > 1
        head = f"Where the step's time went: rank 0, the mean of {self.steps} {self.which}, ms per step"
        lines = [head, f"  {'part':<36}{'ms':>10}{'share':>9}" + (f"{'max over ranks':>16}" if ranks else "")]
        for part in (*PARTS, "step"):
            label = LABELS.get(part, "step")
            cells = f"  {label:<36}{self.ms[part]:>10.2f}{100 * self.ms[part] / step:>8.1f}%"
            if ranks:
                cells += f"{max(r[part] for r in self.ranks_ms):>16.2f}"
            lines.append(cells)
        lines += self._throughput_lines() + self._comm_lines()
        lines += [f"  advice: {text}" for text in self.advice]
        return "\n".join(lines)

    def _throughput_lines(self) -> list[str]:
        rates = [f"{rate:,.0f} {unit}/s" for rate, unit in ((self.samples_per_s, "samples"),
                                                           (self.tokens_per_s, "tokens")) if rate is not None]
        lines = [f"  throughput: {', '.join(rates)} over {self.world_size} rank(s)"] if rates else []
        if self.flops_per_step is None:
            if self.flops_not_counted:
                lines.append(f"  FLOPs: not counted: {self.flops_not_counted}")
            return lines
        text = (f"  FLOPs: {si(self.flops_per_step)}FLOP per step per rank (counted on the first step), "
                f"{si(self.flops_per_step / (self.ms['step'] / 1e3))}FLOP/s per rank")
        if self.mfu is not None:
            text += f", MFU {100 * self.mfu:.1f}% of {si(self.peak_flops)}FLOP/s"  # type: ignore[arg-type]
        else:
            text += "; MFU: the device's peak is not known (give peak_flops)"
        return lines + [text]

    def _comm_lines(self) -> list[str]:
        if self.comm_bytes is None:
            return []
        sent = self.comm_bytes.get("total", 0) / 2**20
        waited = sum(self.ms[p] for p in (GATHER, REDUCE, STEP_GATHER, COMM_OTHER))
        text = f"  communication: {sent:,.2f} MiB sent per rank in the last step, {waited:.2f} ms per step waited for"
        if self.predicted_bytes is not None:
            predicted, measured = self.predicted_bytes["total"], self.comm_bytes.get("total", 0)
            text += (" (as the communication model predicts)" if predicted == measured else
                     f" (the communication model predicts {predicted:,} bytes, {measured:,} were sent: it assumes "
                     "one optimizer step, each unit once per forward and backward)")
        return [text]


def si(value: float) -> str:
    """``value`` with an SI prefix and a space before the unit: 1.23 G, 45.6 M, 7 ."""
    for size, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= size:
            return f"{value / size:.3g} {prefix}"
    return f"{value:.3g} "


def mean_ms(records: Sequence[StepTimes]) -> dict[str, float]:
    """Milliseconds per step by part (and ``step``), the mean over ``records``."""
    n = max(1, len(records))
    out = {part: 1e3 * sum(r.seconds[part] for r in records) / n for part in PARTS}
    out["step"] = 1e3 * sum(r.total for r in records) / n
    return out


def summarize(breakdown: StepBreakdown, config: ZeroConfig, world_size: int = 1, peak: Optional[float] = None,
              units: Sequence[tuple[str, int, int]] = (), comm_bytes: Optional[dict] = None,
              predicted_bytes: Optional[dict] = None) -> StepSummary:
    """The mean step so far (every step but the first) of ``breakdown``, with advice for ``config``.

    ``peak``: the device's peak FLOP/s (``config.peak_flops`` wins); ``units``: stage 3's units as
    (name, parameters, bytes), for the advice; ``comm_bytes`` and ``predicted_bytes``: the last step's
    ``comm_stats()`` and the communication model's prediction, shown side by side."""
    breakdown.flush()
    steps = breakdown.summed
    sums = breakdown.sums
    ms = {part: 1e3 * sums[part] / steps if steps else 0.0 for part in PARTS}
    ms["step"] = 1e3 * sums["total"] / steps if steps else 0.0
    seconds = sums["total"]
    summary = StepSummary(steps, ms, world_size, comm_bytes=comm_bytes, predicted_bytes=predicted_bytes,
                          peak_flops=config.peak_flops or peak)
    if seconds > 0 and breakdown.samples:
        summary.samples_per_s = world_size * breakdown.samples / seconds
        summary.tokens_per_s = world_size * breakdown.tokens / seconds if breakdown.tokens else None
    counted = breakdown.flops
    summary.flops_per_step, summary.forward_flops_per_step = counted.per_step, counted.forward_per_step
    summary.flops_not_counted = counted.skipped or (None if counted.per_step is not None or steps else
                                                    "no training step ended yet")
    summary.advice = [text for _, text in advise(ms, config, units)] if steps else []
    return summary


def advise(ms: dict[str, float], config: ZeroConfig, units: Sequence[tuple[str, int, int]] = ()
           ) -> list[tuple[str, str]]:
    """What the figures say to change (see [Note: advice from the breakdown]): (the option, a line
    saying why) per cause; ``ms`` by part with ``step``, ``units`` as in ``summarize``."""
    step = ms.get("step") or 0.0
    if step <= 0:
        return []
    out: list[tuple[str, str]] = []

    def share(part: str) -> str:
        return f"{ms[part]:.1f} ms of the {step:.1f} ms step ({100 * ms[part] / step:.0f}%)"

    gathers = config.stage == 3 and ms[GATHER] >= EXPOSED_SHARE * step
    waited = f"stage-3 all-gathers were waited for {share(GATHER)}"
    unit_mb = sum(b for *_, b in units) / len(units) / 2**20 if units else None
    if gathers and not config.prefetch:
        out.append(("prefetch", f"{waited} with prefetch=False: set prefetch=True, so that the next unit's "
                                "all-gather runs while this one computes."))
    elif gathers and unit_mb is not None and unit_mb < LATENCY_BOUND_MB:
        out.append(("shard_modules", f"{waited}, and the units hold {1024 * unit_mb:,.0f} KiB on average: each "
                                     "gather pays a collective's latency on little data. Gather fewer, larger "
                                     "units: name a larger module class in shard_modules, or raise unit_params."))
    elif gathers:
        out.append(("quantized_weights", f"{waited} although each is prefetched: the gathers move more bytes than "
                                         "the computation hides. Send fewer (quantized_weights=True, int8 weights); "
                                         "over several nodes keep backward's gathers in the node "
                                         "(secondary_partition_size=<devices per node>); or do more computation per "
                                         "gather (a larger batch)."))
    if ms[REDUCE] >= EXPOSED_SHARE * step and config.bucket_cap_mb < LATENCY_BOUND_MB:
        out.append(("bucket_cap_mb", f"gradient reductions were waited for {share(REDUCE)} with bucket_cap_mb="
                                     f"{config.bucket_cap_mb:g}: buckets under {LATENCY_BOUND_MB:g} MiB pay a "
                                     "collective's latency on little data; raise bucket_cap_mb (25 is the default)."))
    if config.offload_optimizer and not config.offload_overlap and config.stage >= 2 \
            and ms[OPTIMIZER] > ms[BACKWARD] > 0:
        out.append(("offload_overlap", f"the host's optimizer step takes {ms[OPTIMIZER]:.1f} ms, longer than the "
                                       f"backward ({ms[BACKWARD]:.1f} ms), under offload_optimizer: set "
                                       "offload_overlap=True to start it during backward, as each segment's "
                                       "gradient reaches the host."))
    sized = [(name, n) for name, n, _ in units if n > 0]
    if gathers and len(sized) >= 3:
        median = statistics.median(n for _, n in sized)
        name, largest = max(sized, key=lambda unit: unit[1])
        if largest >= LARGE_UNIT * median:
            out.append(("unit_params", f"stage-3 unit {name!r} holds {largest:,} parameters, {largest / median:.0f}x "
                                       f"the median unit ({median:,.0f}): nothing overlaps its gather, and it holds "
                                       "the most memory. Split it: name its inner blocks' class in shard_modules, or "
                                       "set unit_params."))
    return out


def units_of(sharder: Any) -> list[tuple[str, int, int]]:
    """Stage 3's units of ``sharder`` (the root aside) as (name, parameters, bytes)."""
    if sharder is None or getattr(sharder, "config", None) is None or sharder.config.stage != 3:
        return []
    return [(u.name, sum(sharder.full_numel[p] for g in u.groups for p in g.params),
             sum(sharder.full_numel[p] * p.element_size() for g in u.groups for p in g.params)) for u in sharder.units]


class Reporter:
    """What a front end does with the breakdown of its engine: the figures of the steps since it last
    logged, the advice once, and the summary at the end."""

    def __init__(self, breakdown: StepBreakdown, config: ZeroConfig, world_size: int, peak: Optional[float],
                 sharder: Any = None) -> None:
        self.breakdown = breakdown
        self.config = config
        self.world_size = world_size
        self.peak = config.peak_flops or peak
        self.units = units_of(sharder)
        self._logged = breakdown.recorded  # records up to here are in an earlier log
        self._advised: set[str] = set()

    def window(self) -> dict[str, float]:
        """The metrics of the steps read since the last call (their means), or {} when none ended."""
        records = [r for r in self.breakdown.records if r.index >= self._logged and r.index > 0]
        self._logged = self.breakdown.recorded
        if not records:
            return {}
        ms = mean_ms(records)
        summary = StepSummary(len(records), ms, self.world_size, peak_flops=self.peak,
                              flops_per_step=self.breakdown.flops.per_step)
        seconds = sum(r.total for r in records)
        samples = sum(r.samples for r in records)
        if seconds > 0 and samples:
            summary.samples_per_s = self.world_size * samples / seconds
            tokens = [r.tokens for r in records]
            summary.tokens_per_s = self.world_size * sum(tokens) / seconds if None not in tokens else None
        return summary.metrics()

    def new_advice(self, at_end: bool = False) -> list[str]:
        """Advice not given yet, once ``ADVICE_AFTER_STEPS`` steps were measured (or ``at_end``)."""
        if self.breakdown.summed < (1 if at_end else ADVICE_AFTER_STEPS):
            return []
        steps = self.breakdown.summed
        ms = {part: 1e3 * self.breakdown.sums[part] / steps for part in PARTS}
        ms["step"] = 1e3 * self.breakdown.sums["total"] / steps
        fresh = [(key, text) for key, text in advise(ms, self.config, self.units)
                 if key not in self._advised]
        self._advised |= {key for key, _ in fresh}
        return [text for _, text in fresh]
