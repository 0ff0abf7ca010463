"""A DeepSpeed JSON config, read and mapped onto this package's settings (no process group needed).

``map_deepspeed_config(config)`` turns a DeepSpeed config (a dict, or the path of its JSON file)
into ``DeepSpeedSettings``: keyword arguments for ``ZeroStrategy``, a Lightning precision name with
``ZeroPrecision``'s fp16 loss-scaling knobs, clipping, batch sizes, and factories for the optimizer
and the LR scheduler. Meanings and defaults are DeepSpeed 0.19's.

[Note: every key accounted for]
Each key of the config, at every level, is one of: mapped onto a setting (``keys.MAPPED``);
accepted with no effect here, with the reason (``keys.RULES`` entries whose test passes: listed once
by ``DeepSpeedSettings.log_summary()``); or refused (a failing ``keys.RULES`` test: the key would
change training and this package has no equivalent). Refused keys and unknown ones (a typo: the closest
known key is suggested) are collected and raised as one ``DeepSpeedConfigError``, so a user fixes
the whole config in one go. Hugging Face's ``"auto"`` is accepted where the Trainer or this
package supplies the value (``keys.AUTO_OK``) and means "not given". The tables and the value
readers are in keys.py, the optimizer section's reading in optimizers.py.
"""

from __future__ import annotations

import inspect
import json
import os
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch.optim.lr_scheduler import LRScheduler

from .autocast import AutocastSettings, read_torch_autocast
from .keys import (AUTO_HINT, AUTO_OK, MAPPED, RULES, ZERO_ALIASES, DeepSpeedConfigError, Findings, is_auto,
                   load_deepspeed_config, read_accumulation, read_bf16_low_precision, read_flag, read_integer,
                   read_number, read_section, read_zero_plus_plus, typo_hint)
from .optimizers import OptimizerFactory, optimizer_factory
from .reporting import Reporting, read_reporting
from .schedulers import scheduler_from_config

__all__ = ["DEFAULT_GRADIENT_CLIPPING", "DeepSpeedConfigError", "DeepSpeedSettings", "OptimizerFactory",
           "SchedulerFactory", "check_against_trainer", "load_deepspeed_config", "map_deepspeed_config",
           "resolve_batch_sizes"]


DEFAULT_GRADIENT_CLIPPING = 1.0
"""What DeepSpeed 0.19 clips the gradient norm to when a config has no ``gradient_clipping``
(``GRADIENT_CLIPPING_DEFAULT`` in deepspeed/runtime/constants.py): a config without the key clips."""


# ---- the pieces of the settings -----------------------------------------------------------------


@dataclass(frozen=True)
class SchedulerFactory:
    """Builds the LR scheduler of a config's ``"scheduler"`` section: ``factory(optimizer)``. DeepSpeed
    steps it after every optimizer step, so give it to Lightning with ``"interval": "step"``."""

    scheduler_class: type
    kwargs: Mapping[str, Any]

    def __call__(self, optimizer: torch.optim.Optimizer) -> LRScheduler:
        return self.scheduler_class(optimizer, **self.kwargs)


@dataclass(frozen=True)
class DeepSpeedSettings:
    """What a DeepSpeed config means for this package. None: the config does not say."""

    strategy: Mapping[str, Any]
    """Keyword arguments of ZeroStrategy (and ZeroConfig): stage, offload, bucket sizes, stage-3 options."""
    precision: Optional[str]
    """A Lightning precision: "16-mixed" (fp16), "bf16-mixed" (bf16), "32-true" (both disabled), None."""
    precision_kwargs: Mapping[str, Any]
    """ZeroPrecision's loss-scaling arguments, when fp16 is enabled or "auto" (then for the Trainer's
    "16-mixed"); else empty: ZeroPrecision(precision, **precision_kwargs)."""
    gradient_clipping: Optional[float]
    """The config's ``gradient_clipping``: clip the gradient norm (over all ranks) to this; 0.0: no
    clipping; None: not given (or "auto"), which DeepSpeed reads as DEFAULT_GRADIENT_CLIPPING (1.0).
    ``clipping()`` resolves it."""
    train_batch_size: Optional[int]
    train_micro_batch_size_per_gpu: Optional[int]
    gradient_accumulation_steps: Optional[int]
    world_size: Optional[int]
    """The world size the three batch numbers were resolved at; None: as given, not resolved."""
    dataloader_drop_last: bool
    """For a DataLoader the engine builds from ``training_data`` (DeepSpeed's default: false)."""
    optimizer: Optional[OptimizerFactory]
    scheduler: Optional[SchedulerFactory]
    activation_checkpointing: Mapping[str, Any]
    """The ZeroStrategy arguments that came from "activation_checkpointing" (already in ``strategy``)."""
    ignored: Mapping[str, str]
    """Keys accepted with no effect here, each with the reason."""
    notes: tuple[str, ...]
    """How some mapped keys were read (bucket sizes, pinning, ...)."""
    autocast: Optional[AutocastSettings] = None
    """The enabled ``torch_autocast`` section, read by ``initialize`` only (see [Note: torch_autocast])."""
    reporting: Reporting = Reporting()
    """``wall_clock_breakdown``, ``steps_per_print``, ``flops_profiler``: printed by ``initialize``'s engine
    (see [Note: DeepSpeed's reports] in deepspeed/reporting.py)."""

    def clipping(self, trainer_value: Optional[float] = None) -> float:
        """The gradient norm to clip to (0.0: none). The config's value when it gives one; else
        ``trainer_value`` (the Trainer's ``gradient_clip_val``, for ZeroStrategy; None for
        ``initialize``, which has no Trainer), else DeepSpeed's default, DEFAULT_GRADIENT_CLIPPING."""
        if self.gradient_clipping is not None:
            return self.gradient_clipping
        return float(trainer_value) if trainer_value is not None else DEFAULT_GRADIENT_CLIPPING

    def log_summary(self) -> str:
        """One line for the log: the keys accepted with no effect here and the notes on the mapping."""
        parts = [f"{key} ({reason})" for key, reason in self.ignored.items()]
        line = "DeepSpeed config: " + ("accepted with no effect here: " + "; ".join(parts) if parts
                                       else "every key maps onto this package")
        return line + (". Notes: " + "; ".join(self.notes) if self.notes else "") + "."


# ---- the mapping --------------------------------------------------------------------------------


def _element_size(precision: Optional[str]) -> int:
    """Bytes of one parameter element under a Lightning precision (fp32 when it is not known)."""
    name = str(precision or "32")
    return 2 if name.startswith(("16", "bf16")) else 8 if name.startswith("64") else 4


class _Reader(Findings):
    """One pass over a config: values checked as they are read; refusals collected (see [Note: every key
    accounted for])."""

    def walk(self, section: Mapping, prefix: str = "") -> None:
        for key, value in section.items():
            path = f"{prefix}.{key}" if prefix else key
            rule = RULES.get(path)
            if rule is not None:
                if rule.accepts(value):
                    self.ignored[path] = rule.reason
                else:
                    self.problems.append(f"{path}={json.dumps(value)[:60]}: {rule.instead}")
            elif key not in MAPPED.get(prefix, ()):
                self.problems.append(f"{path}: unknown key{typo_hint(key, prefix)}")
            elif path in MAPPED and value is not None:
                self.walk(read_section(value, path), path)
            elif is_auto(value) and path not in AUTO_OK:
                self.problems.append(f"{path}='auto': {AUTO_HINT}")

    def normalise(self, config: dict) -> dict:
        """DeepSpeed's other spellings of the same keys, rewritten to the ones the tables use."""
        if "bfloat16" in config:
            if "bf16" in config:
                self.problems.append("bfloat16: the old name of bf16, given next to bf16; keep only bf16")
            config.setdefault("bf16", config.pop("bfloat16"))
        zero = config.get("zero_optimization")
        if isinstance(zero, bool):  # DeepSpeed's oldest form: true meant stage 1
            config["zero_optimization"] = zero = {"stage": 1 if zero else 0}
        if isinstance(zero, dict):
            for short, full in ZERO_ALIASES.items():
                if short in zero:
                    if full in zero:
                        self.problems.append(f"zero_optimization.{short}: given next to {full}, its other name; "
                                             "keep one")
                    zero.setdefault(full, zero.pop(short))
            for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
                if old in zero:  # deprecated booleans of DeepSpeed's
                    if read_flag(zero.pop(old), f"zero_optimization.{old}") and new not in zero:
                        zero[new] = {"device": "cpu"}
                    self.notes.append(f"zero_optimization.{old} (deprecated) read as {new}")
            if "cpu_offload_use_pin_memory" in zero:
                pin = zero.pop("cpu_offload_use_pin_memory")
                for name in ("offload_optimizer", "offload_param"):
                    if isinstance(zero.get(name), dict):
                        zero[name].setdefault("pin_memory", pin)
        return config

    def precision(self, config: dict) -> tuple[Optional[str], dict[str, Any]]:
        """The Lightning precision the fp16/bf16 sections name, and ZeroPrecision's loss-scaling arguments
        (given whenever fp16 may run: enabled, or "auto" for the Trainer's "16-mixed")."""
        states = {}
        for name in ("fp16", "bf16"):
            if config.get(name) is not None:
                enabled = read_section(config[name], name).get("enabled", False)
                states[name] = None if is_auto(enabled) else read_flag(enabled, f"{name}.enabled")
        if states.get("fp16") and states.get("bf16"):
            raise DeepSpeedConfigError("fp16.enabled and bf16.enabled are both true (DeepSpeed refuses this too); "
                                       "enable one: fp16 for fp16 weights with loss scaling, bf16 for bf16 weights.")
        precision = ("16-mixed" if states.get("fp16") else "bf16-mixed" if states.get("bf16") else
                     "32-true" if states and None not in states.values() else None)
        fp16 = config.get("fp16") or {}
        if "fp16" not in states or states["fp16"] is False or precision == "bf16-mixed":
            knobs = sorted(set(fp16) & (MAPPED["fp16"] - {"enabled"}))
            if knobs:
                self.ignored["fp16." + "/".join(knobs)] = "fp16 is not enabled"
            return precision, {}
        def count(key: str, default: int, minimum: int = 0) -> int:
            return read_integer(fp16.get(key, default), f"fp16.{key}", minimum)

        kwargs = {"loss_scale": read_number(fp16.get("loss_scale", 0.0), "fp16.loss_scale"),
                  "initial_scale_power": count("initial_scale_power", 16),
                  "loss_scale_window": count("loss_scale_window", 1000, 1), "hysteresis": count("hysteresis", 2, 1),
                  "min_loss_scale": read_number(fp16.get("min_loss_scale", 1.0), "fp16.min_loss_scale")}
        if kwargs["min_loss_scale"] <= 0:
            raise DeepSpeedConfigError(f"fp16.min_loss_scale={fp16['min_loss_scale']!r} must be above 0 (the loss "
                                       "scale's floor); DeepSpeed's default is 1.")
        return precision, kwargs

    def offload_device(self, zero: dict, name: str) -> tuple[str, dict]:
        path = f"zero_optimization.{name}"
        section = read_section(zero.get(name) or {}, path)
        device = section.get("device") or "none"
        if device not in ("none", "cpu", "nvme"):
            raise DeepSpeedConfigError(f"{path}.device={device!r} must be \"cpu\", \"nvme\" or \"none\".")
        if "nvme_path" in section and device != "nvme":
            self.ignored[f"{path}.nvme_path"] = "read only with device \"nvme\""
        if device != "none" and not read_flag(section.get("pin_memory", True), f"{path}.pin_memory"):
            self.notes.append(f"{path}.pin_memory=false: host buffers are pinned whenever the device is CUDA "
                              "here (the asynchronous copies need it), never on CPU")
        return device, section

    def zero(self, zero: dict, element_size: int) -> dict[str, Any]:
        stage = read_integer(zero.get("stage", 0), "zero_optimization.stage")
        if stage > 3:
            raise DeepSpeedConfigError(f"zero_optimization.stage={stage} must be 0, 1, 2 or 3.")
        kwargs: dict[str, Any] = {"stage": stage}
        device, section = self.offload_device(zero, "offload_optimizer")
        if device != "none":
            if stage == 0:
                self.problems.append("zero_optimization.offload_optimizer: needs ZeRO stage 1, 2 or 3; set "
                                     "zero_optimization.stage")
            kwargs["offload_optimizer"] = True
            if device == "nvme":
                if not isinstance(section.get("nvme_path"), str) or not section["nvme_path"]:
                    raise DeepSpeedConfigError("zero_optimization.offload_optimizer.device=\"nvme\" needs nvme_path, "
                                               "the folder to keep the optimizer state in.")
                kwargs["offload_dir"] = section["nvme_path"]
            if read_flag(section.get("super_offload", False), "zero_optimization.offload_optimizer.super_offload"):
                if device == "nvme" or stage == 1:
                    self.problems.append("zero_optimization.offload_optimizer.super_offload: the host step overlapped "
                                         "with backward (offload_overlap) needs stage 2 or 3 and device \"cpu\"; "
                                         "remove super_offload, or set those")
                else:
                    kwargs["offload_overlap"] = True
        device, section = self.offload_device(zero, "offload_param")
        if device != "none" and stage != 3:
            self.problems.append(f"zero_optimization.offload_param at stage {stage}: only stage 3 shards parameters; "
                                 "set stage 3, or offload only the optimizer (offload_optimizer)")
        elif device == "nvme":
            self.problems.append("zero_optimization.offload_param.device=\"nvme\": parameter shards are offloaded to "
                                 "host memory here; use \"cpu\" (the optimizer state can go to NVMe)")
        elif device == "cpu":
            kwargs["offload_params"] = True
        sizes = {key: None if is_auto(zero.get(key)) else read_integer(zero[key], f"zero_optimization.{key}",
                                                                        minimum)
                 for key, minimum in (("reduce_bucket_size", 1), ("allgather_bucket_size", 0)) if key in zero}
        elements = sizes.get("reduce_bucket_size") or sizes.get("allgather_bucket_size")
        if elements:
            kwargs["bucket_cap_mb"] = elements * element_size / 2**20
            self.notes.append(f"bucket_cap_mb={kwargs['bucket_cap_mb']:.6g} MiB: {elements} elements of "
                              f"{element_size} bytes")
            if len(set(sizes.values()) - {None, 0}) == 2:
                self.notes.append("one bucket (a segment) serves reductions and all-gathers here: reduce_bucket_size "
                                  "is used, allgather_bucket_size is not")
        persistence = zero.get("stage3_param_persistence_threshold")
        if persistence is not None and not is_auto(persistence):
            kwargs["param_persistence_threshold"] = read_integer(persistence, "zero_optimization.stage3_param_"
                                                                 "persistence_threshold")
        prefetch = zero.get("stage3_prefetch_bucket_size")
        if prefetch is not None and not is_auto(prefetch):
            kwargs["prefetch"] = read_integer(prefetch, "zero_optimization.stage3_prefetch_bucket_size") > 0
            if kwargs["prefetch"]:
                self.notes.append("stage3_prefetch_bucket_size: the next unit is prefetched whatever its size")
        tiles = zero.get("sub_group_size")
        if tiles is not None and not is_auto(tiles):
            elements = read_integer(tiles, "zero_optimization.sub_group_size")
            if "offload_dir" in kwargs and elements > 0:
                kwargs["offload_tile_mb"] = elements * 4 / 2**20  # a tile of fp32 master weights
            else:
                self.ignored["zero_optimization.sub_group_size"] = "tiles only an optimizer step offloaded to NVMe here"
        classes = read_section(zero.get("leaf_module") or {}, "zero_optimization.leaf_module").get("classes")
        if classes is not None:
            if not isinstance(classes, list) or not all(isinstance(c, str) and c for c in classes):
                raise DeepSpeedConfigError(f"zero_optimization.leaf_module.classes={classes!r} must be a list of class "
                                           "names or dotted class paths.")
            kwargs["leaf_modules"] = tuple(c.rpartition(".")[2] for c in classes)  # a class matches by its name
        kwargs.update(read_zero_plus_plus(zero, stage, self))
        return kwargs


def _batch_number(config: dict, key: str) -> Optional[int]:
    value = config.get(key)
    return None if value is None or is_auto(value) else read_integer(value, key, 1)


def resolve_batch_sizes(train_batch_size: Optional[int], micro_batch_size: Optional[int],
                        accumulation_steps: Optional[int], world_size: Optional[int]
                        ) -> tuple[Optional[int], Optional[int], Optional[int]]:
    """DeepSpeed's batch arithmetic: (train_batch_size, train_micro_batch_size_per_gpu,
    gradient_accumulation_steps) with the missing ones derived at ``world_size`` (train = micro *
    accumulation * world size; one given alone means no accumulation). Unresolved when
    ``world_size`` is None or neither batch size is given (the DataLoader then decides). Raises
    when the three disagree."""
    if world_size is None or (train_batch_size is None and micro_batch_size is None):
        return train_batch_size, micro_batch_size, accumulation_steps
    world = read_integer(world_size, "world_size", 1)
    train, micro, steps = train_batch_size, micro_batch_size, accumulation_steps
    if micro is None:
        steps = steps or 1
        micro = train // world // steps
    elif train is None:
        steps = steps or 1
        train = micro * steps * world
    elif steps is None:
        steps = train // micro // world
    if train != micro * steps * world or micro < 1 or steps < 1:
        given = [name for name, value in (("train_batch_size", train_batch_size),
                                          ("train_micro_batch_size_per_gpu", micro_batch_size),
                                          ("gradient_accumulation_steps", accumulation_steps)) if value is not None]
        raise DeepSpeedConfigError(
            f"train_batch_size={train} must equal train_micro_batch_size_per_gpu={micro} * gradient_accumulation_"
            f"steps={steps} * world_size={world} (= {micro * steps * world}); the config gives {', '.join(given)}, the "
            f"rest is derived as DeepSpeed does. Change them so that they agree at world size {world}.")
    return train, micro, steps


def map_deepspeed_config(config: Union[dict, str, os.PathLike], world_size: Optional[int] = None, *,
                         precision: Optional[str] = None, front_end: str = "ZeroStrategy") -> DeepSpeedSettings:
    """What a DeepSpeed config (a dict or a JSON file's path) means for this package.

    ``world_size`` resolves the three batch numbers as DeepSpeed does (left as given when None).
    ``precision``, the Trainer's, sizes the buckets (``reduce_bucket_size`` counts elements) when
    the config has no fp16/bf16 section. Refused and unknown keys raise one DeepSpeedConfigError;
    a bad value raises at once. A config without ``zero_optimization`` is DeepSpeed's stage 0 (no
    sharding): ``strategy["stage"]`` is then 0, which ZeroStrategy does not run (that is DDP).
    Log ``log_summary()`` once: it names the keys that have no effect here. ``front_end`` names
    the caller: only "initialize" takes an enabled ``torch_autocast`` (see [Note: torch_autocast]).
    """
    reader = _Reader()
    config = reader.normalise(load_deepspeed_config(config))
    reader.walk(config)
    config_precision, precision_kwargs = reader.precision(config)
    autocast = read_torch_autocast(config, reader, config_precision, front_end)
    reporting = read_reporting(config, reader, front_end)
    strategy = reader.zero(read_section(config.get("zero_optimization") or {}, "zero_optimization"),
                           _element_size(config_precision or precision))
    strategy.update(read_bf16_low_precision(config, config_precision, reader))
    if autocast is not None and autocast.reduce_modules and config_precision != "bf16-mixed":
        strategy["low_precision_reduce_modules"] = autocast.reduce_modules  # fp32 weights: see [Note: torch_autocast]
    strategy.update(read_accumulation(config, read_section(config.get("zero_optimization") or {},
                                                           "zero_optimization"), config_precision, reader))
    if "zero_allow_untested_optimizer" in config:
        strategy["allow_untested_optimizer"] = read_flag(config["zero_allow_untested_optimizer"],
                                                         "zero_allow_untested_optimizer")
    activation: dict[str, Any] = {}
    checkpointing = read_section(config.get("activation_checkpointing") or {}, "activation_checkpointing")
    if read_flag(checkpointing.get("cpu_checkpointing", False), "activation_checkpointing.cpu_checkpointing"):
        activation["offload_activations"] = True
        reader.notes.append("cpu_checkpointing: activations saved for backward wait in host memory (with ZeroStrategy("
                            "activation_checkpointing=[...]) just the checkpointed inputs, as in DeepSpeed)")
    strategy.update(activation)
    optimizer = None
    if config.get("optimizer") is not None:
        optimizer = optimizer_factory(reader, read_section(config["optimizer"], "optimizer"),
                                      strategy.get("allow_untested_optimizer", False))
    scheduler = None
    if config.get("scheduler") is not None:
        section = read_section(config["scheduler"], "scheduler")
        params = read_section(section.get("params") or {}, "scheduler.params")
        cls, kwargs, problems = scheduler_from_config(section.get("type"), params)
        reader.problems += problems
        scheduler = SchedulerFactory(cls, types.MappingProxyType(kwargs)) if cls is not None else None
        if (section.get("type") == "OneCycle" and kwargs.get("cycle_momentum", True) and optimizer is not None
                and "betas" in inspect.signature(optimizer.optimizer_class).parameters):
            reader.notes.append("OneCycle cycles beta1 between cycle_max_mom and cycle_min_mom and sets beta2 to "
                                "0.99, as DeepSpeed's does")
    if reader.problems:
        raise DeepSpeedConfigError("This DeepSpeed config has keys that zero_strategy cannot honour:\n  - "
                                   + "\n  - ".join(reader.problems))
    clipping = config.get("gradient_clipping")
    clipping = None if clipping is None or is_auto(clipping) else read_number(clipping, "gradient_clipping")
    batch = resolve_batch_sizes(_batch_number(config, "train_batch_size"),
                                _batch_number(config, "train_micro_batch_size_per_gpu"),
                                _batch_number(config, "gradient_accumulation_steps"), world_size)
    return DeepSpeedSettings(
        strategy=types.MappingProxyType(strategy), precision=config_precision,
        precision_kwargs=types.MappingProxyType(precision_kwargs), gradient_clipping=clipping,
        train_batch_size=batch[0], train_micro_batch_size_per_gpu=batch[1], gradient_accumulation_steps=batch[2],
        world_size=world_size, dataloader_drop_last=read_flag(config.get("dataloader_drop_last", False),
                                                              "dataloader_drop_last"),
        optimizer=optimizer, scheduler=scheduler, activation_checkpointing=types.MappingProxyType(activation),
        ignored=types.MappingProxyType(reader.ignored), notes=tuple(reader.notes), autocast=autocast,
        reporting=reporting)


_PRECISION_NAMES = {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true", "64": "64-true"}


def check_against_trainer(settings: DeepSpeedSettings, *, accumulate_grad_batches: Optional[int],
                          gradient_clip_val: Optional[float], precision: Optional[Union[str, int]],
                          micro_batch_size: Optional[int], world_size: Optional[int]) -> None:
    """Raise one DeepSpeedConfigError naming every value that the config and the Trainer both give,
    differently (Lightning's DeepSpeedStrategy does the same for gradient_accumulation_steps).

    Pass the Trainer's values as the user gave them (``trainer.accumulate_grad_batches``,
    ``trainer.gradient_clip_val``, the precision flag the Trainer was built with, the training
    DataLoader's per-rank ``batch_size``) and the world size; None means "not known". The Trainer
    cannot tell a default from a choice, so its defaults (accumulate_grad_batches=1, no clipping,
    "32-true") count as not given. Where only one side gives a value, that value wins: for the
    config's, the strategy must apply it, since the Trainer does not read the config. Set
    ``trainer.accumulate_grad_batches`` to ``gradient_accumulation_steps`` and
    ``trainer.gradient_clip_val`` to ``settings.clipping(trainer.gradient_clip_val)`` (by norm; 0.0:
    none; a config without the key clips at DEFAULT_GRADIENT_CLIPPING, as DeepSpeed does, unless
    the Trainer gives a value) before the fit loop runs; give
    the strategy ``ZeroPrecision(settings.precision, **settings.precision_kwargs)`` as its precision
    plugin; build the DataLoader (``initialize(training_data=...)``) with
    ``train_micro_batch_size_per_gpu``. ``train_batch_size`` has no Trainer counterpart: it is
    checked through the other two.
    """
    _, micro, steps = resolve_batch_sizes(settings.train_batch_size, settings.train_micro_batch_size_per_gpu,
                                          settings.gradient_accumulation_steps, world_size)
    conflicts = []
    if steps is not None and accumulate_grad_batches not in (None, 1) and steps != accumulate_grad_batches:
        conflicts.append(f"gradient_accumulation_steps={steps} in the DeepSpeed config, but Trainer("
                         f"accumulate_grad_batches={accumulate_grad_batches})")
    if settings.gradient_clipping is not None and gradient_clip_val and gradient_clip_val != settings.gradient_clipping:
        conflicts.append(f"gradient_clipping={settings.gradient_clipping} in the DeepSpeed config, but Trainer("
                         f"gradient_clip_val={gradient_clip_val})")
    trainer_precision = _PRECISION_NAMES.get(str(precision), str(precision)) if precision is not None else None
    if settings.precision is not None and trainer_precision not in (None, "32-true", settings.precision):
        conflicts.append(f"precision {settings.precision!r} from the DeepSpeed config's fp16/bf16 sections, but "
                         f"Trainer(precision={precision!r})")
    if micro is not None and micro_batch_size is not None and micro != micro_batch_size:
        conflicts.append(f"train_micro_batch_size_per_gpu={micro} in the DeepSpeed config, but the training "
                         f"DataLoader's batch_size={micro_batch_size}")
    if conflicts:
        raise DeepSpeedConfigError("The DeepSpeed config and the Trainer disagree:\n  - " + "\n  - ".join(conflicts)
                                   + "\nGive each value in one place, or the same value in both.")
