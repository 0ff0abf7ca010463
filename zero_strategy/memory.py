"""Memory you can see: the ZeRO paper's per-rank formula, and exact accounting of live tensors.

Both answer in the same keys, bytes per rank: ``params`` (working weights), ``grads``,
``optimizer_states`` (e.g. Adam's two moments), ``master_params`` (fp32 copies of low-precision
weights), and ``total``; and where those bytes live: ``device``, ``host`` (offloaded to host
memory) and ``disk`` (optimizer state in ``offload_dir``), which add up to ``total``.
``memory_stats`` also reports ``workspace``: the engine's reusable transient buffers held free
between uses (stage 3's gather buffers, the gradient staging buffers: see [Note: reused buffers] in
engine/buffers/pool.py). Like activations, they are not model state: the formula has no term for them, and
they are not in ``total``.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

import torch

from .checkpoint.background import checkpoint_buffer_bytes
from .engine import ZeroOptimizer
from .engine.optim.step.whole import assign_owners
from .engine.params.flat_parameters import owner_of, owners_of

if TYPE_CHECKING:
    from .config import ZeroConfig

KEYS = ("params", "grads", "optimizer_states", "master_params")
LOCATIONS = ("device", "host", "disk")

# [Note: precision names]
# The one table of the precisions this package trains in, named as Lightning's Trainer(precision=...)
# names them: the dtype of the working weights and gradients. "-mixed" adds an fp32 master copy of
# each rank's shard (see [Note: precision] in frontend/precision.py), "-true" keeps none; fp32 and fp64
# weights are their own master. ZeroPrecision (precision.py) and the memory formula below both read it.
PRECISION_DTYPES: dict[str, torch.dtype] = {
    "32-true": torch.float32,
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
    "bf16-true": torch.bfloat16,
    "16-true": torch.float16,
    "64-true": torch.float64,
}
PRECISION_ALIASES = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed", "half": "16-true", "64": "64-true"}
"""What Lightning also accepts for the same settings."""


def normalize_precision(precision: str | int) -> str:
    """The name in ``PRECISION_DTYPES`` of ``precision`` or of its alias (``"bf16"`` -> ``"bf16-mixed"``)."""
    name = PRECISION_ALIASES.get(str(precision), str(precision))
    if name not in PRECISION_DTYPES:
        raise ValueError(f"precision={precision!r} is not known; use one of {sorted(PRECISION_DTYPES)} "
                         "(named as Lightning's Trainer(precision=...) names them).")
    return name


def has_master_weights(precision: str) -> bool:
    """Whether the optimizer keeps an fp32 copy of low-precision weights (see [Note: precision names])."""
    return normalize_precision(precision).endswith("-mixed")


def _bytes_per_parameter(precision: str) -> tuple[int, int, int, int]:
    """(working weight, gradient, fp32 master copy, default optimizer state) bytes per parameter.

    The state default is Adam's two moments, in the dtype the optimizer steps: fp32 unless the whole
    run is in true half. Mixed bf16/fp16 gives the paper's K = 4 + 8 = 12."""
    dtype = PRECISION_DTYPES[normalize_precision(precision)]
    weight = dtype.itemsize
    master = 4 if has_master_weights(precision) else 0
    stepped = 4 if master or dtype == torch.float32 else weight
    return weight, weight, master, 2 * stepped


def estimate_memory(num_params: int, stage: int = 2, world_size: int = 1, precision: str | int = "32-true",
                    offload_optimizer: bool = False, offload_params: bool = False,
                    optimizer_state_bytes: Optional[float] = None, offload_disk: bool = False,
                    trainable_params: Optional[int] = None, async_save: bool = False,
                    optimizer_state_dtype: str = "fp32", master_weights_dtype: str = "fp32",
                    optimizer_state_block_size: int = 256,
                    local_accumulation: bool = False, grad_accum_dtype: str = "fp32",
                    whole_parameters: Optional[Sequence[int]] = None) -> dict[str, int]:
    """Per-rank model-state bytes that the ZeRO paper's formula predicts, and where they live.

    Stage 0 is plain data parallelism. With mixed-precision Adam (K = 12) this gives the paper's
    P_os = 4Ψ + KΨ/N, P_os+g = 2Ψ + (2+K)Ψ/N and P_os+g+p = (4+K)Ψ/N. ``optimizer_state_bytes`` is
    the optimizer's state per parameter (default Adam's: 8 bytes, 4 when training in true half);
    SGD with momentum has 4.

    Offload (as the engine does it, see zero_strategy/engine/buffers/host.py): ``offload_optimizer``
    moves the master weights, the optimizer state and the gradient shard the step reads to the
    host; the master is then a copy even for fp32 (or true-half) weights, and the host gradient is
    in the master's dtype. Stage 1 keeps its full device gradient for autograd besides. Between
    uses, ``offload_params`` (stage 3) keeps the parameter shards on the host, and ``offload_disk``
    (``offload_dir``) the optimizer state in files. Staging buffers of a few buckets are not counted.
    ``trainable_params`` (default: all of them) is how many get gradients, masters and optimizer state:
    a LoRA model's adapters, its frozen base counted in ``params`` only.
    ``checkpoint_buffers`` (not in ``total``) is the host memory ``async_save`` keeps between saves:
    the rank's share of what a checkpoint holds, its pieces of the weights, masters and state.

    ``optimizer_state_dtype`` and ``master_weights_dtype`` (see ZeroConfig) count the low-precision
    step's bytes (engine/optim/step/lowp.py): the state elements (``optimizer_state_bytes`` / 4 of them,
    Adam's 2 by default) at 4 (fp32), 2 (bf16) or 1 + 4 / ``optimizer_state_block_size`` (int8 and
    its scales) bytes each, and no master copy with bf16 masters (the working weights, bf16 only).
    Every parameter is counted as large (``optimizer_state_min_numel`` keeps fp32 state for small
    ones: a few per cent of a transformer's bytes at most).
    ``local_accumulation`` (stages 2-3) adds the full-size local gradient buffer to the device's
    ``grads``: 4 bytes per trainable parameter with ``grad_accum_dtype="fp32"``, the working dtype's with
    "working" (see [Note: local accumulation] in engine/grads/accumulation.py).
    ``whole_parameters``: the sizes (elements) of the trainable parameters, when the optimizer is stepped
    whole (Muon, Adafactor, ``whole_parameter_step``: see [Note: whole-parameter step] in
    engine/optim/step/whole.py): at stages 1-3 a rank then holds the state of the parameters it owns,
    owners balanced largest first, which is the most loaded rank's here: at most 1/N of the total plus
    the largest parameter's. The whole tensors the step builds (the owned parameters' values and
    gradients) live only during the step and are not counted, as activations are not.
    """
    if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 0:
        raise ValueError(f"num_params={num_params!r} must be a non-negative integer")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r} must be 0 (data parallel), 1, 2 or 3")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer")
    if offload_params and stage != 3:
        raise ValueError(f"offload_params=True needs stage 3 (parameters are only sharded there), got stage={stage}")
    if (offload_optimizer or offload_disk) and stage == 0:
        raise ValueError("offload needs a ZeRO stage (1, 2 or 3), got stage=0 (plain data parallelism)")
    if offload_disk and not offload_optimizer:
        raise ValueError("offload_disk=True keeps optimizer state on disk, which needs offload_optimizer=True")
    if trainable_params is not None and not 0 <= trainable_params <= num_params:
        raise ValueError(f"trainable_params={trainable_params!r} must lie between 0 and num_params={num_params}")
    param_b, grad_b, master_b, state_b = _bytes_per_parameter(precision)
    if optimizer_state_bytes is not None:
        state_b = optimizer_state_bytes
    if optimizer_state_dtype != "fp32" or master_weights_dtype != "fp32":
        master_b, state_b = _low_precision_bytes(precision, master_b, optimizer_state_bytes, optimizer_state_dtype,
                                                 master_weights_dtype, optimizer_state_block_size, offload_optimizer,
                                                 offload_disk)
    n = world_size
    shard = n if stage >= 1 else 1
    trained = num_params if trainable_params is None else trainable_params
    where: dict[str, dict[str, float]] = {loc: {k: 0.0 for k in KEYS} for loc in LOCATIONS}
    where["host" if offload_params else "device"]["params"] = param_b * num_params / (n if stage >= 3 else 1)
    if offload_optimizer:
        host_master_b = master_b or param_b  # the host step needs its own copy of the weights
        if offload_params and master_b == 0:
            host_master_b = 0  # the host shard, in the working dtype, is its own master
        where["host"]["master_params"] = host_master_b * trained / shard
        where["host"]["grads"] = (master_b or grad_b) * trained / shard
        if stage == 1:
            where["device"]["grads"] = grad_b * trained  # autograd's full buffer
        where["disk" if offload_disk else "host"]["optimizer_states"] = state_b * trained / shard
    else:
        where["device"]["master_params"] = master_b * trained / shard
        where["device"]["grads"] = grad_b * trained / (n if stage >= 2 else 1)
        where["device"]["optimizer_states"] = state_b * trained / shard
    if whole_parameters is not None and stage >= 1:
        if offload_optimizer or optimizer_state_dtype != "fp32" or master_weights_dtype != "fp32":
            raise ValueError("whole_parameters: an optimizer stepped whole keeps fp32 state on the device (offload and "
                             "low-precision state step flat shards); estimate it with offload_optimizer=False and both "
                             "dtypes at 'fp32'.")
        if sum(whole_parameters) != trained:
            raise ValueError(f"whole_parameters sum to {sum(whole_parameters)} elements, but {trained} parameters are "
                             "trained (trainable_params, else num_params): give the size of each trainable parameter.")
        owner = assign_owners([list(whole_parameters)], n)
        load = [0] * n
        for (_, i), r in owner.items():
            load[r] += whole_parameters[i]
        where["device"]["optimizer_states"] = state_b * max(load)
    if local_accumulation:
        if stage < 2:
            raise ValueError(f"local_accumulation=True needs stage 2 or 3 (got stage={stage}): stages 0-1 keep whole "
                             "gradients until the step anyway")
        where["device"]["grads"] += (4 if grad_accum_dtype == "fp32" else grad_b) * trained  # trainable ones only
    out = {k: int(round(sum(where[loc][k] for loc in LOCATIONS))) for k in KEYS}
    out["total"] = sum(out[k] for k in KEYS)
    for loc in ("host", "disk"):
        out[loc] = int(round(sum(where[loc].values())))
    out["device"] = out["total"] - out["host"] - out["disk"]
    out["checkpoint_buffers"] = (int(round((param_b * num_params + (master_b + state_b) * trained) / shard))
                                 if async_save else 0)
    return out


def estimated_options(config: ZeroConfig) -> dict[str, Any]:
    """``config``'s values of the options that ``estimate_memory`` takes: those of its arguments that
    are named as ZeroConfig's fields (with the fields' defaults: see [Note: one source for each option])."""
    taken = inspect.signature(estimate_memory).parameters
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name in taken}


def _low_precision_bytes(precision: str, master_b: int, state_bytes: Optional[float], state_dtype: str,
                         master_dtype: str, block: int, offload: bool, offload_disk: bool) -> tuple[int, float]:
    """(master copy, optimizer state) bytes per parameter of the low-precision step (see estimate_memory)."""
    from .config import ZeroConfig

    ZeroConfig(optimizer_state_dtype=state_dtype, master_weights_dtype=master_dtype,  # their checks
               optimizer_state_block_size=block, offload_optimizer=offload)
    if offload_disk:
        raise ValueError(f"offload_disk=True with optimizer_state_dtype={state_dtype!r} / master_weights_dtype="
                         f"{master_dtype!r}: the disk step keeps fp32 state. Estimate host offload "
                         "(offload_optimizer=True alone, the state stored encoded there), or both dtypes at 'fp32'.")
    if master_dtype == "bf16":
        if PRECISION_DTYPES[normalize_precision(precision)] != torch.bfloat16:
            raise ValueError(f"master_weights_dtype='bf16' makes bf16 working weights their own master; precision="
                             f"{precision!r} has none. Use 'bf16-mixed' or 'bf16-true', or master_weights_dtype='fp32'.")
        master_b = 0
    elements = (8 if state_bytes is None else state_bytes) / 4  # fp32 state elements per parameter
    return master_b, elements * {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / block}[state_dtype]


def count_parameters(module: torch.nn.Module) -> int:
    """Elements of ``module``'s parameters, each once, sharded ones (stage 3) at their full size."""
    total = 0
    for p in dict.fromkeys(module.parameters()):
        owner = owner_of(p)
        total += owner.full_numel[p] if owner is not None else p.numel()
    return total


class _StorageCounter:
    """Bytes of distinct storages, split into device and host: views of one buffer count once."""

    def __init__(self, on_host: Iterable[torch.Tensor] = ()) -> None:
        self._seen: set[int] = set()
        self._host = {t.untyped_storage().data_ptr() for t in on_host if t.device.type != "meta"}
        self.host = 0  # of everything counted so far, the bytes in host memory

    def __call__(self, tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in self._seen or storage.nbytes() == 0:
                continue
            self._seen.add(storage.data_ptr())
            total += storage.nbytes()
            if storage.data_ptr() in self._host:
                self.host += storage.nbytes()
        return total


def memory_stats(module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> dict[str, int]:
    """This rank's bytes held by ``module``'s parameters and gradients and by ``optimizers``.

    Counted from the live tensors' storages, each storage once; a ZeroOptimizer's fp32 master
    that aliases the parameters (see [Note: master weights]) is counted as parameters only. At
    stage 3, parameters are the shards plus whatever units are gathered at the moment. ``host``
    counts what the engine offloaded to host memory (on a CPU run that is the same memory as the
    device's, but still told apart), ``disk`` the optimizer state in ``offload_dir`` files,
    ``workspace`` the engine's reusable buffers held free now, and ``checkpoint_buffers`` the host
    buffers ``async_save`` keeps between saves (neither in ``total``).
    """
    optimizers = list(optimizers)
    sharders = owners_of(module)
    zero = [o for o in optimizers if isinstance(o, ZeroOptimizer)]
    count = _StorageCounter([*(t for s in sharders for t in s.host_tensors()),
                             *(t for o in zero for t in o.memory_tensors()["host"])])
    stats = {"params": count([*module.parameters(), *(t for s in sharders for t in s.held_tensors())])}
    stats["grads"] = count([t for o in zero for t in o.memory_tensors()["grads"]]
                           + [p.grad for p in module.parameters() if p.grad is not None])
    stats["master_params"] = count(t for o in zero for t in o.memory_tensors()["master_params"])
    disk = sum(o.disk_bytes() for o in zero)
    stats["optimizer_states"] = disk + count(
        [*(v for o in optimizers for s in o.state.values()  # a ZeroOptimizer's: its inner optimizer's
           for v in s.values()), *(t for o in zero for t in o.memory_tensors()["pending_states"]),
         *(t for o in zero for t in o.memory_tensors()["stored_states"])]  # int8/bf16 state (engine/optim/step/lowp.py)
    )
    stats["total"] = sum(stats[k] for k in KEYS)
    stats["workspace"] = count([*(t for s in sharders for t in s.workspace_tensors()),
                                *(t for o in zero for t in o.memory_tensors()["workspace"])])
    stats["checkpoint_buffers"] = checkpoint_buffer_bytes(module)  # async_save's host copies, not in total
    stats["host"] = count.host
    stats["disk"] = disk
    stats["device"] = stats["total"] - stats["host"] - stats["disk"]
    return stats
