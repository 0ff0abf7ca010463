"""The measurements of benchmarks/bench_stages.py besides step time: model-state bytes (counted
from live tensors, and the ZeRO paper's formula), parameter parity against the baseline, the
collectives alone on one bucket, torch.profiler's busiest ops, and the peak resident and device
memory of one variant alone in fresh processes (the harness's overview is bench_stages.py's
docstring)."""

from __future__ import annotations

import argparse
import re
import resource
import statistics
import time
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zero_strategy import ZeroOptimizer
from zero_strategy.engine import Collectives

from benchmarks.stages_variants import (Variant, build_variants, clock, make_batches, model_shape, rank_device,
                                        synchronize, train_step)

try:  # written in parallel; the memory columns are left out where it does not exist
    from zero_strategy.memory import estimate_memory, memory_stats
except ImportError:
    estimate_memory = memory_stats = None
try:
    from zero_strategy import gathered_parameters
except ImportError:
    gathered_parameters = None


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


DEEPSPEED3_ROLES = {  # what each attribute of DeepSpeed 0.19's ZeRO-3 optimizer holds (others: buffers)
    "fp16_partitioned_groups_flat": "params",  # this rank's partition of the parameters (views of
    "lp_param_buffer": "params",  # one buffer), and the parameters small enough to stay whole
    "persistent_parameters": "params",
    "fp32_partitioned_groups_flat": "master_params",  # an fp32 copy of the partition, fp32 training too
    "grad_partitions_flat_buffer": "grads",  # this rank's partition of the gradients
    "averaged_gradients": "grads",
}


def _tensors_in(value: Any, depth: int = 3) -> Iterable[torch.Tensor]:
    """The tensors in ``value``: itself, or the items of its lists, tuples and dicts, ``depth`` deep."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth and isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item, depth - 1)
    elif depth and isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item, depth - 1)


def deepspeed3_state_bytes(v: Variant) -> dict[str, int]:
    """This rank's bytes in DeepSpeed's ZeRO-3 optimizer, by role (``DEEPSPEED3_ROLES``), each storage
    once. Its gradient partition is one buffer allocated for good, so no backward is needed; the
    tensors it holds for other ends (communication buckets) are ``workspace``, outside ``total`` as
    in ``memory_stats``."""
    opt = v.opt.optimizer  # the engine's DeepSpeedZeroOptimizer_Stage3
    seen: set[int] = set()
    out = dict.fromkeys(("params", "grads", "optimizer_states", "master_params"), 0)
    for name, role in DEEPSPEED3_ROLES.items():
        out[role] += storage_bytes(_tensors_in(getattr(opt, name, None)), seen)
    out["optimizer_states"] += storage_bytes((t for s in opt.optimizer.state.values() for t in s.values()), seen)
    out["total"] = sum(out.values())
    out["workspace"] = storage_bytes((t for value in vars(opt).values() for t in _tensors_in(value)), seen)
    return out


def model_state_bytes(v: Variant, x: torch.Tensor, y: torch.Tensor) -> Optional[dict[str, int]]:
    """Model-state bytes for this rank while gradients are live (after a backward), or None.

    Untimed; the gradients are dropped again. DDP's own bucket copy of the gradients is not a
    tensor of the model or optimizer, so it is not counted.
    """
    if v.name == "deepspeed3":
        return deepspeed3_state_bytes(v)
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
                "zero3_default": (3, world), "fsdp2": (3, world), "deepspeed3": (3, world)}[name]
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
