"""The variants of benchmarks/bench_stages.py: the model and its batches, each rank's device, the
wrappers that time the phases of a step, the builders of DDP, ZeRO-1/2/3, FSDP2 and DeepSpeed
ZeRO-3, and the timed train step (the harness's overview is bench_stages.py's docstring)."""

from __future__ import annotations

import argparse
import functools
import math
import os
import re
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from zero_strategy import ZeroConfig, ZeroOptimizer
from zero_strategy.engine import shard_module

try:  # written in parallel; stage 3 is left out where it does not exist
    from zero_strategy import gathered_parameters
except ImportError:
    gathered_parameters = None

VARIANTS = ("ddp", "zero1", "zero2", "zero3", "zero3_default", "fsdp2", "deepspeed3", "local")
"""zero3_default: stage 3 with no option but the bucket size (units chosen by size, as
``strategy="zero_stage_3"`` chooses them); local: the same training without any communication (each
rank alone), the compute floor."""
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
    """This rank's device: the GPU ``bench_stages._worker`` set as current with ``--device cuda``, else the CPU."""
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
    all-gathers it issues, or a prefetch still in flight); ``s3.prefetch`` only issues one. Both
    include the order guard's check ([Note: order guard]). ``s3.group_gather`` (inside both) is
    allocating the full buffer and issuing the all-gather; ``s3.release`` drops buffers (and waits
    for a gather not yet waited on).
    """
    _wrap(sharder, "gather", phases,
          lambda unit, phase=0, wait=True, context=None: "s3.gather(sync)" if wait else "s3.prefetch", where)
    _wrap(sharder, "backward_finished", phases, "s3.backward_finished", where)
    for unit in sharder.all_units:
        _wrap(unit, "release", phases, "s3.release", where)
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
    sharder: Any = None  # zero3's FlatParameters
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
    # glibc's mmap threshold is the process's: the engine sets it only in a process of its own, never
    # under the variants sharing the timed run (see [Note: glibc's mmap threshold] in
    # zero_strategy/engine/buffers/malloc.py)
    malloc = {} if getattr(args, "engine_sets_malloc", False) else {"cpu_mmap_threshold_mb": None}
    if name in ("zero1", "zero2"):
        opt = ZeroOptimizer(inner, ZeroConfig(stage=int(name[-1]), bucket_cap_mb=args.bucket_cap_mb, **malloc))
        v = Variant(name, model, model, opt)
        instrument_zero(opt, v._current)
        return v
    if name in ("zero3", "zero3_default"):
        units = {"shard_modules": (ResidualBlock.__name__,)} if name == "zero3" else {}
        config = ZeroConfig(stage=3, bucket_cap_mb=args.bucket_cap_mb, **units, **malloc)
        sharder = shard_module(model, config)
        opt = ZeroOptimizer(inner, config, sharder=sharder)
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
        # A failure (DeepSpeed not installed, or not for this accelerator) is caught by the caller
        # and reported as the reason the variant is left out. On CPU it needs DS_ACCELERATOR=cpu
        # and LOCAL_RANK, which bench_stages's workers set.
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
