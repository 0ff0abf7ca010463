"""Frozen, validated configuration of the ZeRO engine.

Validation lives here, away from any process group, so a bad value fails at construction with
a message that names the value, what is allowed, and what to do instead.

[Note: one source for each option]
Each option of the engine is written once, as a field of ZeroConfig made by ``option``: its name,
type and default, its doc (``field.metadata["doc"]``), its DeepSpeed config keys
(``metadata["deepspeed"]``, () for none) and whether the front ends take it as an argument
(``metadata["argument"]``). Every door follows from the fields:
- ZeroStrategy and ZeroFabricStrategy take every field whose ``argument`` is True, with its type and
  default, through a signature made from the fields ([Note: the front ends' signatures] in
  frontend/options.py), which help(), LightningCLI, Hydra and the docs read;
- zero-train's strategy presets build on ``zero_defaults``, a config node made from the fields
  (cli/configs.py), and list only what they change;
- the DeepSpeed mapping (deepspeed/config.py, deepspeed/keys.py) converts the keys declared here
  (bucket elements into MiB, offload devices into flags, ...); a test maps each key and checks that
  it reaches its options (one key may set several: bf16_optimizer_states), and that the mapping sets
  no option that declares no key;
- ``estimate_memory`` takes the options that change the bytes under their own names, and zero-estimate
  passes them from the configured strategy by those names (``memory.estimated_options``);
- the options page of the docs is generated from each field's ``metadata["doc"]``.
Adding an option is one ``option(...)`` here with its validation, and its tests; tests/test_options_source.py
then asks for an example config of a DeepSpeed key it declares, and checks every door.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

if TYPE_CHECKING:
    from .engine.comm.quantize import QuantSpec

SUPPORTED_STAGES = (1, 2, 3)
GRAD_ACCUM_DTYPES = ("fp32", "working")
"""What ``grad_accum_dtype`` takes: fp32, or the working weights' dtype (bf16/fp16/fp32)."""
REPLICA_ALL_REDUCE = ("boundary", "every_backward")
"""What ``replica_all_reduce`` takes (hybrid sharding: see [Note: hybrid sharding] in engine/comm/topology.py)."""

MIN_MMAP_THRESHOLD_MB, MAX_MMAP_THRESHOLD_MB = 0.125, 32
"""glibc's first mmap threshold and its largest on 64-bit systems (``DEFAULT_MMAP_THRESHOLD_MAX``):
see cpu_mmap_threshold_mb."""


def option(default: Any, *, deepspeed: Union[str, tuple[str, ...]], doc: str, argument: bool = True) -> Any:
    """A ZeroConfig field (see [Note: one source for each option]). ``deepspeed``: the DeepSpeed config
    keys, dotted ("zero_optimization.stage"), it is read from; () when DeepSpeed has none. ``argument``:
    False for a field the front ends set from elsewhere instead of taking it as an argument."""
    keys = (deepspeed,) if isinstance(deepspeed, str) else tuple(deepspeed)
    return field(default=default, metadata={"doc": inspect.cleandoc(doc), "deepspeed": keys, "argument": argument})


@dataclass(frozen=True)
class ZeroConfig:
    """What the engine shards and how it communicates."""

    stage: int = option(2, deepspeed="zero_optimization.stage", doc="""
        1: shard optimizer state (and fp32 master weights); gradients stay whole on every rank and
        are reduce-scattered once before the step. 2: also shard gradients; each bucket is
        reduce-scattered as soon as backward has produced it and only the owned slice is kept.""")

    bucket_cap_mb: float = option(25.0, deepspeed=("zero_optimization.reduce_bucket_size",
                                                   "zero_optimization.allgather_bucket_size"), doc="""
        Size of one communication bucket (a "segment" of a flat buffer), in MiB of the parameter
        dtype. 25 MiB is DDP's default: large enough to amortise a collective's latency, small
        enough that reduction of early buckets overlaps the rest of backward.""")

    shard_modules: Sequence[Union[str, type]] = option((), deepspeed=(), doc="""
        Stage 3: module classes (or class names) whose instances are each one unit, gathered with one
        all-gather around their forward and backward, e.g. ("Block",) for a transformer's layers.""")

    unit_params: Optional[int] = option(None, deepspeed=(), doc="""
        Stage 3 without shard_modules: the size units are cut to, in parameters (see [Note: default
        units] in engine/params/plan.py). None: one bucket, and at most an eighth of the model.""")

    leaf_modules: Sequence[Union[str, type]] = option((), deepspeed="zero_optimization.leaf_module.classes", doc="""
        Stage 3: module classes (or class names) whose instances are never split into several units:
        each one's whole subtree is gathered at its forward, so what it calls inside may differ between
        ranks (a mixture-of-experts layer running only the experts its tokens chose). Routed experts
        are found without it, and other data-dependent calls are learned in the first passes (see
        [Note: leaf modules] in engine/params/plan.py); DeepSpeed's ``set_z3_leaf_modules`` sets the same.""")

    param_persistence_threshold: int = option(
        100_000, deepspeed="zero_optimization.stage3_param_persistence_threshold", doc="""
        Stage 3: parameters with fewer elements stay whole on every rank (biases, norms): gathering
        them would cost more in latency than keeping them saves. DeepSpeed's default.""")

    prefetch: bool = option(True, deepspeed="zero_optimization.stage3_prefetch_bucket_size", doc="""
        Stage 3: start the next unit's all-gather when a unit starts (forward) or is reached (backward).""")

    master_weights: bool = option(True, deepspeed=(), argument=False, doc="""
        Low-precision (bf16/fp16) trainable parameters get an fp32 master copy of this rank's shard,
        which the optimizer updates ("bf16-mixed", "16-mixed"). False updates the low-precision
        parameters themselves ("bf16-true", "16-true"). fp32 parameters are their own master either way.
        ``master_weights_dtype="bf16"`` overrides it for bf16 weights: they are their own master, updated
        with stochastic rounding (``master_dtype`` then says None: no copy).""")

    allow_untested_optimizer: bool = option(False, deepspeed="zero_allow_untested_optimizer", doc="""
        Re-create optimizer classes this package has not verified to be elementwise. A wrong
        guess silently changes the update (the optimizer sees a flat shard, not the parameter's
        shape), so this is opt-in, as with DeepSpeed's ``zero_allow_untested_optimizer``.""")

    whole_parameter_step: bool = option(False, deepspeed=(), doc="""
        Step every parameter whole, each on one rank that keeps its state, for an optimizer whose update
        reads a whole parameter (its rows, columns or matrix). ``torch.optim.Muon`` and
        ``torch.optim.Adafactor``, and classes with ``zero_whole_parameters = True``, get it without
        this; see "Optimizers that read a whole parameter" in docs/trainer.md.""")

    offload_optimizer: bool = option(False, deepspeed="zero_optimization.offload_optimizer.device", doc="""
        Keep the fp32 master weights and the optimizer state in host memory (pinned on CUDA) and run
        the step on the host; gradients go to the host as their buckets are reduced. Stages 1-3.""")

    offload_params: bool = option(False, deepspeed="zero_optimization.offload_param.device", doc="""
        Stage 3: keep each rank's parameter shards in host memory; a unit's shard goes to the device
        only for its all-gather.""")

    offload_dir: Optional[str] = option(None, deepspeed="zero_optimization.offload_optimizer.nvme_path", doc="""
        With offload_optimizer: keep the optimizer state in files in this folder (an NVMe mount, say)
        instead of host memory, and step it in tiles of ``offload_tile_mb`` (ZeRO-Infinity).""")

    offload_tile_mb: float = option(64.0, deepspeed="zero_optimization.sub_group_size", doc="""
        With offload_dir: MiB of fp32 master weights stepped per tile; host memory holds a few tiles.""")

    offload_overlap: bool = option(False, deepspeed="zero_optimization.offload_optimizer.super_offload", doc="""
        With offload_optimizer at stage 2 or 3: start each segment's host update during backward, as soon
        as its reduced gradient reaches the host, and commit it at the step where it is the step's own
        (DeepSpeed's ``super_offload``). Equal results; costs host memory, a copy of the masters and of the
        state (see [Note: the overlapped host step] in engine/optim/step/overlap.py). Off by default: it helps only
        where the device computes while the host is idle.""")

    activation_checkpointing: Sequence[Union[str, type]] = option((), deepspeed=(), doc="""
        Module classes (or class names) whose forward is recomputed in backward instead of keeping
        its activations (non-reentrant), e.g. ("Block",).""")

    activation_checkpointing_interval: int = option(1, deepspeed=(), doc="""
        Checkpoint every n-th matching module (1: all of them).""")

    offload_activations: bool = option(False, deepspeed="activation_checkpointing.cpu_checkpointing", doc="""
        Keep the activations saved for backward in host memory (pinned on CUDA) until backward.""")

    check_unit_order: bool = option(True, deepspeed=(), doc="""
        Stage 3: every unit's all-gathers carry what each rank gathers them for, and every rank checks
        them before using the weights, raising naming what each rank was doing if they differ (see
        [Note: order guard] in engine/comm/order_guard.py), at every pass.""")

    unit_order_wait: float = option(5.0, deepspeed=(), doc="""
        Stage 3, seconds: a rank that has waited this long for a unit's all-gather posts what it gathers
        on the process group's store and compares with the others' (ranks whose collectives differ in
        size or kind get no header to compare: see [Note: order guard]). Far below collective_timeout.""")

    check_unit_order_every: Optional[int] = option(None, deepspeed=(), doc="""
        Deprecated, ignored (with a warning): the order guard used to check one pass in this many; it
        now checks every pass, at no extra collective (see [Note: the collective header]).""")

    collective_timeout: Optional[float] = option(600.0, deepspeed=(), doc="""
        Seconds a gloo collective of the engine may wait before the process ends, printing what it
        waited for (see [Note: hang watchdog] in engine/diagnose/watchdog.py); None: wait for the process group's
        timeout. 10 minutes is a third of the process group's default of 30: a healthy collective never
        waits that long, while a rank held up by a slow checkpoint write or a long validation still has time.""")

    cpu_mmap_threshold_mb: Optional[float] = option(4.0, deepspeed=(), doc="""
        On CPU with glibc: blocks of this many MiB or more get pages of their own from malloc, given
        back to the system when freed, so that the memory a step frees leaves the process (see [Note:
        glibc's mmap threshold] in engine/buffers/malloc.py). Set for the whole process, for good, when the
        engine is set up, unless the process was started with ``MALLOC_MMAP_THRESHOLD_`` or a
        ``GLIBC_TUNABLES`` threshold (kept); from 0.125 (glibc's own starting value) to 32 (its limit).
        None sets nothing: glibc's heap then keeps freed blocks (unless set earlier in the process).""")

    quantized_weights: bool = option(False, deepspeed="zero_optimization.zero_quantized_weights", doc="""
        Stage 3: all-gather parameters block-quantized to int8 (one fp32 scale per
        ``quantization_block_size`` elements; ZeRO++'s qwZ), in forward and backward: about a quarter of
        the bytes for fp32 weights, half for bf16/fp16. The forward and backward then compute with the
        dequantized weights (every rank the same ones); the optimizer still steps the exact shards, and
        checkpoints and ``gathered_parameters`` gather exactly.""")

    quantized_gradients: Union[bool, str, None] = option(
        None, deepspeed="zero_optimization.zero_quantized_gradients", doc="""
        Reduce gradients as block-quantized chunks, "int8" or "int4" (True: "int8"; ZeRO++'s qgZ),
        dequantized and summed in fp32 on the receiving rank, so rounding errors do not add up along a
        ring (see [Note: quantized reduce-scatter] in engine/comm/collectives.py). Stages 1-3.""")

    quantization_block_size: int = option(256, deepspeed=(), doc="""
        Elements per fp32 scale of quantized_weights and quantized_gradients: a smaller block follows
        the values more closely and sends more scales (4 bytes each: 1.6% more at 256 for int8).""")

    secondary_partition_size: Optional[int] = option(
        None, deepspeed="zero_optimization.zero_hpz_partition_size", doc="""
        Stage 3, ZeRO++'s hpZ: after a unit's forward, keep a shard of it over groups of this many
        consecutive ranks (usually the devices per node), so its backward all-gather stays inside the
        node; the primary shards and the optimizer step stay over all ranks. Costs 1/K of each unit's
        bytes per rank between forward and backward (a quarter of that with quantized_weights). Must
        divide the ranks per node; None: off.""")

    async_save: bool = option(False, deepspeed=(), doc="""
        Save sharded checkpoints in the background: the save returns once each rank has copied its
        pieces into host buffers (kept between saves: one rank's share of the checkpoint, pinned on CUDA),
        and a writer thread writes and commits the files while training goes on (see [Note: saving in the
        background] in checkpoint/background.py). A second save, and the end of training, wait for it.""")

    optimizer_state_dtype: str = option("fp32", deepspeed="bf16.bf16_optimizer_states", doc="""
        How the inner optimizer's elementwise state (Adam's moments, SGD's momentum, ...) is stored
        between steps: "fp32" (torch's own), "bf16" (rounded stochastically, or to nearest with
        ``stochastic_rounding=False``; any optimizer of ``ELEMENTWISE_OPTIMIZERS``) or "int8" (block-wise
        codes with one fp32 scale per ``optimizer_state_block_size`` elements, a signed dynamic map for
        first moments and momenta, an unsigned one for second moments: see [Note: int8 state] in
        engine/optim/lowp.py; Adam, AdamW and SGD only). The update itself is the user's optimizer's, in fp32,
        a tile at a time (see [Note: the low-precision step] in engine/optim/step/lowp.py). Parameters of fewer
        than ``optimizer_state_min_numel`` elements keep fp32 state. With ``offload_optimizer`` the state
        is stored encoded in host memory; ``offload_dir`` and ``offload_overlap`` are refused with it.""")

    master_weights_dtype: str = option("fp32", deepspeed="bf16.bf16_master_weights_and_grads", doc="""
        The dtype of the weights the optimizer updates. "fp32": as ``master_weights`` says (an fp32
        copy of bf16/fp16 weights with ``master_weights=True``, the weights themselves without). "bf16"
        (bf16 working weights only): the bf16 working weights are the master, at every stage (at stage 3
        the rank's shard: no second copy), and each update, computed in fp32, is rounded into them
        stochastically unless ``stochastic_rounding=False``; ``master_weights`` then makes no difference,
        and ``master_dtype`` is None (no copy).""")

    stochastic_rounding: bool = option(True, deepspeed=(), doc="""
        Round bf16 masters and bf16 optimizer state stochastically (unbiased: small updates add up on
        average; see [Note: stochastic rounding] in engine/optim/lowp.py); False: to nearest.""")

    stochastic_rounding_seed: int = option(0, deepspeed=(), doc="""
        Seed of the stochastic rounding's random bits, which hash (seed, step, parameter, element
        position): the same bits on any world size and stage.""")

    optimizer_state_block_size: int = option(256, deepspeed=(), doc="""
        With ``optimizer_state_dtype="int8"``: elements per fp32 scale. The flat layout then starts every
        parameter, and ends every shard, at a multiple of it (see [Note: blocks that survive a reshard]).""")

    optimizer_state_min_numel: int = option(4096, deepspeed="bf16.bf16_optimizer_states", doc="""
        Parameters with fewer elements keep fp32 optimizer state (biases, norms), as the published
        8-bit optimizers do: they cost little and are the most sensitive. DeepSpeed's
        ``bf16.bf16_optimizer_states`` keeps every parameter's state in bf16: it maps to 0.""")

    # ---- local accumulation (issue 32): see [Note: local accumulation] in engine/grads/accumulation.py
    local_accumulation: bool = option(False, deepspeed="zero_optimization.local_accumulation", doc="""
        Stages 2-3: micro-batches before an accumulation boundary (inside Lightning's accumulation,
        ``fabric.no_backward_sync``, or before ``initialize``'s boundary) add their gradients into a
        full-size local buffer per rank instead of reduce-scattering them; the boundary's backward
        reduce-scatters the sum once. One reduction per optimizer step instead of one per micro-batch,
        at the cost of an unsharded gradient buffer (4 bytes per parameter in fp32). Off by default.
        Stage 1 always accumulates locally (its gradients are whole until the step): refused there.""")

    grad_accum_dtype: str = option("fp32", deepspeed="data_types.grad_accum_dtype", doc="""
        With local_accumulation: the dtype of the local buffer, "fp32" (the default: no rounding
        over the micro-batches) or "working" (the parameters' dtype: half the bytes for bf16/fp16).
        Without local_accumulation gradients accumulate in their reduced shard, in the working dtype,
        whatever this says. DeepSpeed's ``data_types.grad_accum_dtype`` maps onto it.""")

    # ---- gradients reduced in fewer bits (issue 50): see [Note: low-precision reductions] in engine/grads/reducer.py
    low_precision_reduce_modules: Sequence[Union[str, type]] = option(
        (), deepspeed="torch_autocast.lower_precision_safe_modules", argument=False, doc="""
        The module classes whose own fp32 parameters' gradients are reduced in ``low_precision_reduce_dtype``:
        each rank's gradient, divided by the ranks, rounded to it; the sum over the ranks rounded to it again,
        then added to the fp32 gradient shard the optimizer reads. Half the bytes of an fp32 reduction for
        those gradients. A class matches exactly (not its subclasses), a name the class of that name, as
        DeepSpeed matches them. Set by ``initialize`` from DeepSpeed's ``torch_autocast`` section (its
        ``lower_precision_safe_modules``, or DeepSpeed's default when absent: Linear and Conv1d/2d/3d), with
        the autocast dtype; () reduces every gradient in its parameter's dtype.""")

    low_precision_reduce_dtype: Optional[torch.dtype] = option(None, deepspeed=(), argument=False, doc="""
        The dtype of ``low_precision_reduce_modules``' reductions: torch.bfloat16 or torch.float16, the
        forward's autocast dtype (the front end sets it from the precision, as it sets master_weights).
        None: no gradient is reduced in another dtype than its parameter's.""")

    # ---- hybrid sharding (issue 32): see [Note: hybrid sharding] in engine/comm/topology.py
    shard_group_size: Union[int, str, None] = option(None, deepspeed="zero_optimization.mics_shard_size", doc="""
        HSDP (DeepSpeed's MiCS): shard over groups of this many consecutive ranks and replicate over
        the world size / K groups, an int K dividing the world size or "node" (the ranks of one node).
        Gradients are reduce-scattered within the group, then their shards all-reduced across the
        groups; parameters are all-gathered within the group only. Memory per rank follows the ZeRO
        formula with K in place of the world size. None (the default): shard over all ranks.""")

    replica_all_reduce: str = option("boundary", deepspeed=(), doc="""
        With shard_group_size at stages 2-3 and gradient accumulation: when the gradient shards are
        all-reduced across the shard groups. "boundary" (the default, as MiCS): once per optimizer step,
        the micro-batches before it summed within the group into the shard (no extra memory; only the
        order of additions differs); "every_backward": after each micro-batch's reduce-scatter, as
        without accumulation. See [Note: hybrid sharding] in engine/comm/topology.py.""")

    # ---- kept in step as under DDP (issue 50): see [Note: buffers kept in step] in engine/params/buffer_sync.py
    broadcast_buffers: bool = option(True, deepspeed=(), doc="""
        Before a forward of the module, as DDP's default does: rank 0's buffers (BatchNorm's running
        statistics, any ``register_buffer``) go to every rank in one broadcast, when the previous
        forward ran with grad enabled and outside ``no_sync`` (``block_backward_sync``,
        ``fabric.no_backward_sync``), or none ran yet: once per training step, none between evaluation
        forwards. At every stage (stage 3's buffers are whole on every rank). False keeps each rank's
        own buffers after setup (which starts every rank from rank 0's), as DDP's
        ``broadcast_buffers=False`` (torch 2.13: ``forward_sync_buffers=False``). The Trainer counts one
        forward per ``training_step`` and ``validation_step`` while fitting, as Lightning's DDP wraps
        them; ``initialize`` never broadcasts (DeepSpeed's engine does not).""")

    # ---- where the step's time goes (issue 53): see [Note: the step breakdown] in engine/diagnose/breakdown.py
    step_breakdown: bool = option(True, deepspeed=(), doc="""
        Time every training step's parts: forward and backward computation, the communication waited for
        and not hidden (stage 3's gathers, the gradient reductions, the step's all-gather, the rest), the
        optimizer step, offload copies and what happens outside them; count the model's FLOPs once (on the
        first step) for tokens and samples per second and MFU. The front ends log the figures and print a
        table at the end of training (see "Where the step's time goes" in docs/trainer.md). It costs two
        clock reads per collective waited for (on CUDA, events: no synchronization); False: none.""")

    peak_flops: Optional[float] = option(None, deepspeed=(), doc="""
        The peak FLOP/s of one device, for MFU (model FLOPs utilisation: the FLOPs counted per second
        over this peak), e.g. 989e12 for an H100 SXM in bf16. None: the dense tensor-core peak of the
        working dtype for the GPUs the package knows (A100, H100, H200, L4, L40S, A10, V100, T4), else
        no MFU (a CPU, another GPU).""")

    def _check_shard_group_size(self) -> None:
        size = self.shard_group_size
        if size not in (None, "node") and (type(size) is not int or size < 1):
            raise ValueError(f"shard_group_size={size!r} must be a positive integer dividing the world size, \"node\" "
                             "(the ranks of one node), or None to shard over all ranks.")
        if size is not None and self.secondary_partition_size is not None:
            raise ValueError(f"shard_group_size={size!r} with secondary_partition_size="
                             f"{self.secondary_partition_size}: hpZ keeps a secondary shard so that backward gathers "
                             "stay inside a node, which shard groups within a node already do, and a secondary "
                             "partition inside a shard group is not built. Drop secondary_partition_size, or "
                             "shard_group_size.")
        if self.replica_all_reduce not in REPLICA_ALL_REDUCE:
            raise ValueError(f"replica_all_reduce={self.replica_all_reduce!r} is not one of {REPLICA_ALL_REDUCE}: "
                             "\"boundary\" all-reduces the gradient shards across the shard groups once per "
                             "optimizer step, \"every_backward\" after each backward.")

    def _check_local_accumulation(self) -> None:
        if not isinstance(self.local_accumulation, bool):
            raise ValueError(f"local_accumulation={self.local_accumulation!r} must be True or False.")
        if self.grad_accum_dtype not in GRAD_ACCUM_DTYPES:
            raise ValueError(f"grad_accum_dtype={self.grad_accum_dtype!r} is not one of {GRAD_ACCUM_DTYPES}: \"fp32\" "
                             "accumulates the local gradients in fp32 (the default), \"working\" in the parameters' "
                             "own dtype (bf16/fp16 halve the buffer).")
        if self.local_accumulation and self.stage == 1:
            raise ValueError("local_accumulation=True at stage 1: stage 1 keeps whole gradients until the step and "
                             "reduces them once per optimizer step already (in the working dtype), so there is "
                             "nothing to defer. Drop local_accumulation, or use stage=2 or 3.")

    def _check_low_precision_reduce(self) -> None:
        _module_targets(self, "low_precision_reduce_modules")
        dtype = self.low_precision_reduce_dtype
        if dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"low_precision_reduce_dtype={dtype!r} must be torch.bfloat16, torch.float16 or None (the "
                             "forward's autocast dtype, which the front end sets).")

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

        for name in ("allow_untested_optimizer", "whole_parameter_step"):  # how the optimizer is stepped
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False.")
        _module_targets(self, "shard_modules")
        _module_targets(self, "leaf_modules")
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
        if not isinstance(self.step_breakdown, bool):
            raise ValueError(f"step_breakdown={self.step_breakdown!r} must be True (time each step's parts, the "
                             "default) or False (measure nothing).")
        peak = self.peak_flops
        if peak is not None and (isinstance(peak, bool) or not isinstance(peak, (int, float)) or not math.isfinite(peak)
                                 or peak <= 0):
            raise ValueError(f"peak_flops={peak!r} must be a positive number of FLOP/s per device (e.g. 312e12 for "
                             "an A100 in bf16), or None to look the device up.")
        if not isinstance(self.broadcast_buffers, bool):
            raise ValueError(f"broadcast_buffers={self.broadcast_buffers!r} must be True (rank 0's buffers go to every "
                             "rank before a forward, as DDP's default) or False (each rank keeps its own).")
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
        self._check_low_precision_options()
        self._check_local_accumulation()
        self._check_low_precision_reduce()
        self._check_shard_group_size()

    def _check_low_precision_options(self) -> None:
        states = ("fp32", "bf16", "int8")
        if self.optimizer_state_dtype not in states:
            raise ValueError(f"optimizer_state_dtype={self.optimizer_state_dtype!r} is not one of {states}: \"fp32\" "
                             "keeps torch's state, \"bf16\" halves it, \"int8\" stores block-wise codes (Adam, AdamW, "
                             "SGD).")
        if self.master_weights_dtype not in ("fp32", "bf16"):
            raise ValueError(f"master_weights_dtype={self.master_weights_dtype!r} is not one of ('fp32', 'bf16'): "
                             "\"bf16\" makes bf16 working weights their own master, updated with stochastic rounding.")
        if not isinstance(self.stochastic_rounding, bool):
            raise ValueError(f"stochastic_rounding={self.stochastic_rounding!r} must be True or False.")
        if type(self.stochastic_rounding_seed) is not int:
            raise ValueError(f"stochastic_rounding_seed={self.stochastic_rounding_seed!r} must be an integer.")
        block = self.optimizer_state_block_size
        if type(block) is not int or block < 8 or block & (block - 1):
            raise ValueError(f"optimizer_state_block_size={block!r} must be a power of two of at least 8 (elements "
                             "per int8 scale; 256 is the default).")
        least = self.optimizer_state_min_numel
        if type(least) is not int or least < 0:
            raise ValueError(f"optimizer_state_min_numel={least!r} must be a non-negative integer (parameters with "
                             "fewer elements keep fp32 state; 0: none do).")
        if self.low_precision_step and (self.offload_dir is not None or self.offload_overlap):
            what = f"offload_dir={self.offload_dir!r}" if self.offload_dir is not None else "offload_overlap=True"
            raise ValueError(f"optimizer_state_dtype={self.optimizer_state_dtype!r} / master_weights_dtype="
                             f"{self.master_weights_dtype!r} with {what}: the disk and overlapped host steps keep "
                             "fp32 state. Offload to host memory only (offload_optimizer=True, which stores the "
                             "state encoded there), or keep both at \"fp32\".")
        if self.master_weights_dtype == "bf16" and self.offload_optimizer:
            raise ValueError("master_weights_dtype='bf16' with offload_optimizer=True: bf16 masters are the device's "
                             "working weights, so nothing of them can move to the host. Keep fp32 masters to offload "
                             "them (optimizer_state_dtype='int8' or 'bf16' still stores the state encoded on the "
                             "host), or drop offload_optimizer.")

    @property
    def low_precision_step(self) -> bool:
        """Whether the step stores state or masters in fewer bits (see engine/optim/step/lowp.py)."""
        return self.optimizer_state_dtype != "fp32" or self.master_weights_dtype != "fp32"

    @property
    def layout_block(self) -> int:
        """Elements every parameter start and shard end of a flat layout is a multiple of (beyond the
        vector alignment): the int8 state's block, so that no block straddles a shard."""
        return self.optimizer_state_block_size if self.optimizer_state_dtype == "int8" else 1

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
        """dtype of the optimizer's copy of low-precision parameters (None: no copy). fp32 with
        ``master_weights`` and ``master_weights_dtype="fp32"``; None with ``master_weights_dtype="bf16"``,
        where the bf16 working weights are their own master."""
        return torch.float32 if self.master_weights and self.master_weights_dtype == "fp32" else None

    @property
    def weight_quantization(self) -> Optional[QuantSpec]:
        """How stage 3's all-gathers quantize (None: they do not)."""
        from .engine.comm.quantize import QuantSpec

        return QuantSpec(8, self.quantization_block_size) if self.quantized_weights else None

    @property
    def gradient_quantization(self) -> Optional[QuantSpec]:
        """How gradient reductions quantize (None: they do not)."""
        from .engine.comm.quantize import QuantSpec

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
