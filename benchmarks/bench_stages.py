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
- peak memory per rank. ``ru_maxrss`` only grows and counts the whole process, so a shared
  process cannot say which variant caused a peak. After the timed run, each variant therefore
  runs again alone in fresh processes (on CPU forked from the launcher, which holds no tensors;
  spawned on CUDA; ``--memory-steps`` steps): the resident size is read before the model is built,
  the peak (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``) after building and then
  per phase of every step, and the table gives the training peak above that pre-model baseline
  (the init peak is in the JSON), plus the last step phase by phase. Each variant runs twice:
  with glibc's malloc as it comes (what a user sees; freed tensors partly stay in the heap) and
  with its mmap threshold at 128 KiB, so that freed tensors go back to the OS at once and the
  resident size follows the live tensors (``--rss-malloc``). Where ``clear_refs`` is refused,
  the whole process's ``ru_maxrss`` is reported instead. On CUDA the same runs also read device
  memory: ``torch.cuda.memory_allocated`` before the model is built, and the peak
  (``torch.cuda.max_memory_allocated``, reset per phase) above it.

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


def make_batches(n: int, batch: int, width: int, rank: int,
                 device: torch.device = torch.device("cpu")) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` distinct (input, target) pairs for this rank, the same for every variant (and drawn on
    the CPU whatever the device, so CPU and CUDA runs see the same numbers)."""
    out = []
    for step in range(n):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)  # (B, width)
        out.append((x.to(device), y.to(device)))
    return out


# ---- device ------------------------------------------------------------------------------------

def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model (``/proc/cpuinfo``) with the number of cores."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            model = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
    except OSError:
        model = None
    return f"{model.group(1).strip() if model else 'CPU'} ({os.cpu_count()} cores)"


def rank_device(args: argparse.Namespace) -> torch.device:
    """This rank's device: the GPU ``_worker`` set as current with ``--device cuda``, else the CPU."""
    if args.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA kernels run asynchronously); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device) -> float:
    """``time.perf_counter()`` once ``device`` has finished what was queued on it."""
    synchronize(device)
    return time.perf_counter()


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
    """``name``'s model (the same initial weights for every variant and device) and optimizer."""
    torch.manual_seed(args.seed)
    device = rank_device(args)
    model = ResidualMLP(width, args.layers).to(device)  # built on the CPU: the same init on any device
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)  # before sharding: stage 3 empties parameters
    if name == "ddp":
        device_ids = [device.index] if device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=args.bucket_cap_mb)
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
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        del inner  # FSDP2's optimizer is built over the sharded (DTensor) parameters
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))  # its default is CUDA wherever there is one
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
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
    device = x.device  # on CUDA each phase ends when the device has finished it (clock synchronises)
    synchronize(device)
    dist.barrier()
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = clock(device)
    v.where["phase"] = "fwd"
    loss = F.mse_loss(v.forward(x), y)
    t1 = clock(device)
    v.where["phase"] = "bwd"
    v.backward(loss)
    t2 = clock(device)
    v.where["phase"] = "step"
    v.step()
    t3 = clock(device)
    v.zero_grad()
    t4 = clock(device)
    v.where["phase"] = "other"
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0  # fresh pages touched, all threads
    dist.barrier()
    t5 = clock(device)
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


def comm_bench(numel: int, repeats: int, device: torch.device) -> dict[str, dict[str, float]]:
    """Median seconds of each collective the variants use, on one bucket of ``numel`` fp32.

    ``issue_s`` is how long the asynchronous call holds the calling thread (time that cannot
    overlap backward), ``total_s`` the call plus its wait.
    """
    comm = Collectives()  # the engine's own calls
    full = torch.randn(numel, device=device)
    shard = torch.empty(numel // comm.world_size, device=device)
    ops = {
        "all_reduce": lambda: dist.all_reduce(full, async_op=True),
        "reduce_scatter": lambda: comm.reduce_scatter(shard, full),
        "all_gather": lambda: comm.all_gather(full, shard),
    }
    out = {}
    for name, op in ops.items():
        issue, total = [], []
        for _ in range(repeats + 1):
            synchronize(device)
            dist.barrier()
            t0 = clock(device)
            work = op()
            t1 = time.perf_counter()  # not synchronised: the time the call itself holds the caller
            work.wait()
            issue.append(t1 - t0)
            total.append(clock(device) - t0)
        out[name] = {"issue_s": statistics.median(issue[1:]), "total_s": statistics.median(total[1:])}
    return out


def profile_ops(v: Variant, x: torch.Tensor, y: torch.Tensor, rows: int) -> str:
    """torch.profiler's busiest ops (self CPU time) in one unrecorded step of ``v``, this rank."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = x.device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        train_step(v, x, y, record=False)
    sort_by = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort_by, row_limit=rows)


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


class DeviceMemory:
    """CUDA bytes allocated by tensors on ``device``, above what was allocated when this was made.

    ``phase_peak`` gives the peak since the last call (``torch.cuda.max_memory_allocated``, then
    reset) and keeps the largest in ``train_peak``; ``reserved_peak`` is the caching allocator's
    largest reservation seen (what ``nvidia-smi`` shows, less the CUDA context). On the CPU every
    figure is None.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device if device.type == "cuda" else None
        self.baseline = torch.cuda.memory_allocated(self.device) if self.device else 0
        self.train_peak = 0
        self.reserved_peak = 0
        self.reset()

    def reset(self) -> None:
        if self.device:
            torch.cuda.reset_peak_memory_stats(self.device)

    def now(self) -> Optional[int]:
        return torch.cuda.memory_allocated(self.device) - self.baseline if self.device else None

    def phase_peak(self) -> Optional[int]:
        if not self.device:
            return None
        synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - self.baseline
        self.train_peak = max(self.train_peak, peak)
        self.reserved_peak = max(self.reserved_peak, torch.cuda.max_memory_reserved(self.device))
        self.reset()
        return peak

    def summary(self, init_peak: Optional[int]) -> Optional[dict[str, int]]:
        if not self.device:
            return None
        return {"baseline": self.baseline, "init_peak_over_baseline": init_peak,
                "train_peak_over_baseline": self.train_peak, "reserved_peak": self.reserved_peak}


def peak_rss_rank(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """Bytes of this rank: resident before the model is built, peak while building, peak while
    training, and (last step) the peak and the end of each phase, all over the pre-model baseline.
    On CUDA the same for device memory (``device``, and ``device_peak``/``device_end`` per phase)."""
    width = model_shape(args.params_millions, args.layers)
    batches = make_batches(max(1, args.memory_steps), args.batch, width, dist.get_rank(), rank_device(args))
    dist.barrier()
    baseline = _rss()
    device_memory = DeviceMemory(rank_device(args))
    resettable = _reset_peak_rss()
    variants, failed = build_variants([name], args, width)
    init_peak = _rss("VmHWM") if resettable else None
    device_init_peak = device_memory.phase_peak()
    device_memory.train_peak = 0  # the training peak starts after the init
    phases: dict[str, dict[str, int]] = {}
    train_peak = 0

    def phase_ended(phase: str) -> None:  # the phase's peak, then a fresh peak for the next one
        nonlocal train_peak, resettable
        device_peak = device_memory.phase_peak()
        peak = _rss("VmHWM")
        train_peak = max(train_peak, peak)
        phases[phase] = {"peak": peak - baseline, "end": _rss() - baseline}
        if device_peak is not None:
            phases[phase].update(device_peak=device_peak, device_end=device_memory.now())
        resettable = resettable and _reset_peak_rss()

    for x, y in batches:
        for v in variants:
            dist.barrier()
            phases = {"start": {"end": _rss() - baseline}}
            if device_memory.device:
                phases["start"]["device_end"] = device_memory.now()
            device_memory.reset()
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
            "last_step_phases_over_baseline": phases, "device": device_memory.summary(device_init_peak),
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


# ---- report ------------------------------------------------------------------------------------

def _mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


RSS_TITLES = {"default": "peak RSS MiB/rank, glibc malloc", "mmap": "peak RSS MiB/rank, mmap >= 128 KiB"}
PHASE_COLUMNS = [("start", "end", "between steps"), ("forward", "peak", "forward peak"),
                 ("forward", "end", "end of forward"), ("backward", "peak", "backward peak"),
                 ("backward", "end", "end of backward"), ("opt.step", "peak", "opt.step peak")]
"""(phase, figure, column title) of the per-phase memory tables; device figures are prefixed "device_"."""


def _table(head: list[str], rows: Iterable[list[str]]) -> list[str]:
    """A markdown table's lines."""
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _title(c: dict[str, Any]) -> str:
    backend = c.get("backend", "gloo")
    ranks = f"{c['world_size']} {backend} ranks"
    if backend == "gloo":
        ranks += f" x {c['threads_per_rank']} thread"
    where = f" on {c['device_name']}" if c.get("device_name") else ""
    return (f"### DDP, ZeRO stages and FSDP2: {c['parameters'] / 1e6:.1f}M parameters "
            f"({c['layers']} ResidualBlock(Linear {c['width']}x{c['width']}) + Linear head), "
            f"fp32 AdamW, batch {c['batch']}/rank, {ranks}{where}, bucket {c['bucket_cap_mb']} MiB, "
            f"{c['warmup']} warm-up + {c['steps']} timed steps, torch {c['torch']}")


def summary_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The main table, one row per variant: time, parity, model state against the formula, peaks."""
    vs, base = result["variants"], result["config"]["baseline"]
    has_mem = any(v["model_state_bytes"] for v in vs.values())
    has_formula = any(v["formula_bytes"] for v in vs.values())
    has_device = any(v.get("peak_device") for v in vs.values())
    rss_modes = list(dict.fromkeys(m for v in vs.values() for m in v["peak_rss"]))
    head = ["variant", "median step (s)", f"ratio vs {base}", "paired ratio", "final loss (rank 0)",
            f"max \\|Δloss\\| vs {base}", f"max \\|Δparam\\| vs {base}"]
    head += ["model-state MiB/rank (measured: params, grads, optim state)"] if has_mem else []
    head += ["MiB/rank (formula)"] if has_formula else []
    head += ["peak device MiB/rank (allocated)"] if has_device else []
    head += [RSS_TITLES[m] for m in rss_modes]
    rows = []
    for name, v in vs.items():
        row = [name, f"{v['median_step_s']:.3f}", f"{v['ratio_to_baseline']:.2f}x",
               f"{v['paired_ratio_to_baseline']:.2f}x", f"{v['final_loss_rank0']:.6f}"]
        row += (["n/a (no averaging)"] * 2 if name == "local"
                else [f"{v['max_loss_diff_vs_baseline']:.2e}", f"{v['max_param_diff_vs_baseline']:.2e}"])
        if has_mem:
            m = v["model_state_bytes"]
            row.append("n/a" if m is None else f"{_mib(m['total'])} (p {_mib(m['params'])}, g {_mib(m['grads'])}, "
                                               f"os {_mib(m['optimizer_states'])})")
        if has_formula:
            row.append(_mib(v["formula_bytes"]) if v["formula_bytes"] else "")
        if has_device:
            d = v.get("peak_device")
            row.append("n/a" if not d else f"{_mib(d['train_peak_over_baseline'])} "
                                           f"(reserved {_mib(d['reserved_peak'])})")
        for mode in rss_modes:
            r = v["peak_rss"].get(mode)
            row.append("n/a" if not r else f"{_mib(r['train_peak_over_baseline'])} (abs. {_mib(r['train_peak'])})")
        rows.append(row)
    return head, rows


def _phase_memory_table(vs: dict[str, Any], phases_of: Callable[[dict], dict], prefix: str) -> list[str]:
    rows = []
    for name, v in vs.items():
        ph = phases_of(v) or {}
        rows.append([name] + [_mib(ph[a][prefix + b]) if prefix + b in ph.get(a, {}) else ""
                              for a, b, _ in PHASE_COLUMNS])
    return _table(["variant"] + [t for _, _, t in PHASE_COLUMNS], rows)


def render_report(result: dict[str, Any]) -> str:
    """The report as markdown: the main table, notes, memory through a step, phases, collectives."""
    c, vs = result["config"], result["variants"]
    out = ["", _title(c), "", *_table(*summary_rows(result))]
    for name, why in result.get("left_out", {}).items():
        out += ["", f"- {name} left out: {why}"]
    if not any(v["model_state_bytes"] for v in vs.values()):
        out += ["", "(zero_strategy.memory.memory_stats is not available: measured bytes left out)"]
    if any(v.get("peak_device") for v in vs.values()):
        out += ["", "Peak device memory: each variant alone in fresh processes, the largest rank; bytes allocated by "
                    "tensors (torch.cuda.max_memory_allocated) above those allocated just before the model was "
                    "built, the caching allocator's largest reservation in brackets.",
                "", "Device MiB/rank above the pre-model allocation through the last step (largest rank):", "",
                *_phase_memory_table(vs, lambda v: (v.get("peak_device") or {}).get("last_step_phases_over_baseline"),
                                     "device_")]
    rss_modes = list(dict.fromkeys(m for v in vs.values() for m in v["peak_rss"]))
    if rss_modes:
        out += ["", "Peak RSS: each variant alone in fresh processes, "
                    f"{c['memory_steps']} training step(s), the largest rank; MiB above the resident size just before "
                    "the model was built (torch, the process group and the batches already in), absolute VmHWM in "
                    "brackets. 'glibc malloc': as a user runs it (freed tensors partly stay in the heap); "
                    "'mmap >= 128 KiB': glibc's mmap threshold set to 128 KiB (mallopt), so tensors go back to the "
                    "OS when freed and RSS follows the live ones."]
        mode = "mmap" if "mmap" in rss_modes else rss_modes[0]
        out += ["", f"RSS MiB/rank above the pre-model baseline through the last step ({RSS_TITLES[mode]}, largest "
                    "rank):", "",
                *_phase_memory_table(vs, lambda v: (v["peak_rss"].get(mode) or {}).get("last_step_phases_over_baseline"),
                                     "")]
    keys = list(dict.fromkeys(k for v in vs.values() for k in v["phases_median"]))
    out += ["", "Phases, rank 0, median seconds per step (fwd./bwd./step. prefixes: the step phase a wrapped call "
                "ran in; nested calls are also counted in their callers; page faults: a count, the whole process):",
            "", *_table(["phase", *vs], ([k] + [f"{v['phases_median'][k]:{'.0f' if 'faults' in k else '.4f'}}"
                                                if k in v["phases_median"] else "" for v in vs.values()]
                                               for k in keys))]
    if result["comm_bucket_s"]:
        out += ["", f"Collectives on one {c['bucket_cap_mb']} MiB bucket, median s "
                    "(issue: how long the async call holds the caller):", "",
                *_table(["collective", "issue", "issue + wait"],
                        ([k, f"{t['issue_s']:.4f}", f"{t['total_s']:.4f}"] for k, t in result["comm_bucket_s"].items()))]
    for name, table in result["profiles_rank0"].items():
        out += ["", f"torch.profiler, one step of {name}, rank 0:", "", "```", table, "```"]
    return "\n".join(out)


# ---- files: JSON, markdown, PNG ----------------------------------------------------------------

NO_MATPLOTLIB = ("matplotlib is not installed, so the plot (results.png) cannot be drawn: "
                 "pip install matplotlib, or pip install -e \".[bench]\" from the repository root")


def _mib_label(mib: float) -> str:
    """A bar's label: whole MiB, or one decimal below 10 (a tiny model's figures)."""
    return f"{mib:.0f}" if abs(mib) >= 10 else f"{mib:.1f}"


def matplotlib_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def plot_results(result: dict[str, Any], path: str) -> None:
    """A PNG of three panels per variant: step time over the baseline's (paired ratio bars, ratio of
    medians as dots, loss parity under each name), model-state MiB per rank measured beside the
    formula, and the peak memory per rank (device memory on CUDA, else resident memory).

    matplotlib is imported here, not at the top, so the benchmark runs without it; drawing uses
    the Agg canvas directly (no pyplot, no display, no global backend switch).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise RuntimeError(NO_MATPLOTLIB) from e

    c, vs = result["config"], result["variants"]
    names, base = list(vs), c["baseline"]
    xs = list(range(len(names)))
    fig = Figure(figsize=(max(12.0, 3.2 * len(names)), 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax_time, ax_state, ax_peak = fig.subplots(1, 3)

    paired = [vs[n]["paired_ratio_to_baseline"] for n in names]
    bars = ax_time.bar(xs, paired, color="tab:blue", label="paired ratio (median of per-step ratios)")
    ax_time.plot(xs, [vs[n]["ratio_to_baseline"] for n in names], "_", color="black", markersize=18,
                 markeredgewidth=2, label="ratio of medians")
    ax_time.bar_label(bars, labels=[f"{r:.2f}x" for r in paired], label_type="center", color="white", fontsize=9)
    ax_time.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    parity = ["" if n in (base, "local") else f"\nΔloss {vs[n]['max_loss_diff_vs_baseline']:.2g}" for n in names]
    ax_time.set_xticks(xs, [n + p for n, p in zip(names, parity)], fontsize=8)
    ax_time.set_ylabel(f"step time / {base}'s step time")
    ax_time.set_title(f"Step time against {base}")
    ax_time.set_ylim(0, max(paired + [vs[n]["ratio_to_baseline"] for n in names]) * 1.25)
    ax_time.legend(fontsize=7, loc="upper left")

    width = 0.4
    measured = [(vs[n]["model_state_bytes"] or {}).get("total", 0) / 2**20 for n in names]
    formula = [(vs[n]["formula_bytes"] or 0) / 2**20 for n in names]
    bars = ax_state.bar([x - width / 2 for x in xs], measured, width, color="tab:green", label="measured")
    ax_state.bar_label(bars, labels=[_mib_label(m) if m else "n/a" for m in measured], padding=2, fontsize=7)
    ax_state.bar([x + width / 2 for x in xs], formula, width, color="lightgrey", edgecolor="grey", label="formula")
    ax_state.set_xticks(xs, names, fontsize=8)
    ax_state.set_ylabel("MiB per rank")
    ax_state.set_title("Model state per rank (params, grads, optimizer)")
    ax_state.set_ylim(0, max(measured + formula + [1e-9]) * 1.25)
    ax_state.legend(fontsize=7, ncols=2, loc="upper right")

    if any(v.get("peak_device") for v in vs.values()):
        series = {"device, allocated": [(vs[n].get("peak_device") or {}).get("train_peak_over_baseline", 0)
                                        for n in names]}
        peak_title = "Peak device memory per rank, training"
    else:
        modes = list(dict.fromkeys(m for v in vs.values() for m in v["peak_rss"]))
        series = {RSS_TITLES[m].split(", ", 1)[1]: [(vs[n]["peak_rss"].get(m) or {}).get("train_peak_over_baseline", 0)
                                                   for n in names] for m in modes}
        peak_title = "Peak resident memory per rank, training"
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        offset = (i - (len(series) - 1) / 2) * width
        bars = ax_peak.bar([x + offset for x in xs], [b / 2**20 for b in values], width, label=label)
        ax_peak.bar_label(bars, labels=[_mib_label(b / 2**20) for b in values], padding=2, fontsize=7)
    ax_peak.set_xticks(xs, names, fontsize=8)
    ax_peak.set_ylabel("MiB per rank above the pre-model baseline")
    ax_peak.set_title(peak_title if series else "Peak memory: not measured (--memory-steps 0)")
    if series:
        ax_peak.set_ylim(0, max([b / 2**20 for values in series.values() for b in values] + [1e-9]) * 1.25)
        ax_peak.legend(fontsize=7, ncols=len(series), loc="upper center")

    fig.suptitle(f"{c['parameters'] / 1e6:.1f}M parameters, fp32 AdamW, batch {c['batch']}/rank, "
                 f"{c['world_size']} {c.get('backend', 'gloo')} ranks on {c.get('device_name', '?')}, "
                 f"{c['steps']} timed steps", fontsize=10)
    fig.savefig(path, dpi=100)


def write_outputs(result: dict[str, Any], report: str, out_dir: str) -> list[str]:
    """``out_dir``/results.json, results.md and (where matplotlib is installed) results.png; the paths
    written. The markdown is the printed report under a heading naming the command and the machine."""
    os.makedirs(out_dir, exist_ok=True)
    c = result["config"]
    paths = {name: os.path.join(out_dir, name) for name in ("results.json", "results.md", "results.png")}
    with open(paths["results.json"], "w") as f:
        json.dump(result, f, indent=2)
    written = [paths["results.json"]]
    plotted = matplotlib_available()
    if plotted:
        plot_results(result, paths["results.png"])
        written.append(paths["results.png"])
    else:
        print(f"note: {NO_MATPLOTLIB}", file=sys.stderr)
    header = ["# Benchmark: DDP, ZeRO stages 1-3 and FSDP2", "",
              f"`{c.get('command', 'python benchmarks/bench_stages.py')}` on {c.get('device_name', '?')}, "
              f"torch {c['torch']}, {c.get('date', '')}.", ""]
    if plotted:
        header += ["![step time against DDP, model state against the formula, peak memory](results.png)", ""]
    with open(paths["results.md"], "w") as f:
        f.write("\n".join(header) + "\n" + report.lstrip("\n") + "\n")
    written.insert(1, paths["results.md"])
    return written


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
