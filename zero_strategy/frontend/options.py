"""The options every Lightning front end takes (ZeroStrategy, ZeroFabricStrategy), checked once,
and the process group they start. No Lightning here: each front end passes its own arguments.

[Note: the front ends' signatures]
ZeroStrategy and ZeroFabricStrategy take every ZeroConfig field and the options of ``FRONT_END_OPTIONS``
as arguments, beside the few their Lightning base takes. Neither writes them out: ``takes_options``
gives each ``__init__`` its whole signature from the two sources, in the order they always had (the
engine's first, so ``ZeroStrategy(3)`` is stage 3; then the front end's own; then the shared ones),
each with its type and default. ``inspect.signature``, ``help()``, LightningCLI and jsonargparse, Hydra
and the docs read that signature, so a new field is an argument of both front ends with nothing else
written (tests/test_options_source.py). Static readers (an editor's completion) see ``**options``.

A DeepSpeed config (``config=ds.json``) sets the engine's settings and the precision (see
``engine_settings``); what it says about the loop (accumulation, clipping, optimizer, schedule,
batch sizes) is each front end's to apply or refuse.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import typing
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Literal, Mapping, Optional, Union

import torch
import torch.distributed as dist

from ..config import ZeroConfig
from ..engine.comm.collectives import Collectives
from ..deepspeed.config import DeepSpeedConfigError, DeepSpeedSettings, map_deepspeed_config

DeepSpeedConfig = Union[Mapping[str, Any], str, os.PathLike]
START_METHODS = ("popen", "spawn", "fork", "forkserver")
STATE_DICT_TYPES = ("sharded", "full")


def _keyword(name: str, default: Any, annotation: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=annotation)


FRONT_END_OPTIONS = (
    _keyword("process_group_backend", None, Optional[str]),  # None: NCCL on CUDA, gloo otherwise
    _keyword("timeout", dist.constants.default_pg_timeout, Union[timedelta, float, None]),  # the process group's
    _keyword("start_method", "popen", Literal["popen", "spawn", "fork", "forkserver"]),  # see START_METHODS
    _keyword("state_dict_type", "sharded", Literal["sharded", "full"]),  # see STATE_DICT_TYPES
    _keyword("verify_checkpoints", True, bool),  # check every part read against its checksum
    _keyword("config", None, Optional[DeepSpeedConfig]),  # a DeepSpeed config: a dict or a JSON file
)
"""The options of every front end beyond the engine's (see [Note: the front ends' signatures])."""


def engine_options() -> list[inspect.Parameter]:
    """ZeroConfig's fields that the front ends take, as parameters with their types and defaults."""
    hints = typing.get_type_hints(ZeroConfig)
    fields = [f for f in dataclasses.fields(ZeroConfig) if f.metadata["argument"]]
    return [_keyword(f.name, f.default, hints[f.name]) for f in fields]


def takes_options(init: Callable[..., None]) -> Callable[..., None]:
    """``init(self, <the front end's own arguments>, **options)`` with its whole signature (see [Note: the
    front ends' signatures]); ``options`` gets every engine and front-end option, defaults filled in."""
    own = inspect.signature(init)
    this, *mine = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    signature = own.replace(parameters=[this, *engine_options(), *mine, *FRONT_END_OPTIONS])

    @functools.wraps(init)
    def with_options(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)  # a misspelt option: TypeError naming it, as before
        bound.apply_defaults()
        given = dict(bound.arguments)
        del given[this.name]
        init(self, **given)

    with_options.__signature__ = signature  # type: ignore[attr-defined]
    return with_options


def as_timedelta(timeout: Union[timedelta, float, None]) -> Optional[timedelta]:
    """The process group's timeout: a timedelta, or a number of seconds (converted), or None."""
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        return timedelta(seconds=timeout)
    raise ValueError(f"timeout={timeout!r} must be a datetime.timedelta or a positive number of seconds (the "
                     "process group's timeout; the default is 30 minutes).")


def engine_settings(config: DeepSpeedConfig, arguments: Mapping[str, Any]) -> tuple[DeepSpeedSettings, dict]:
    """The config's mapping and the ZeroConfig arguments that follow from it and from ``arguments``
    (the strategy's, as passed: those equal to ZeroConfig's defaults count as not given)."""
    settings = map_deepspeed_config(config)
    from_config = dict(settings.strategy)
    if from_config.get("stage", 0) == 0:
        raise DeepSpeedConfigError(
            "the DeepSpeed config has no zero_optimization stage (DeepSpeed's stage 0: plain data parallelism, "
            "which ZeroStrategy does not run); add \"zero_optimization\": {\"stage\": 2} (1, 2 or 3), or train with "
            "strategy=\"ddp\".")
    defaults = {f.name: f.default for f in dataclasses.fields(ZeroConfig)}
    given = {k: v for k, v in arguments.items() if k in defaults and v != defaults[k]}
    conflicts = [f"{k}={given[k]!r} given to ZeroStrategy, {k}={from_config[k]!r} from the config"
                 for k in sorted(given.keys() & from_config.keys()) if _normal(given[k]) != _normal(from_config[k])]
    if conflicts:
        raise DeepSpeedConfigError("ZeroStrategy's arguments and its DeepSpeed config disagree: " + "; ".join(conflicts)
                                   + ". Give each setting in one place.")
    return settings, {**arguments, **from_config, **given}


def _normal(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


@dataclass(frozen=True)
class FrontEndOptions:
    """A Lightning front end's options, checked: the engine's settings and how checkpoints and
    processes go."""

    config: ZeroConfig
    """The engine's settings (master_weights follows the precision, at setup)."""
    deepspeed: Optional[DeepSpeedSettings]
    """What a DeepSpeed config said, when one was given."""
    state_dict_type: str
    """"sharded": a checkpoint directory, each rank writing what it owns; "full": one file from rank 0."""
    verify_checkpoints: bool
    """Check every part read against its checksum."""
    start_method: str
    """How the launcher starts the ranks: "popen" re-runs the script, as DDP does."""
    timeout: Optional[timedelta]
    """The process group's timeout."""

    @property
    def precision_from_config(self) -> Optional[tuple[str, dict[str, Any]]]:
        """The precision and loss-scaling arguments a DeepSpeed config enables, if it enables one."""
        if self.deepspeed is None or self.deepspeed.precision is None:
            return None
        return self.deepspeed.precision, dict(self.deepspeed.precision_kwargs)


def engine_arguments(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The ZeroConfig fields among ``arguments`` (a front end's options, a Hydra strategy node)."""
    return {name: arguments[name] for name in ZeroConfig.__dataclass_fields__ if name in arguments}


def read_options(options: Mapping[str, Any]) -> FrontEndOptions:
    """Check a front end's ``options`` (ZeroConfig's fields and ``FRONT_END_OPTIONS``), raising for a bad
    one with its value, what is allowed and what to do."""
    engine = engine_arguments(options)
    state_dict_type, verify_checkpoints = options["state_dict_type"], options["verify_checkpoints"]
    start_method, timeout, config = options["start_method"], options["timeout"], options["config"]
    deepspeed = None
    if config is not None:
        deepspeed, engine = engine_settings(config, engine)
    zero_config = ZeroConfig(**engine)
    if state_dict_type not in STATE_DICT_TYPES:
        raise ValueError(f"state_dict_type={state_dict_type!r} is not one of {STATE_DICT_TYPES}: 'sharded' (the "
                         "default) saves a checkpoint directory, each rank writing what it owns; 'full' gathers "
                         "the whole state and rank 0 saves one file.")
    if not isinstance(verify_checkpoints, bool):
        raise ValueError(f"verify_checkpoints={verify_checkpoints!r} must be True (check every part read against "
                         "its checksum) or False (load a huge checkpoint you trust without the check).")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method={start_method!r} is not one of {START_METHODS}; 'popen' (the default) "
                         "re-runs your script once per device, as DDP does.")
    return FrontEndOptions(zero_config, deepspeed, state_dict_type, verify_checkpoints, start_method,
                           as_timedelta(timeout))


# ---- the process group ---------------------------------------------------------------------


def process_group_backend(requested: Optional[str], device: torch.device) -> str:
    """``requested``, or NCCL for CUDA devices and gloo otherwise; NCCL without CUDA is refused."""
    backend = requested or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"process_group_backend='nccl' needs CUDA devices, but this rank runs on "
                         f"{device}; use 'gloo' (the default on CPU) or accelerator='cuda'.")
    return backend


def check_world_size(expected: int, who: str, fix: str) -> None:
    """The process group that started holds as many processes as ``who`` (the Trainer, Fabric) was
    told of; else an error ending with ``fix``, what to launch instead."""
    if dist.get_world_size() != expected:
        raise RuntimeError(f"the process group has {dist.get_world_size()} processes but {who} expects {expected} "
                           f"{fix}")


def barrier(device: torch.device) -> None:
    """Wait for every rank (nothing to wait for without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (itself without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src)
    return holder[0]


class ProcessLayout:
    """What Lightning's Trainer and Fabric ask a data-parallel strategy about its processes: one per
    device of ``parallel_devices`` on each of ``num_nodes`` nodes (mixed into both strategies)."""

    _num_nodes: int = 1

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None  # type: ignore[attr-defined]
        return self.parallel_devices[self.local_rank]  # type: ignore[attr-defined]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        devices = self.parallel_devices  # type: ignore[attr-defined]
        return len(devices) if devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}  # type: ignore[attr-defined]

    def _world_collectives(self) -> Collectives:
        """The engine's collectives over the whole world, on this launch's node layout: ``num_processes``
        ranks (devices) on each node, which decides what ``comm_stats()`` files as inter-node and where
        ``secondary_partition_size`` groups may lie."""
        config: ZeroConfig = self.config  # type: ignore[attr-defined]
        world = dist.get_world_size() if dist.is_initialized() else 1
        per_node = self.num_processes if self.num_processes and world % self.num_processes == 0 else None
        return Collectives(collective_timeout=config.collective_timeout, ranks_per_node=per_node)

    def comm_stats(self, times: bool = False) -> dict[str, float]:
        """Bytes this rank sent in its last training step (forward, backward and optimizer step), by
        collective kind and by link: all_gather, reduce_scatter, all_reduce, broadcast, total,
        intra_node, inter_node (see [Note: bytes sent] in engine/comm/volume.py). Zeros before the
        first step. ``times``: also the seconds this rank waited for them, not hidden by computation
        (``<kind>_s`` and ``total_s``: see [Note: the step breakdown] in engine/diagnose/breakdown.py)."""
        return self.comm.comm_stats(times)  # type: ignore[attr-defined]
