"""Frozen, validated configuration of the ZeRO engine.

Validation lives here, away from any process group, so a bad value fails at construction with
a message that names the value, what is allowed, and what to do instead.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

import torch

if TYPE_CHECKING:
    from .engine.quantize import QuantSpec

SUPPORTED_STAGES = (1, 2, 3)

MIN_MMAP_THRESHOLD_MB, MAX_MMAP_THRESHOLD_MB = 0.125, 32
"""glibc's first mmap threshold and its largest on 64-bit systems (``DEFAULT_MMAP_THRESHOLD_MAX``):
see cpu_mmap_threshold_mb."""


@dataclass(frozen=True)
class ZeroConfig:
    """What the engine shards and how it communicates."""

    stage: int = 2
    """1: shard optimizer state (and fp32 master weights); gradients stay whole on every rank and
    are reduce-scattered once before the step. 2: also shard gradients; each bucket is
    reduce-scattered as soon as backward has produced it and only the owned slice is kept."""

    bucket_cap_mb: float = 25.0
    """Size of one communication bucket (a "segment" of a flat buffer), in MiB of the parameter
    dtype. 25 MiB is DDP's default: large enough to amortise a collective's latency, small
    enough that reduction of early buckets overlaps the rest of backward."""

    shard_modules: tuple[Union[str, type], ...] = ()
    """Stage 3: module classes (or class names) whose instances are each one unit, gathered with one
    all-gather around their forward and backward, e.g. ("Block",) for a transformer's layers."""

    unit_params: Optional[int] = None
    """Stage 3 without shard_modules: the size units are cut to, in parameters (see [Note: default
    units] in engine/unit_plan.py). None: one bucket, and at most an eighth of the model."""

    param_persistence_threshold: int = 100_000
    """Stage 3: parameters with fewer elements stay whole on every rank (biases, norms): gathering
    them would cost more in latency than keeping them saves. DeepSpeed's default."""

    prefetch: bool = True
    """Stage 3: start the next unit's all-gather when a unit starts (forward) or is reached (backward)."""

    master_weights: bool = True
    """Low-precision (bf16/fp16) trainable parameters get an fp32 master copy of this rank's shard,
    which the optimizer updates ("bf16-mixed", "16-mixed"). False updates the low-precision
    parameters themselves ("bf16-true", "16-true"). fp32 parameters are their own master either way."""

    allow_untested_optimizer: bool = False
    """Re-create optimizer classes this package has not verified to be elementwise. A wrong
    guess silently changes the update (the optimizer sees a flat shard, not the parameter's
    shape), so this is opt-in, as with DeepSpeed's ``zero_allow_untested_optimizer``."""

    offload_optimizer: bool = False
    """Keep the fp32 master weights and the optimizer state in host memory (pinned on CUDA) and run
    the step on the host; gradients go to the host as their buckets are reduced. Stages 1-3."""

    offload_params: bool = False
    """Stage 3: keep each rank's parameter shards in host memory; a unit's shard goes to the device
    only for its all-gather."""

    offload_dir: Optional[str] = None
    """With offload_optimizer: keep the optimizer state in files in this folder (an NVMe mount, say)
    instead of host memory, and step it in tiles of ``offload_tile_mb`` (ZeRO-Infinity)."""

    offload_tile_mb: float = 64.0
    """With offload_dir: MiB of fp32 master weights stepped per tile; host memory holds a few tiles."""

    offload_overlap: bool = False
    """With offload_optimizer at stage 2 or 3: start each segment's host update during backward, as soon
    as its reduced gradient reaches the host, and commit it at the step where it is the step's own
    (DeepSpeed's ``super_offload``). Equal results; costs host memory, a copy of the masters and of the
    state (see [Note: the overlapped host step] in engine/overlap.py). Off by default: it helps only
    where the device computes while the host is idle."""

    activation_checkpointing: tuple[Union[str, type], ...] = ()
    """Module classes (or class names) whose forward is recomputed in backward instead of keeping
    its activations (non-reentrant), e.g. ("Block",)."""

    activation_checkpointing_interval: int = 1
    """Checkpoint every n-th matching module (1: all of them)."""

    offload_activations: bool = False
    """Keep the activations saved for backward in host memory (pinned on CUDA) until backward."""

    check_unit_order: bool = True
    """Stage 3: every unit's all-gathers carry what each rank gathers them for, and every rank checks
    them before using the weights, raising naming what each rank was doing if they differ (see
    [Note: order guard] in engine/order_guard.py), at every pass."""

    unit_order_wait: float = 5.0
    """Stage 3, seconds: a rank that has waited this long for a unit's all-gather posts what it gathers
    on the process group's store and compares with the others' (ranks whose collectives differ in
    size or kind get no header to compare: see [Note: order guard]). Far below collective_timeout."""

    check_unit_order_every: Optional[int] = None
    """Deprecated, ignored (with a warning): the order guard used to check one pass in this many; it
    now checks every pass, at no extra collective (see [Note: the collective header])."""

    collective_timeout: Optional[float] = 600.0
    """Seconds a gloo collective of the engine may wait before the process ends, printing what it
    waited for (see [Note: hang watchdog] in engine/watchdog.py); None: wait for the process group's
    timeout. 10 minutes is a third of the process group's default of 30: a healthy collective never
    waits that long, while a rank held up by a slow checkpoint write or a long validation still has time."""

    cpu_mmap_threshold_mb: Optional[float] = 4.0
    """On CPU with glibc: blocks of this many MiB or more get pages of their own from malloc, given
    back to the system when freed, so that the memory a step frees leaves the process (see [Note:
    glibc's mmap threshold] in engine/malloc.py). Set for the whole process, for good, when the
    engine is set up, unless the process was started with ``MALLOC_MMAP_THRESHOLD_`` or a
    ``GLIBC_TUNABLES`` threshold (kept); from 0.125 (glibc's own starting value) to 32 (its limit).
    None sets nothing: glibc's heap then keeps freed blocks (unless set earlier in the process)."""

    quantized_weights: bool = False
    """Stage 3: all-gather parameters block-quantized to int8 (one fp32 scale per
    ``quantization_block_size`` elements; ZeRO++'s qwZ), in forward and backward: about a quarter of
    the bytes for fp32 weights, half for bf16/fp16. The forward and backward then compute with the
    dequantized weights (every rank the same ones); the optimizer still steps the exact shards, and
    checkpoints and ``gathered_parameters`` gather exactly."""

    quantized_gradients: Union[bool, str, None] = None
    """Reduce gradients as block-quantized chunks, "int8" or "int4" (True: "int8"; ZeRO++'s qgZ),
    dequantized and summed in fp32 on the receiving rank, so rounding errors do not add up along a
    ring (see [Note: quantized reduce-scatter] in engine/collectives.py). Stages 1-3."""

    quantization_block_size: int = 256
    """Elements per fp32 scale of quantized_weights and quantized_gradients: a smaller block follows
    the values more closely and sends more scales (4 bytes each: 1.6% more at 256 for int8)."""

    secondary_partition_size: Optional[int] = None
    """Stage 3, ZeRO++'s hpZ: after a unit's forward, keep a shard of it over groups of this many
    consecutive ranks (usually the devices per node), so its backward all-gather stays inside the
    node; the primary shards and the optimizer step stay over all ranks. Costs 1/K of each unit's
    bytes per rank between forward and backward (a quarter of that with quantized_weights). Must
    divide the ranks per node; None: off."""

    async_save: bool = False
    """Save sharded checkpoints in the background: the save returns once each rank has copied its
    pieces into host buffers (kept between saves: one rank's share of the checkpoint, pinned on CUDA),
    and a writer thread writes and commits the files while training goes on (see [Note: saving in the
    background] in checkpoint/background.py). A second save, and the end of training, wait for it."""

    def __post_init__(self) -> None:
        if type(self.stage) is not int or self.stage not in SUPPORTED_STAGES:
            raise ValueError(
                f"ZeRO stage={self.stage!r} is not supported; allowed stages are {SUPPORTED_STAGES}. "
                "Use stage=1 to shard optimizer state, stage=2 to also shard gradients, stage=3 to also shard "
                "parameters."
            )
        cap = self.bucket_cap_mb
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0:
            raise ValueError(
                f"bucket_cap_mb={cap!r} must be a positive, finite number of MiB (DDP's default is 25)."
            )

        _module_targets(self, "shard_modules")
        _module_targets(self, "activation_checkpointing")
        if self.unit_params is not None and (type(self.unit_params) is not int or self.unit_params < 1):
            raise ValueError(f"unit_params={self.unit_params!r} must be a positive integer (parameters per stage-3 "
                             "unit), or None to size units from the bucket and the model.")
        if type(self.param_persistence_threshold) is not int or self.param_persistence_threshold < 0:
            raise ValueError(f"param_persistence_threshold={self.param_persistence_threshold!r} must be a non-negative "
                             "integer (a number of parameters).")
        timeout = self.collective_timeout
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not math.isfinite(timeout) or timeout <= 0):
            raise ValueError(f"collective_timeout={timeout!r} must be a positive number of seconds, or None to wait "
                             "as long as the process group's timeout.")
        mmap = self.cpu_mmap_threshold_mb
        if mmap is not None and (isinstance(mmap, bool) or not isinstance(mmap, (int, float)) or not math.isfinite(mmap)
                                 or not MIN_MMAP_THRESHOLD_MB <= mmap <= MAX_MMAP_THRESHOLD_MB):
            raise ValueError(f"cpu_mmap_threshold_mb={mmap!r} must be a number of MiB from {MIN_MMAP_THRESHOLD_MB} "
                             f"(glibc's own starting value) to {MAX_MMAP_THRESHOLD_MB} (its limit; 4 is the default), "
                             "or None to leave glibc's own rule.")
        if not isinstance(self.check_unit_order, bool):
            raise ValueError(f"check_unit_order={self.check_unit_order!r} must be True or False.")
        wait = self.unit_order_wait
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 < wait < math.inf:
            raise ValueError(f"unit_order_wait={wait!r} must be a positive number of seconds (5 by default).")
        if self.collective_timeout is not None and isinstance(self.collective_timeout, (int, float)) \
                and wait >= self.collective_timeout:
            raise ValueError(f"unit_order_wait={wait!r} must be below collective_timeout={self.collective_timeout!r}: "
                             "the ranks compare what they gather before the watchdog ends the wait. Lower it.")
        every = self.check_unit_order_every
        if every is not None:
            if type(every) is not int or every < 1:
                raise ValueError(f"check_unit_order_every={every!r} must be a positive integer or None (it is "
                                 "deprecated and ignored: drop it).")
            warnings.warn(f"check_unit_order_every={every} is deprecated and ignored: the order guard checks every "
                          "pass now, at no extra collective (its tags ride in the all-gathers). Drop the setting "
                          "(check_unit_order=False turns the guard off).", FutureWarning, stacklevel=3)

        self._check_memory_options()
        self._check_communication_options()

    def _check_communication_options(self) -> None:
        if not isinstance(self.quantized_weights, bool):
            raise ValueError(f"quantized_weights={self.quantized_weights!r} must be True or False.")
        if self.quantized_weights and self.stage != 3:
            raise ValueError(f"quantized_weights=True quantizes stage 3's parameter all-gathers, and stage "
                             f"{self.stage} gathers no parameters (it keeps them whole on every rank). Use stage=3, "
                             "or quantized_gradients for the gradient reduction at stages 1-2.")
        grads = self.quantized_gradients
        allowed = (None, False, True, "int8", "int4")
        if not (grads is None or isinstance(grads, (bool, str))) or grads not in allowed:
            raise ValueError(f"quantized_gradients={grads!r} is not one of {allowed}: \"int8\" or \"int4\" (True means "
                             "\"int8\"), None or False for unquantized reductions.")
        object.__setattr__(self, "quantized_gradients", {True: "int8", False: None}.get(grads, grads))
        block = self.quantization_block_size
        if type(block) is not int or block < 2:
            raise ValueError(f"quantization_block_size={block!r} must be an integer of at least 2 (elements per "
                             "scale; 256 is the default).")
        size = self.secondary_partition_size
        if size is not None:
            if type(size) is not int or size < 2:
                hint = " (1 would mean no secondary partition: use None)" if size == 1 else ""
                raise ValueError(f"secondary_partition_size={size!r} must be an integer of at least 2{hint}: the "
                                 "ranks of a node that share a secondary shard, usually the devices per node.")
            if self.stage != 3:
                raise ValueError(f"secondary_partition_size={size} keeps a secondary shard of stage 3's gathered "
                                 f"parameters, and stage {self.stage} gathers none. Use stage=3, or drop it.")

    def _check_memory_options(self) -> None:
        for name in ("offload_optimizer", "offload_params", "offload_activations"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False.")
        if self.offload_params and self.stage != 3:
            raise ValueError(f"offload_params=True needs stage=3 (got stage={self.stage}): only stage 3 shards "
                             "parameters. Use stage=3, or offload_optimizer=True at stage 1 or 2.")
        if self.offload_dir is not None:
            if not isinstance(self.offload_dir, str) or not self.offload_dir:
                raise ValueError(f"offload_dir={self.offload_dir!r} must be a folder path (a string).")
            if not self.offload_optimizer:
                raise ValueError(f"offload_dir={self.offload_dir!r} keeps optimizer state on disk, which needs "
                                 "offload_optimizer=True; set it, or drop offload_dir.")
        if not isinstance(self.async_save, bool):
            raise ValueError(f"async_save={self.async_save!r} must be True (write checkpoints in the background) or "
                             "False (the default: save_checkpoint returns once the files are written).")
        if not isinstance(self.offload_overlap, bool):
            raise ValueError(f"offload_overlap={self.offload_overlap!r} must be True or False.")
        if self.offload_overlap:
            if not self.offload_optimizer or self.stage == 1:
                raise ValueError(
                    f"offload_overlap=True overlaps optimizer offload's host step with backward, which needs "
                    f"offload_optimizer=True at stage 2 or 3 (got offload_optimizer={self.offload_optimizer}, "
                    f"stage={self.stage}; stage 1 reduces gradients only at the step). Set those, or drop "
                    "offload_overlap.")
            if self.offload_dir is not None:
                raise ValueError(f"offload_overlap=True needs the optimizer state in host memory, and "
                                 f"offload_dir={self.offload_dir!r} keeps it on disk; drop one of them.")
        tile = self.offload_tile_mb
        if isinstance(tile, bool) or not isinstance(tile, (int, float)) or not math.isfinite(tile) or tile <= 0:
            raise ValueError(f"offload_tile_mb={tile!r} must be a positive, finite number of MiB.")
        interval = self.activation_checkpointing_interval
        if type(interval) is not int or interval < 1:
            raise ValueError(f"activation_checkpointing_interval={interval!r} must be a positive integer "
                             "(1 checkpoints every matching module, 2 every second one).")

    @property
    def master_dtype(self) -> Optional[torch.dtype]:
        """dtype of the optimizer's copy of low-precision parameters (None: no copy)."""
        return torch.float32 if self.master_weights else None

    @property
    def weight_quantization(self) -> Optional[QuantSpec]:
        """How stage 3's all-gathers quantize (None: they do not)."""
        from .engine.quantize import QuantSpec

        return QuantSpec(8, self.quantization_block_size) if self.quantized_weights else None

    @property
    def gradient_quantization(self) -> Optional[QuantSpec]:
        """How gradient reductions quantize (None: they do not)."""
        from .engine.quantize import QuantSpec

        grads = self.quantized_gradients
        return QuantSpec(8 if grads == "int8" else 4, self.quantization_block_size) if grads else None

    def bucket_numel(self, element_size: int) -> int:
        """Bucket capacity in elements of a dtype of ``element_size`` bytes (at least 1)."""
        return max(1, int(self.bucket_cap_mb * 2**20) // element_size)


def _module_targets(config: ZeroConfig, name: str) -> None:
    """A field naming module classes: a list or tuple of classes or class names, stored as a tuple."""
    value = getattr(config, name)
    if isinstance(value, (str, type)):
        example = value if isinstance(value, str) else value.__name__
        raise ValueError(f"{name}={value!r} must be a list of module classes or class names, not a single "
                         f"{'string' if isinstance(value, str) else 'class'}: write {name}=[{example!r}].")
    try:
        targets = tuple(value)
    except TypeError:
        raise ValueError(f"{name}={value!r} must be a list of module classes or class names, e.g. ['Block'].") from None
    bad = [t for t in targets if not isinstance(t, (str, type)) or t == ""]
    if bad:
        raise ValueError(f"{name} holds {bad!r}, which are not module classes or class names; e.g. ['Block'].")
    object.__setattr__(config, name, targets)
