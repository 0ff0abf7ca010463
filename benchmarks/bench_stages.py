"""Step time and memory of DDP, ZeRO stages 1-3, FSDP2 (and DeepSpeed ZeRO-3) on 2 gloo ranks (CPU).

Every variant trains its own copy of one model (built fresh from the same seed) on the same
batches; the variants take turns step by step, in a rotating order, so machine noise falls on all
of them alike. Each step is timed barrier to barrier on every rank; the table gives the median.

    python benchmarks/bench_stages.py --steps 10                   # 50M parameters, every variant
    python benchmarks/bench_stages.py --params-millions 2 --steps 2  # quick check
    python benchmarks/bench_stages.py --variants ddp,zero3,fsdp2 --comm --json out.json

Variants: ``ddp`` (torch DDP, the baseline), ``zero1``/``zero2``/``zero3`` (this package's engine;
stage 3 with one unit per ``ResidualBlock``, ``param_persistence_threshold`` at its default so the
biases stay whole), ``fsdp2`` (``torch.distributed.fsdp.fully_shard`` on every block, then on the
root), ``deepspeed3`` (DeepSpeed ZeRO-3, only where ``import deepspeed`` works; left out with a note
otherwise), ``local`` (the same training without any communication, the compute floor) and, on
request only, ``zero3_model_order`` (zero3 with ``ZeroOptimizer(param_order=...)`` set to the
model's parameter order: a diagnostic of the order gradient reductions are launched in).

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
  ``to_local()``) of parameters, gradients and optimizer state. Each storage is counted once,
  padding included.
- peak resident memory per rank. ``ru_maxrss`` only grows and counts the whole process, so a
  shared process cannot say which variant caused a peak. After the timed run, each variant
  therefore runs again alone in a fresh pair of processes (forked from the launcher, which holds
  no tensors; ``--memory-steps`` steps): the resident size is read before the model is built,
  the peak (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``) after building and then
  per phase of every step, and the table gives the training peak above that pre-model baseline
  (the init peak is in the JSON), plus the last step phase by phase. Each variant runs twice:
  with glibc's malloc as it comes (what a user sees; freed tensors partly stay in the heap) and
  with its mmap threshold at 128 KiB, so that freed tensors go back to the OS at once and the
  resident size follows the live tensors (``--rss-malloc``). Where ``clear_refs`` is refused,
  the whole process's ``ru_maxrss`` is reported instead.

Workers leave through ``os._exit`` once their results are written (see ``_worker``).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import math
import os
import re
import resource
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from zero_strategy import ZeroConfig, ZeroOptimizer
from zero_strategy.engine import Collectives, shard_module

try:  # written in parallel; the memory columns are left out where it does not exist
    from zero_strategy.memory import estimate_memory, memory_stats
except ImportError:
    estimate_memory = memory_stats = None
try:
    from zero_strategy import gathered_parameters
except ImportError:
    gathered_parameters = None

VARIANTS = ("ddp", "zero1", "zero2", "zero3", "fsdp2", "deepspeed3", "local", "zero3_model_order")
"""local: the same training without any communication (each rank alone), the compute floor.
zero3_model_order (diagnostic, not run by default): zero3 with ``ZeroOptimizer(param_order=...)`` given
the model's own parameter order, which changes the order gradient reductions are launched in."""
DEFAULT_VARIANTS = "ddp,zero1,zero2,zero3,fsdp2,deepspeed3"


# ---- model and data ----------------------------------------------------------------------------

class ResidualBlock(nn.Module):
    """``x + gelu(Linear(x)) / sqrt(layers)``: one stage-3 unit / one FSDP2 ``fully_shard`` each."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.scale = 1.0 / math.sqrt(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.fc(x)) * self.scale


class ResidualMLP(nn.Module):
    """``layers`` residual blocks of width ``width``, then a Linear head (in the root unit)."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ResidualBlock(width, layers) for _ in range(layers))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, width) -> (B, width)
        for block in self.blocks:
            x = block(x)
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

def timed(phases: dict[str, float], key: Any, fn: Callable, where: Optional[dict[str, str]] = None) -> Callable:
    """``fn`` that adds its wall time to ``phases[key]``.

    ``key`` may be a function of the call's arguments; with ``where``, the key is prefixed by the
    step phase the call happened in (``where["phase"]``: fwd, bwd, step, ...).
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            name = key(*args, **kwargs) if callable(key) else key
            if where is not None:
                name = f"{where['phase']}.{name}"
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0
    return wrapper


def _wrap(obj: Any, attr: str, phases: dict[str, float], key: Any, where: Optional[dict[str, str]] = None) -> None:
    """Wrap ``obj.attr`` on this instance if it exists (the engine is being edited: a renamed part
    is just not timed)."""
    if callable(getattr(obj, attr, None)):
        setattr(obj, attr, timed(phases, key, getattr(obj, attr), where))


def instrument_zero(opt: ZeroOptimizer, phases: dict[str, float]) -> None:
    """Time the engine's parts by wrapping attributes of this one instance (no file changes).

    Stage 1 reduces in ``reducer.reduce`` (called from step); stages 2 and 3 launch each segment's
    reduce-scatter from the gradient hooks (``_launch``) and wait for them when backward ends
    (``_finish_inflight``/``_finish``), so those land inside the backward phase.
    """
    parts = [(opt.reducer, "reduce", "step.reduce_scatter(s1)"), (opt.reducer, "_launch", "bwd.launch_rs(s2/3)"),
             (opt.reducer, "_finish_inflight", "bwd.wait_rs(s2/3)"), (opt.reducer, "_finish", "bwd.wait_rs(s2/3)"),
             (opt.reducer, "received_anywhere", "step.flags_allreduce"),
             (opt.inner, "step", "step.inner_adamw"), (opt, "_all_gather_params", "step.all_gather")]
    for obj, attr, key in parts:
        _wrap(obj, attr, phases, key)


def instrument_sharder(sharder: Any, phases: dict[str, float], where: dict[str, str]) -> None:
    """Stage 3: the unit gathers and releases, keyed by the step phase they ran in.

    ``s3.gather(sync)`` is a gather that waits (a unit's own pre-forward / pre-backward hook: the
    all-gathers it issues, or a prefetch still in flight); ``s3.prefetch`` only issues one.
    ``s3.group_gather`` (inside both) is allocating the full buffer and issuing the all-gather;
    ``s3.release`` drops buffers (and waits for a gather not yet waited on).
    """
    _wrap(sharder, "gather", phases, lambda unit, wait=True: "s3.gather(sync)" if wait else "s3.prefetch", where)
    _wrap(sharder, "release", phases, "s3.release", where)
    _wrap(sharder, "backward_finished", phases, "s3.backward_finished", where)
    for unit in sharder.all_units:
        for g in unit.groups:
            _wrap(g, "gather", phases, "s3.group_gather(alloc+issue)", where)


def instrument_fsdp2(model: nn.Module, phases: dict[str, float], where: dict[str, str]) -> None:
    """FSDP2: each ``fully_shard``-ed module's parameter group (torch internals; skipped if renamed)."""
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if state else None
        if group is None:
            continue
        for attr in ("unshard", "wait_for_unshard", "reshard", "post_backward"):
            _wrap(group, attr, phases, f"fsdp.{attr}", where)


# ---- one variant -------------------------------------------------------------------------------

@dataclass
class Variant:
    name: str
    model: nn.Module  # the module the user holds (parameters compared across variants)
    forward: Callable[[torch.Tensor], torch.Tensor]
    opt: Any  # torch optimizer, ZeroOptimizer, or DeepSpeed's engine
    backward: Callable[[torch.Tensor], None] = lambda loss: loss.backward()
    sharder: Any = None  # zero3's ParameterSharder
    step_times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    phases: list[dict[str, float]] = field(default_factory=list)
    _current: dict[str, float] = field(default_factory=dict)
    where: dict[str, str] = field(default_factory=lambda: {"phase": "init"})

    def step(self) -> None:
        self.opt.step()

    def zero_grad(self) -> None:
        if self.name != "deepspeed3":  # DeepSpeed's engine.step() zeroes the gradients itself
            self.opt.zero_grad(set_to_none=True)


def unavailable(name: str) -> Optional[str]:
    """Why ``name`` cannot run in this environment, or None."""
    if name == "fsdp2":
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError as e:
            return f"torch {torch.__version__} has no FSDP2: {e}"
    if name == "deepspeed3":
        try:
            import deepspeed  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any failure to import means: leave it out
            return f"`import deepspeed` failed ({type(e).__name__}: {e}); DeepSpeed ZeRO-3 left out"
    if name.startswith("zero3") and gathered_parameters is None:
        return "zero_strategy has no stage 3 (gathered_parameters) in this checkout"
    return None


def build_variant(name: str, args: argparse.Namespace, width: int) -> Variant:
    torch.manual_seed(args.seed)
    model = ResidualMLP(width, args.layers)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)  # before sharding: stage 3 empties parameters
    if name == "ddp":
        ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
        return Variant(name, model, ddp, inner)
    if name == "local":
        return Variant(name, model, model, inner)
    if name in ("zero1", "zero2"):
        opt = ZeroOptimizer(inner, ZeroConfig(stage=int(name[-1]), bucket_cap_mb=args.bucket_cap_mb))
        v = Variant(name, model, model, opt)
        instrument_zero(opt, v._current)
        return v
    if name in ("zero3", "zero3_model_order"):
        config = ZeroConfig(stage=3, bucket_cap_mb=args.bucket_cap_mb, shard_modules=(ResidualBlock.__name__,))
        order = {p: i for i, p in enumerate(model.parameters())} if name == "zero3_model_order" else None
        sharder = shard_module(model, config)
        opt = ZeroOptimizer(inner, config, sharder=sharder, param_order=order)
        v = Variant(name, model, model, opt, sharder=sharder)
        instrument_zero(opt, v._current)
        instrument_sharder(sharder, v._current, v.where)
        return v
    if name == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        del inner  # FSDP2's optimizer is built over the sharded (DTensor) parameters
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        v = Variant(name, model, model, torch.optim.AdamW(model.parameters(), lr=args.lr))
        instrument_fsdp2(model, v._current, v.where)
        return v
    if name == "deepspeed3":
        # Never run here (DeepSpeed is not installed where this was written): a failure is caught
        # by the caller and reported as the reason the variant is left out.
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100_000,
                                        "reduce_bucket_size": int(args.bucket_cap_mb * 2**20) // 4},
                  "zero_allow_untested_optimizer": True}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=inner, config=config, dist_init_required=False)
        return Variant(name, engine.module, engine, engine, backward=engine.backward)
    raise ValueError(name)


def build_variants(names: list[str], args: argparse.Namespace, width: int) -> tuple[list[Variant], dict[str, str]]:
    """The variants that built on every rank, and why the others did not."""
    built, failed = {}, {}
    for name in names:
        try:
            built[name] = build_variant(name, args, width)
        except Exception as e:  # noqa: BLE001 - reported, and the variant left out
            failed[name] = f"{type(e).__name__}: {e}".strip()[:500]
    everywhere: list[Optional[set]] = [None] * dist.get_world_size()
    dist.all_gather_object(everywhere, set(built))
    ok = set.intersection(*everywhere)
    for name in built:
        if name not in ok:
            failed.setdefault(name, "failed to build on another rank")
    return [built[n] for n in names if n in ok], failed


def train_step(v: Variant, x: torch.Tensor, y: torch.Tensor, record: bool = True) -> None:
    """One step, timed barrier to barrier; phases timed locally; kept unless ``record`` is False."""
    v._current.clear()
    dist.barrier()
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    v.where["phase"] = "fwd"
    loss = F.mse_loss(v.forward(x), y)
    t1 = time.perf_counter()
    v.where["phase"] = "bwd"
    v.backward(loss)
    t2 = time.perf_counter()
    v.where["phase"] = "step"
    v.step()
    t3 = time.perf_counter()
    v.zero_grad()
    t4 = time.perf_counter()
    v.where["phase"] = "other"
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

def storage_bytes(tensors: Iterable[Optional[torch.Tensor]], seen: set[int]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shard), each once."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def local_state_bytes(v: Variant) -> dict[str, int]:
    """Model-state bytes of this rank from the local tensors (for variants memory_stats does not know)."""
    seen: set[int] = set()
    params = list(v.model.parameters())
    out = {"params": storage_bytes(params, seen),
           "grads": storage_bytes((p.grad for p in params), seen),
           "optimizer_states": storage_bytes((t for s in v.opt.state.values() for t in s.values()), seen),
           "master_params": 0}
    out["total"] = sum(out.values())
    return out


def model_state_bytes(v: Variant, x: torch.Tensor, y: torch.Tensor) -> Optional[dict[str, int]]:
    """Model-state bytes for this rank while gradients are live (after a backward), or None.

    Untimed; the gradients are dropped again. DDP's own bucket copy of the gradients is not a
    tensor of the model or optimizer, so it is not counted.
    """
    if v.name == "deepspeed3":
        v.model.zero_grad(set_to_none=True)
        return None  # its partitions live inside the engine; not counted here
    v.backward(F.mse_loss(v.forward(x), y))
    if isinstance(v.opt, ZeroOptimizer):
        v.opt.reduce_gradients()  # stage 1 reduces in step; this is where its gradients end up
    if v.name == "fsdp2":
        stats = local_state_bytes(v)
    elif memory_stats is not None:  # at stage 3 its params are the shards (and resident groups)
        stats = dict(memory_stats(v.model, [v.opt]))
    else:
        stats = None
    v.zero_grad()
    return stats


def formula_bytes(name: str, n_params: int, world: int) -> Optional[int]:
    """The ZeRO paper's per-rank model-state bytes for this variant (fp32 Adam), or None."""
    if estimate_memory is None:
        return None
    stage, n = {"ddp": (0, world), "local": (0, 1), "zero1": (1, world), "zero2": (2, world), "zero3": (3, world),
                "zero3_model_order": (3, world), "fsdp2": (3, world), "deepspeed3": (3, world)}[name]
    return estimate_memory(n_params, stage=stage, world_size=n, precision="32-true")["total"]


def full_parameters(v: Variant) -> list[torch.Tensor]:
    """Every parameter whole, in model order (a collective for the sharded variants)."""
    params = list(v.model.parameters())
    if v.sharder is not None:  # zero3
        with gathered_parameters(v.model):
            return [p.detach().clone() for p in params]
    if v.name == "fsdp2":
        from torch.distributed.tensor import DTensor

        return [p.full_tensor().detach() if isinstance(p, DTensor) else p.detach() for p in params]
    if v.name == "deepspeed3":
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return [p.detach().clone() for p in params]
    return [p.detach() for p in params]


def max_param_diff(v: Variant, base: list[torch.Tensor]) -> float:
    with torch.no_grad():
        return max((p - q).abs().max().item() for p, q in zip(full_parameters(v), base))


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


# ---- peak resident memory: each variant alone in fresh processes ---------------------------------

def _proc_status_kib(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) if m else None
    except OSError:
        return None


def _reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0); False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss(key: str = "VmRSS") -> int:
    return (_proc_status_kib(key) or 0) * 1024


MMAP_THRESHOLD = 128 * 1024
"""glibc's mmap threshold in the second RSS run (``mallopt(M_MMAP_THRESHOLD)``, as
``MALLOC_MMAP_THRESHOLD_=131072`` would set it): every allocation above it gets its own mapping,
returned to the OS on free, so the resident size follows the live tensors. With glibc's default
(a threshold that rises to 32 MiB once such a block is freed) freed tensors stay in the heap and
the resident size also counts what the allocator keeps for reuse."""


def peak_rss_rank(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """Bytes of this rank: resident before the model is built, peak while building, peak while
    training, and (last step) the peak and the end of each phase, all over the pre-model baseline."""
    width = model_shape(args.params_millions, args.layers)
    batches = make_batches(max(1, args.memory_steps), args.batch, width, dist.get_rank())
    dist.barrier()
    baseline = _rss()
    resettable = _reset_peak_rss()
    variants, failed = build_variants([name], args, width)
    init_peak = _rss("VmHWM") if resettable else None
    phases: dict[str, dict[str, int]] = {}
    train_peak = 0

    def phase_ended(phase: str) -> None:  # the phase's peak, then a fresh peak for the next one
        nonlocal train_peak, resettable
        peak = _rss("VmHWM")
        train_peak = max(train_peak, peak)
        phases[phase] = {"peak": peak - baseline, "end": _rss() - baseline}
        resettable = resettable and _reset_peak_rss()

    for x, y in batches:
        for v in variants:
            dist.barrier()
            phases = {"start": {"end": _rss() - baseline}}
            resettable = resettable and _reset_peak_rss()
            loss = F.mse_loss(v.forward(x), y)
            phase_ended("forward")
            v.backward(loss)
            del loss
            phase_ended("backward")
            v.step()
            phase_ended("opt.step")
            v.zero_grad()
            phase_ended("zero_grad")
    if not resettable:  # the whole process's peak, imports and init included
        train_peak, phases = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, {}
    return {"baseline": baseline, "init_peak": init_peak, "train_peak": train_peak,
            "train_peak_over_baseline": train_peak - baseline, "vmhwm_reset": resettable,
            "last_step_phases_over_baseline": phases,
            "failed": failed.get(name)}


# ---- the timed run on each rank ----------------------------------------------------------------

def run_rank(rank: int, args: argparse.Namespace) -> Optional[dict[str, Any]]:
    world = dist.get_world_size()
    width = model_shape(args.params_millions, args.layers)
    variants, failed = build_variants(args.variants, args, width)
    if not variants:
        raise RuntimeError(f"no variant could be built: {failed}")
    n_params = sum(p.numel() for p in ResidualMLP(width, args.layers).parameters())
    total_steps = args.warmup + args.steps
    batches = make_batches(total_steps, args.batch, width, rank)
    for step, (x, y) in enumerate(batches):  # rotate who goes first: no variant always follows another
        k = step % len(variants)
        for v in variants[k:] + variants[:k]:
            train_step(v, x, y)

    base = next((v for v in variants if v.name == "ddp"), variants[0])  # the baseline of the ratios
    base_params = [p.clone() for p in full_parameters(base)]
    diffs = {}
    for v in variants:  # worst over ranks: gather the local figures
        loss_diff = max(abs(a - b) for a, b in zip(v.losses, base.losses))
        local = torch.tensor([loss_diff, max_param_diff(v, base_params)], dtype=torch.float64)
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
    comm = comm_bench(int(args.bucket_cap_mb * 2**20) // 4 // world * world, 3) if args.comm else None
    if rank != 0:
        return None

    t = slice(args.warmup, None)
    result = {
        "config": {**vars(args), "world_size": world, "width": width, "parameters": n_params,
                   "torch": torch.__version__, "threads_per_rank": torch.get_num_threads(), "baseline": base.name},
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


# ---- report ------------------------------------------------------------------------------------

def _mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def print_report(result: dict[str, Any]) -> None:
    c = result["config"]
    vs, base = result["variants"], c["baseline"]
    print(f"\n### DDP, ZeRO stages and FSDP2: {c['parameters'] / 1e6:.1f}M parameters "
          f"({c['layers']} ResidualBlock(Linear {c['width']}x{c['width']}) + Linear head), "
          f"fp32 AdamW, batch {c['batch']}/rank, {c['world_size']} gloo ranks x {c['threads_per_rank']} thread, "
          f"bucket {c['bucket_cap_mb']} MiB, {c['warmup']} warm-up + {c['steps']} timed steps, torch {c['torch']}\n")
    has_mem = any(v["model_state_bytes"] for v in vs.values())
    has_formula = any(v["formula_bytes"] for v in vs.values())
    head = ["variant", "median step (s)", f"ratio vs {base}", "paired ratio", "final loss (rank 0)",
            f"max \\|Δloss\\| vs {base}", f"max \\|Δparam\\| vs {base}"]
    if has_mem:
        head.append("model-state MiB/rank (measured: params, grads, optim state)")
    if has_formula:
        head.append("MiB/rank (formula)")
    rss_modes = list(dict.fromkeys(m for v in vs.values() for m in v["peak_rss"]))
    rss_titles = {"default": "peak RSS MiB/rank, glibc malloc", "mmap": "peak RSS MiB/rank, mmap >= 128 KiB"}
    head += [rss_titles[m] for m in rss_modes]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for name, v in vs.items():
        row = [name, f"{v['median_step_s']:.3f}", f"{v['ratio_to_baseline']:.2f}x",
               f"{v['paired_ratio_to_baseline']:.2f}x", f"{v['final_loss_rank0']:.6f}"]
        row += (["n/a (no averaging)"] * 2 if name == "local"
                else [f"{v['max_loss_diff_vs_baseline']:.2e}", f"{v['max_param_diff_vs_baseline']:.2e}"])
        if has_mem:
            m = v["model_state_bytes"]
            if m is None:
                row.append("n/a")
            else:
                row.append(f"{_mib(m['total'])} (p {_mib(m['params'])}, g {_mib(m['grads'])}, "
                           f"os {_mib(m['optimizer_states'])})")
        if has_formula:
            row.append(_mib(v["formula_bytes"]) if v["formula_bytes"] else "")
        for mode in rss_modes:
            r = v["peak_rss"].get(mode)
            row.append("n/a" if not r else f"{_mib(r['train_peak_over_baseline'])} (abs. {_mib(r['train_peak'])})")
        print("| " + " | ".join(row) + " |")
    for name, why in result.get("left_out", {}).items():
        print(f"\n- {name} left out: {why}")
    if not has_mem:
        print("\n(zero_strategy.memory.memory_stats is not available: measured bytes left out)")
    if rss_modes:
        print("\nPeak RSS: each variant alone in a fresh pair of processes, "
              f"{c['memory_steps']} training steps, the largest rank; MiB above the resident size just before the "
              "model was built (torch, gloo and the batches already in), absolute VmHWM in brackets. 'glibc malloc': "
              "as a user runs it (freed tensors partly stay in the heap); 'mmap >= 128 KiB': "
              "glibc's mmap threshold set to 128 KiB (mallopt), so tensors go back to the OS when freed and RSS "
              "follows the live ones.")
        mode = "mmap" if "mmap" in rss_modes else rss_modes[0]
        cols = [("start", "end", "between steps"), ("forward", "peak", "forward peak"),
                ("forward", "end", "end of forward"), ("backward", "peak", "backward peak"),
                ("backward", "end", "end of backward"), ("opt.step", "peak", "opt.step peak")]
        print(f"\nRSS MiB/rank above the pre-model baseline through the last step ({rss_titles[mode]}, largest "
              "rank):\n")
        print("| variant | " + " | ".join(t for _, _, t in cols) + " |")
        print("|---|" + "|".join("---" for _ in cols) + "|")
        for name, v in vs.items():
            r = v["peak_rss"].get(mode)
            ph = (r or {}).get("last_step_phases_over_baseline") or {}
            cells = [_mib(ph[a][b]) if a in ph and b in ph[a] else "" for a, b, _ in cols]
            print(f"| {name} | " + " | ".join(cells) + " |")

    keys = []
    for v in vs.values():
        keys += [k for k in v["phases_median"] if k not in keys]
    print("\nPhases, rank 0, median seconds per step (fwd./bwd./step. prefixes: the step phase a wrapped call "
          "ran in; nested calls are also counted in their callers; page faults: a count, the whole process):\n")
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

def _set_mmap_threshold(numel_bytes: int) -> bool:
    """glibc's ``mallopt(M_MMAP_THRESHOLD, ...)`` in this process; False where there is no glibc."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, numel_bytes))  # M_MMAP_THRESHOLD is -3
    except (OSError, AttributeError):
        return False


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, job: str, out_path: str) -> None:
    """``job``: "time" (every variant, the timed run) or "rss:MODE:VARIANT" (one variant's RSS run)."""
    mmap_set = None
    if job.startswith("rss:mmap:"):
        mmap_set = _set_mmap_threshold(MMAP_THRESHOLD)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
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
    """Run ``job`` on fresh processes. The RSS runs fork (this process has imported torch and
    zero_strategy but holds no tensors or process group): a spawned child spends ~5 s importing."""
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
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2: one per core here)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory-steps", type=int, default=3,
                   help="training steps of each variant's own peak-RSS run (default 3; 0: no RSS runs)")
    p.add_argument("--rss-malloc", choices=("both", "default", "mmap"), default="both",
                   help="the peak-RSS runs: with glibc's default malloc, with its mmap threshold at 128 KiB "
                        "(freed tensors go back to the OS: RSS follows live tensors), or both (default)")
    p.add_argument("--comm", action="store_true", help="also time each gloo collective on one bucket")
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="print torch.profiler's top ROWS ops of one extra step per variant (default 0: off)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    args.variants = list(dict.fromkeys(v.strip() for v in args.variants.split(",") if v.strip()))
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or not args.variants:
        p.error(f"--variants {bad or 'empty'}: choose from {', '.join(VARIANTS)}")
    if args.steps < 1 or args.warmup < 0 or args.memory_steps < 0:
        p.error(f"--steps {args.steps} must be >= 1, --warmup {args.warmup} and --memory-steps "
                f"{args.memory_steps} >= 0")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    left_out = {name: why for name in args.variants if (why := unavailable(name))}
    args.variants = [name for name in args.variants if name not in left_out]
    if not args.variants:
        raise SystemExit(f"no variant can run here: {left_out}")
    result = _spawn(args, "time")
    result["left_out"] = {**left_out, **result["left_out"]}
    for mode in (("default", "mmap") if args.rss_malloc == "both" else (args.rss_malloc,)) if args.memory_steps else ():
        for name in result["variants"]:
            per_rank = _spawn(args, f"rss:{mode}:{name}", "fork")["per_rank"]
            worst = max(per_rank, key=lambda r: r["train_peak_over_baseline"])
            result["variants"][name].setdefault("peak_rss", {})[mode] = {**worst, "per_rank": per_rank}
    print_report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
