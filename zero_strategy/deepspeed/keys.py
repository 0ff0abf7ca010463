"""What each key of a DeepSpeed config means here, and how its values are read.

The tables of [Note: every key accounted for] (in config.py): ``MAPPED`` lists the keys the
mapping reads, per section; ``RULES`` says, for every other key DeepSpeed knows, whether it is
harmless here (with the reason, for the log line) or refused (with what to use instead). The value
readers check a value as it is read and raise ``DeepSpeedConfigError`` naming the key and what it
must be. ``load_deepspeed_config`` reads the dict or JSON file the user gives.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Union

__all__ = ["AUTO_HINT", "AUTO_OK", "DeepSpeedConfigError", "Findings", "MAPPED", "RULES", "Rule", "ZERO_ALIASES",
           "is_auto", "load_deepspeed_config", "read_accumulation", "read_flag", "read_integer", "read_number",
           "read_section", "read_zero_plus_plus", "typo_hint"]


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config this package cannot honour as written; the message says what to change."""


@dataclass
class Findings:
    """What one reading of a config found, besides the settings: refusals (raised together at the
    end), keys accepted with no effect (with the reason) and notes on how mapped keys were read."""

    problems: list[str] = field(default_factory=list)
    ignored: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


# ---- loading ------------------------------------------------------------------------------------


def load_deepspeed_config(config: Union[dict, str, os.PathLike]) -> dict:
    """The config as a dict: a copy of ``config`` when it is one, else the JSON file at that path.

    A missing file, a folder, invalid JSON (with its line and column), a repeated key, or a JSON
    value that is not an object is an error saying what to pass instead.
    """
    if isinstance(config, Mapping):
        def path_or_refuse(value: Any) -> str:
            if isinstance(value, os.PathLike):
                return os.fspath(value)
            raise DeepSpeedConfigError(f"the config holds {value!r} ({type(value).__name__}), which is not JSON "
                                       "data; give numbers, strings, booleans, lists and dicts, as a JSON file would.")

        return json.loads(json.dumps(config, default=path_or_refuse))  # a deep copy, of plain JSON data
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"config={config!r} ({type(config).__name__}) is neither a dict nor a path; pass a DeepSpeed "
                        "config as a dict or as the path of its JSON file.")
    path = Path(config)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        looks_like_json = str(config).lstrip().startswith("{")
        hint = " (it looks like JSON text: pass json.loads(text) instead)" if looks_like_json else ""
        raise FileNotFoundError(f"DeepSpeed config {str(config)!r} {what}{hint}; pass the path of a JSON file, "
                                "e.g. ds_config.json, or the config as a dict.")

    def no_repeats(pairs: list[tuple[str, Any]]) -> dict:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:  # json keeps the last one silently; DeepSpeed refuses, and so do we
                raise DeepSpeedConfigError(f"{path}: key {key!r} appears twice in one object; keep one.")
            seen[key] = value
        return seen

    try:
        loaded = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=no_repeats)
    except json.JSONDecodeError as error:
        where = f"line {error.lineno}, column {error.colno}"
        raise DeepSpeedConfigError(f"{path} is not valid JSON: {error.msg} at {where}. Fix the file (JSON has no "
                                   "comments and no trailing commas).") from None
    if not isinstance(loaded, dict):
        raise DeepSpeedConfigError(f"{path} holds a JSON {type(loaded).__name__}, not an object; a DeepSpeed config is "
                                   'an object such as {"train_batch_size": 8, "zero_optimization": {"stage": 2}}.')
    return loaded


# ---- what each key means here -------------------------------------------------------------------


class Rule(NamedTuple):
    accepts: Callable[[Any], bool]  # True: harmless here, with ``reason``; False: refused, with ``instead``
    reason: str = ""
    instead: str = ""


def _harmless(reason: str) -> Rule:
    return Rule(lambda value: True, reason=reason)


def _refused(instead: str) -> Rule:
    return Rule(lambda value: False, instead=instead)


def _only(allowed: Any, reason: str, instead: str) -> Rule:
    return Rule(lambda value: value == allowed, reason, instead)


_disabled = Rule(lambda v: isinstance(v, Mapping) and v.get("enabled") is False, "disabled",
                  "not supported by this package; remove the section or set \"enabled\": false")
_LOGGING = "logging is Lightning's job: pass Trainer(logger=...)"
_SPEED = "changes how DeepSpeed schedules its work, not the result"
_REMOVED = "removed from DeepSpeed too; remove the key"

MAPPED: dict[str, frozenset] = {  # keys read by the code below, per section ("" is the top level)
    "": frozenset({"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                   "gradient_clipping", "fp16", "bf16", "optimizer", "scheduler", "zero_optimization",
                   "activation_checkpointing", "zero_allow_untested_optimizer", "dataloader_drop_last",
                   "data_types", "torch_autocast"}),
    "torch_autocast": frozenset({"enabled", "dtype", "lower_precision_safe_modules"}),
    "fp16": frozenset({"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                       "min_loss_scale"}),
    "bf16": frozenset({"enabled", "bf16_master_weights_and_grads", "bf16_optimizer_states"}),
    "optimizer": frozenset({"type", "params"}),
    "scheduler": frozenset({"type", "params"}),
    "zero_optimization": frozenset({"stage", "offload_optimizer", "offload_param", "reduce_bucket_size",
                                    "allgather_bucket_size", "stage3_param_persistence_threshold",
                                    "stage3_prefetch_bucket_size", "sub_group_size", "zero_quantized_weights",
                                    "zero_hpz_partition_size", "zero_quantized_gradients",
                                    "local_accumulation",  # this package's own: see read_accumulation
                                    "mics_shard_size",  # MiCS: see read_zero_plus_plus
                                    "leaf_module"}),
    "zero_optimization.leaf_module": frozenset({"classes"}),
    "zero_optimization.offload_optimizer": frozenset({"device", "nvme_path", "pin_memory", "super_offload"}),
    "zero_optimization.offload_param": frozenset({"device", "nvme_path", "pin_memory"}),
    "activation_checkpointing": frozenset({"cpu_checkpointing"}),
    "data_types": frozenset({"grad_accum_dtype"}),
}

RULES: dict[str, Rule] = {
    # top level: reporting and DeepSpeed internals
    # the three reports: printed by initialize's engine (see [Note: DeepSpeed's reports] in reporting.py)
    "steps_per_print": _harmless("progress is reported by Lightning's progress bar and loggers"),
    "wall_clock_breakdown": _harmless("the step breakdown is logged through Lightning's loggers (step_breakdown)"),
    "memory_breakdown": _harmless("memory report; use strategy.memory_stats()"),
    "dump_state": _harmless("a debug print of DeepSpeed's engine"),
    "flops_profiler": _harmless("FLOPs, throughput and MFU are logged with the step breakdown (step_breakdown)"),
    "comms_logger": _harmless("communication logging of DeepSpeed's own collectives"),
    "tensorboard": _harmless(_LOGGING), "wandb": _harmless(_LOGGING), "csv_monitor": _harmless(_LOGGING),
    "comet": _harmless(_LOGGING), "timers": _harmless("DeepSpeed's internal timers"),
    "log_level": _harmless("DeepSpeed's own logger"), "disable_python_gc": _harmless(_SPEED),
    "vocabulary_size": _harmless("only a tensor-core alignment warning in DeepSpeed"),
    "cuda_visible_devices": _harmless("not read by DeepSpeed 0.19 (devices are the launcher's: --include, "
                                      "CUDA_VISIBLE_DEVICES)"),  # in DeepSpeedExamples' imagenet configs
    "disable_allgather": _harmless("has no effect in DeepSpeed 0.19"),
    "aio": _harmless("DeepSpeed's asynchronous NVMe I/O tuning; offloaded tiles are ordinary files here"),
    "checkpoint": _harmless("DeepSpeed's checkpoint writing options; checkpoints here validate every file and "
                            "reshard across world sizes without a conversion"),
    "datastates": _harmless("an asynchronous checkpoint engine for DeepSpeed's format"),
    "compile": _harmless("compiling is your choice: apply torch.compile to your model"),
    "zero_force_ds_cpu_optimizer": _harmless("with offload the step runs in torch's fused CPU optimizer here"),
    "use_data_before_expert_parallelism": _harmless("only orders mixture-of-experts process groups"),
    "prescale_gradients": _only(False, "false is what this package does", "the gradient mean is taken in the "
                                "reduction itself here (the same average); set it false"),
    "gradient_predivide_factor": _only(1.0, "1.0 is what this package does", "gradients are summed, then divided "
                                       "once by the world size here; set it to 1.0"),
    "gradient_allreduce_op": _only("mean", "gradients are averaged over ranks here", "gradients are averaged over "
                                   "ranks here (DeepSpeed's \"mean\"); remove the key"),
    "communication_data_type": _only(None, "null: the default", "gradients are reduced in the parameters' "
                                     "working dtype here; remove the key"),
    "seq_parallel_communication_data_type": _only("fp32", "its default; only sequence parallelism reads it",
                                                  "only sequence parallelism reads it, which is not supported; "
                                                  "remove the key"),
    "sequence_parallel_size": _only(1, "1: no sequence parallelism", "sequence parallelism (Ulysses) is not "
                                    "supported; this package is data parallel only: set it to 1"),
    "managed_gradient_accumulation": _only(True, "accumulation boundaries are the strategy's, as DeepSpeed's "
                                           "default", "the strategy owns accumulation boundaries "
                                           "(Trainer(accumulate_grad_batches=...)); remove the key"),
    "data_types.param_dtype": _only(None, "null: the default", "the working dtype comes from fp16/bf16 or "
                                    "Trainer(precision=...); remove the key"),
    "data_types.buffer_dtype": _only(None, "null: the default", "buffers take the working dtype here; remove it"),
    "data_types.keep_in_fp32_modules": _only("auto", "the default", "not supported: with bf16/fp16 every floating-"
                                             "point parameter and buffer takes the working dtype; remove it"),
    "autotuning": _disabled, "hybrid_engine": _disabled, "data_efficiency": _disabled, "elasticity": Rule(
        _disabled.accepts, "disabled", "elastic batch sizes are not supported: set train_batch_size, "
        "train_micro_batch_size_per_gpu and gradient_accumulation_steps directly"),
    "amp": _refused("NVIDIA Apex AMP (removed from DeepSpeed too): use \"fp16\": {\"enabled\": true} or "
                    "Trainer(precision=\"16-mixed\")"),
    "sparse_attention": _refused("DeepSpeed's sparse attention kernels (" + _REMOVED + "); use your model's own "
                                 "attention, e.g. torch.nn.functional.scaled_dot_product_attention"),
    "pipeline": _refused("pipeline parallelism is not supported: this package is data parallel (ZeRO) only"),
    "tensor_parallel": _refused("tensor parallelism (AutoTP) is not supported: this package is data parallel only"),
    "expert_parallel": _refused("expert parallelism is not supported; without it experts train as ordinary "
                                "data-parallel parameters"),
    "moe": _refused("mixture-of-experts parallelism is not supported; without it experts train as ordinary "
                    "data-parallel parameters"),
    "compression_training": _refused("quantization- and pruning-aware training: " + _REMOVED),
    "curriculum_learning": _refused("schedule sequence lengths in your DataModule; remove the key"),
    "weight_quantization": _refused("quantized weights are not supported; remove the key"),
    **{key: _refused(_REMOVED) for key in (
        "nebula", "quantize_training", "sparse_gradients", "eigenvalue", "graph_harvesting", "progressive_layer_drop")},
    # precision
    "fp16.auto_cast": _harmless("floating-point inputs are cast to the weights' dtype here anyway"),
    "fp16.consecutive_hysteresis": _only(False, "false: the default", "the loss scaler here refills its "
                                         "hysteresis only when the scale grows (DeepSpeed's default); remove it"),
    "fp16.fp16_master_weights_and_grads": _only(False, "false: the default", "for fp16 weights without an "
                                                "fp32 master use Trainer(precision=\"16-true\"); remove the key"),
    "bf16.immediate_grad_update": _only(False, "false: the default", "gradients move into the fp32 master at the "
                                        "step here, not at every backward; remove the key"),
    "bf16.check_grad_overflow": _harmless("bf16 has fp32's range; overflow is checked for fp16 only here"),
    "bf16.check_overflow": _harmless("bf16 has fp32's range; overflow is checked for fp16 only here"),
    "optimizer.legacy_fusion": _harmless("a switch of DeepSpeed's fused fp16 optimizer"),
    # ZeRO
    "zero_optimization.overlap_comm": _harmless("reductions always overlap backward here"),
    "zero_optimization.contiguous_gradients": _harmless("gradients always live in contiguous flat buffers here"),
    "zero_optimization.reduce_scatter": _harmless(_SPEED),
    "zero_optimization.allgather_partitions": _harmless(_SPEED),
    "zero_optimization.use_multi_rank_bucket_allreduce": _harmless(_SPEED),
    "zero_optimization.round_robin_gradients": _harmless("spreads offload copies over ranks; " + _SPEED),
    "zero_optimization.stage3_max_live_parameters": _harmless("stage 3 holds at most the unit in use, the next "
                                                              "(prefetched) one and the root unit here"),
    "zero_optimization.stage3_max_reuse_distance": _harmless("a unit is released after its forward and gathered "
                                                             "again for backward here"),
    "zero_optimization.stage3_model_persistence_threshold": _harmless("an upper bound on unsharded small "
                                                                      "parameters; see param_persistence_threshold"),
    "zero_optimization.stage3_module_granularity_threshold": _harmless("units are whole modules here"),
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": _harmless(_SPEED),
    "zero_optimization.stage3_allgather_sequential": _harmless(_SPEED),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": _harmless(
        "for DeepSpeed's save_16bit_model; checkpoints here consolidate with zero-consolidate"),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": _harmless(
        "for DeepSpeed's save_16bit_model; checkpoints here consolidate with zero-consolidate"),
    "zero_optimization.leaf_module.names": _only([], "none given", "name the leaves' classes in "
                                                 "leaf_module.classes (leaf_modules) instead of their module names"),
    "zero_optimization.leaf_module.name_suffixes": _only([], "none given", "name the leaves' classes in "
                                                         "leaf_module.classes (leaf_modules) instead"),
    "zero_optimization.elastic_checkpoint": _harmless("checkpoints here reshard to any world size"),
    "zero_optimization.ignore_unused_parameters": _harmless("unused parameters are handled at every stage here"),
    **{f"zero_optimization.{key}": _harmless("an implementation switch of DeepSpeed's; " + _SPEED) for key in (
        "legacy_stage1", "parameter_alignment", "compute_grad_norm", "memory_efficient_linear",
        "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings", "enable_sanity_checks",
        "save_muon_momentum_buffer_in_memory")},
    "zero_optimization.load_from_fp32_weights": _only(True, "the fp32 master is always restored here",
                                                      "checkpoints here always restore the fp32 master; remove it"),
    "zero_optimization.zero_quantized_nontrainable_weights": _only(False, "false: the default", "frozen weights "
                                                                   "are gathered unquantized here (quantized_weights "
                                                                   "covers all of them when set), and DeepSpeed "
                                                                   "quantizes them with a CUDA kernel only "
                                                                   "(CUDAQuantizer); set it false"),
    "zero_optimization.zenflow": _refused("ZenFlow's stale-gradient updates are not supported; remove it"),
    **{f"zero_optimization.{key}": _refused(_REMOVED) for key in (
        "zeropp_loco_param",)},
    "zero_optimization.mics_hierarchical_params_gather": _harmless(
        "with mics_shard_size, parameters are all-gathered within the shard group here, inside a node when it "
        "is one"),
    **{f"zero_optimization.offload_optimizer.{key}": _harmless("NVMe/CPU offload tuning of DeepSpeed's; " + _SPEED)
       for key in ("buffer_count", "pipeline_read", "pipeline_write", "fast_init", "cpuadam_cores_perc")},
    "zero_optimization.offload_optimizer.ratio": _only(1.0, "1.0: all of it", "partial offload is not supported: "
                                                       "all of the optimizer is offloaded or none; set 1.0"),
    **{f"zero_optimization.offload_param.{key}": _harmless("NVMe offload tuning of DeepSpeed's; " + _SPEED)
       for key in ("buffer_count", "buffer_size", "max_in_cpu")},
    # activation checkpointing: these configure deepspeed.checkpointing.checkpoint() calls in model code
    "activation_checkpointing.partition_activations": _harmless(
        "splits checkpointed activations over model-parallel ranks, of which data parallelism has one"),
    **{f"activation_checkpointing.{key}": _harmless("a buffer or timing option of deepspeed.checkpointing; pick "
                                                    "modules with ZeroStrategy(activation_checkpointing=...)")
       for key in ("contiguous_memory_optimization", "number_checkpoints", "synchronize_checkpoint_boundary",
                   "profile")},
}

ZERO_ALIASES = {name: f"stage3_{name}" for name in (  # DeepSpeed accepts each stage3_ key without the prefix
    "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold", "max_live_parameters",
    "max_reuse_distance", "gather_16bit_weights_on_model_save", "module_granularity_threshold",
    "use_all_reduce_for_fetch_params", "allgather_sequential")}
AUTO_OK = frozenset({"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                      "gradient_clipping", "fp16.enabled", "bf16.enabled", "zero_optimization.reduce_bucket_size",
                      "zero_optimization.allgather_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                      "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.sub_group_size"})
AUTO_HINT = "'auto' is filled in by Hugging Face's Trainer; give a value"


# ---- reading values -----------------------------------------------------------------------------


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


def read_integer(value: Any, path: str, minimum: int = 0) -> int:
    """An int, or a float with an integral value (JSON's ``5e8``), of at least ``minimum``."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if type(value) is not int or value < minimum:
        raise DeepSpeedConfigError(f"{path}={value!r} must be an integer of at least {minimum}.")
    return value


def read_number(value: Any, path: str, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
        raise DeepSpeedConfigError(f"{path}={value!r} must be a finite number of at least {minimum}.")
    return float(value)


def read_flag(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise DeepSpeedConfigError(f"{path}={value!r} must be true or false.")
    return value


def read_section(value: Any, path: str) -> dict:
    if not isinstance(value, Mapping):
        raise DeepSpeedConfigError(f"{path} must be an object ({{...}}), not {value!r}.")
    return dict(value)


def typo_hint(key: str, prefix: str) -> str:
    """' (did you mean ...?)' for a typo: a close key in the same section, or the same key elsewhere."""
    here = set(MAPPED.get(prefix, ()))
    here |= {path.rpartition(".")[2] for path in RULES if path.rpartition(".")[0] == prefix}
    close = difflib.get_close_matches(key, sorted(here), n=1, cutoff=0.6)
    if close:
        return f" (did you mean {'.'.join(filter(None, (prefix, close[0])))!r}?)"
    elsewhere = sorted({f"{section}.{key}".lstrip(".") for section, keys in MAPPED.items() if key in keys} |
                       {path for path in RULES if path.rpartition(".")[2] == key})
    if key in ("adam_w_mode", "torch_adam") and prefix == "optimizer":
        elsewhere = ["optimizer.params." + key]
    return f" (it belongs at {elsewhere[0]!r})" if elsewhere else ""


# ---- local accumulation ---------------------------------------------------------------------------

_ACCUM_DTYPES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16",
                 "float16": "fp16", "half": "fp16"}


def read_accumulation(config: Mapping, zero: Mapping, precision: Any, findings: Findings) -> dict[str, Any]:
    """ZeroConfig settings from ``zero_optimization.local_accumulation`` (this package's key, not
    DeepSpeed's: stages 2-3 reduce once per optimizer step, see [Note: local accumulation] in
    engine/grads/accumulation.py) and ``data_types.grad_accum_dtype`` (the local buffer's dtype:
    "fp32", or the fp16/bf16 the config trains in, read as "working")."""
    kwargs: dict[str, Any] = {}
    local = read_flag(zero.get("local_accumulation", False), "zero_optimization.local_accumulation")
    if local:
        kwargs["local_accumulation"] = True
    types_section = read_section(config.get("data_types") or {}, "data_types")
    value = types_section.get("grad_accum_dtype")
    if value is None:
        return kwargs
    name = _ACCUM_DTYPES.get(value) if isinstance(value, str) else None
    working = {"16-mixed": "fp16", "bf16-mixed": "bf16"}.get(precision, "fp32")
    if name is None or name not in ("fp32", working):
        findings.problems.append(f"data_types.grad_accum_dtype={json.dumps(value)}: gradients accumulate here in fp32 "
                                 f"or in the working dtype ({working}, from fp16/bf16); use \"fp32\" or \"{working}\"")
        return kwargs
    kwargs["grad_accum_dtype"] = "fp32" if name == "fp32" else "working"
    if not local and name != working:
        findings.notes.append(f"data_types.grad_accum_dtype={value}: the dtype of local_accumulation's buffer (stages "
                              f"2-3); without local_accumulation gradients accumulate in their reduced shard, in {working}")
    return kwargs


# ---- ZeRO++ ------------------------------------------------------------------------------------


def read_zero_plus_plus(zero: Mapping, stage: int, findings: Findings) -> dict[str, Any]:
    """ZeroConfig settings from DeepSpeed's ZeRO++ keys of ``zero_optimization``.

    ``zero_quantized_weights`` is ``quantized_weights`` (int8, stage 3); ``zero_hpz_partition_size``
    above 1 is ``secondary_partition_size`` (stage 3; 1, DeepSpeed's default, is none);
    ``zero_quantized_gradients`` is ``quantized_gradients="int4"``, the width ZeRO++ sends gradients
    in. MiCS's ``mics_shard_size`` is ``shard_group_size`` (hybrid sharding: see [Note: hybrid sharding] in
    engine/comm/topology.py). A stage-3 key at another stage is a problem in ``findings``, as
    DeepSpeed ignores it there.
    """
    kwargs: dict[str, Any] = {}
    path = "zero_optimization."
    if read_flag(zero.get("zero_quantized_weights", False), path + "zero_quantized_weights"):
        if stage != 3:
            findings.problems.append(f"{path}zero_quantized_weights at stage {stage}: it quantizes stage 3's parameter "
                                     "all-gathers; set stage 3, or remove it")
        else:
            kwargs["quantized_weights"] = True
    size = read_integer(zero.get("zero_hpz_partition_size", 1), path + "zero_hpz_partition_size", 1)
    if size > 1:
        if stage != 3:
            findings.problems.append(f"{path}zero_hpz_partition_size={size} at stage {stage}: the secondary partition "
                                     "holds stage 3's gathered parameters; set stage 3, or set it to 1")
        else:
            kwargs["secondary_partition_size"] = size
    mics = zero.get("mics_shard_size", -1)  # DeepSpeed's default, -1: off
    if mics != -1:
        size = read_integer(mics, path + "mics_shard_size", 1)
        if stage != 3:
            findings.problems.append(f"{path}mics_shard_size={size} at stage {stage}: DeepSpeed's MiCS shards stage "
                                     "3's parameters; set stage 3, or remove it (ZeroStrategy(shard_group_size=...) "
                                     "offers hybrid sharding at stages 1 and 2)")
        else:
            kwargs["shard_group_size"] = size
            findings.notes.append(f"{path}mics_shard_size={size} read as shard_group_size={size} (hybrid sharding): "
                                  f"stage 3 within groups of {size} ranks, replicated across them")
    if read_flag(zero.get("zero_quantized_gradients", False), path + "zero_quantized_gradients"):
        kwargs["quantized_gradients"] = "int4"
        findings.notes.append(f"{path}zero_quantized_gradients=true read as quantized_gradients=\"int4\" (ZeRO++'s "
                              "gradient width), reduced in two hops over nodes as ZeRO++ does")
    return kwargs


# ---- bf16 masters and optimizer state ------------------------------------------------------------


def read_bf16_low_precision(config: Mapping, precision: Optional[str], findings: Findings) -> dict[str, Any]:
    """ZeroConfig settings from DeepSpeed's ``bf16.bf16_master_weights_and_grads`` (no fp32 master:
    ``master_weights_dtype="bf16"``; the gradients are bf16 here anyway, the weights' dtype) and
    ``bf16.bf16_optimizer_states`` (``optimizer_state_dtype="bf16"`` for every parameter,
    ``optimizer_state_min_numel=0``, as DeepSpeed's). Both need bf16 enabled; the
    bf16 masters are updated with stochastic rounding here (``stochastic_rounding=False``: to nearest)."""
    section = config.get("bf16") or {}
    kwargs: dict[str, Any] = {}
    for key, setting in (("bf16_master_weights_and_grads", "master_weights_dtype"),
                         ("bf16_optimizer_states", "optimizer_state_dtype")):
        if not read_flag(section.get(key, False), f"bf16.{key}"):
            continue
        if precision != "bf16-mixed":
            findings.problems.append(f"bf16.{key}: needs bf16.enabled=true (bf16 working weights); enable bf16, or "
                                     "remove the key")
            continue
        kwargs[setting] = "bf16"
    if "optimizer_state_dtype" in kwargs:
        kwargs["optimizer_state_min_numel"] = 0  # DeepSpeed keeps every parameter's state in bf16, small ones too
    if "master_weights_dtype" in kwargs:
        findings.notes.append("bf16.bf16_master_weights_and_grads: the bf16 weights are their own master "
                              "(master_weights_dtype=\"bf16\"), updated with stochastic rounding; pass "
                              "stochastic_rounding=False for round to nearest")
    return kwargs
