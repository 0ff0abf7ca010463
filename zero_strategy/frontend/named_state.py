"""Checkpoints of a dict of named objects, such as Fabric's ``fabric.save(path, {"model": model,
"optimizer": optimizer, "step": 3})``: one model on the engine, its optimizers, and anything else.

[Note: named state]
In a sharded checkpoint the model under its name is the engine's weights and the optimizers are
their pieces (see [Note: one checkpoint format for every front end]); every other entry goes into
``trainer_state.pt`` under its own name, as its ``state_dict()`` when it has one (a scheduler) or as
it is (an object a safe load refuses, such as a ``DataLoader``, beside it in ``pickled_objects.pt``,
restored only by ``fabric.load(..., weights_only=False)``: see [Note: pickled objects] in
checkpoint/pickled.py), with ``NAMES_KEY`` recording the names of the model and the optimizers (in the order they
were saved) and ``STATE_KEY`` the loss scaler. A load maps the checkpoint's optimizers to the
state's by name; in a checkpoint without that record (the Trainer's) by the state's order. With
``full`` the same names map to whole state dicts in one file that rank 0 writes (a regular
checkpoint, as DDP's, pickling whatever the state holds as DDP does: loading it needs
``weights_only=False`` then, as DDP's file does), and a regular file from elsewhere loads by the same
names, or by Lightning's ``state_dict`` and ``optimizer_states``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..checkpoint import CheckpointError, is_deepspeed_checkpoint, is_sharded_checkpoint
from ..checkpoint.deepspeed import fit_to_module
from ..checkpoint.files import atomic_write
from ..engine import ZeroOptimizer
from .checkpoint import (ZERO_RECORD, deepspeed_client_state, deepspeed_optimizer_state, load_full_model,
                         load_full_optimizers, load_sharded_model, load_sharded_optimizers, open_sharded,
                         read_deepspeed, read_file, save_sharded_model)
from .precision import STATE_KEY
from .setup import EngineModel

NAMES_KEY = "zero_named_state"  # {"module": "model", "optimizers": ["optimizer", ...]}
_RESERVED = (NAMES_KEY, STATE_KEY, ZERO_RECORD, "state_dict", "optimizer_states")
Filter = Optional[dict[str, Callable[[str, Any], bool]]]


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


@dataclass
class NamedState:
    """A state dict split into its model (on the engine), that model's optimizers, and the rest."""

    module_key: str
    model: EngineModel
    optimizer_keys: list[str]
    optimizers: list[ZeroOptimizer]  # the state's, in its order (a model may have more)
    extras: dict[str, Any]

    def with_optimizers(self, keys: Sequence[str]) -> EngineModel:
        """The model with the state's optimizers of ``keys``, in that order (for saving or loading them)."""
        by_key = dict(zip(self.optimizer_keys, self.optimizers))
        return dataclasses.replace(self.model, optimizers=[by_key[k] for k in keys])


def split_state(state: dict[str, Any], engines: Sequence[EngineModel], call: str) -> NamedState:
    """Find the one model in ``state`` that is on the engine and its optimizers; raise, naming the
    entry and what to pass instead, for a second model or an object not set up by the front end."""
    on_engine = [key for key, value in state.items() if any(e.module is value for e in engines)]
    if len(on_engine) > 1:
        raise ValueError(f"{call}: the state holds {len(on_engine)} models set up on the engine ({on_engine}); a "
                         "checkpoint holds exactly one (as with Fabric's FSDP and DeepSpeed strategies): save each "
                         "model in a checkpoint of its own.")
    if not on_engine:
        others = [key for key, value in state.items() if isinstance(value, nn.Module)]
        what = (f"state[{others[0]!r}] is a {type(state[others[0]]).__name__} that was not set up on the engine"
                if others else "the state holds no model")
        raise ValueError(f"{call}: {what}; pass the model that fabric.setup(...) returned, e.g. "
                         "{'model': model, 'optimizer': optimizer}.")
    module_key = on_engine[0]
    model = next(e for e in engines if e.module is state[module_key])
    optimizer_keys, optimizers = [], []
    for key, value in state.items():
        if not isinstance(value, torch.optim.Optimizer):
            continue
        if not any(value is opt for opt in model.optimizers):
            what = ("was not set up" if not isinstance(value, ZeroOptimizer)
                    else f"belongs to another model than {module_key!r}")
            raise ValueError(f"{call}: state[{key!r}] is a {type(value).__name__} that {what}; pass the optimizer that "
                             f"fabric.setup(...) returned with state[{module_key!r}].")
        optimizer_keys.append(key)
        optimizers.append(value)
    extras = {k: v for k, v in state.items() if k != module_key and k not in optimizer_keys}
    reserved = [k for k in extras if k in _RESERVED]
    if reserved:
        raise ValueError(f"{call}: the state's keys {reserved} are names the checkpoint uses itself; rename them.")
    return NamedState(module_key, model, optimizer_keys, optimizers, extras)


# ---- save ----------------------------------------------------------------------------------


def save_named_state(path: Path, state: dict[str, Any], engines: Sequence[EngineModel], call: str) -> None:
    """The sharded checkpoint of ``state`` (see [Note: named state]). A collective."""
    named = split_state(state, engines, call)
    checkpoint: dict[str, Any] = {k: v.state_dict() if _stateful(v) else v for k, v in named.extras.items()}
    checkpoint[NAMES_KEY] = {"module": named.module_key, "optimizers": named.optimizer_keys}
    checkpoint[STATE_KEY] = named.model.precision.state_dict()
    if named.optimizer_keys:
        checkpoint["optimizer_states"] = []  # the flag for save_sharded: write the optimizers' pieces too
    save_sharded_model(path, checkpoint, named.with_optimizers(named.optimizer_keys))


def save_named_state_full(path: Path, state: dict[str, Any], engines: Sequence[EngineModel], call: str,
                          filter: Filter = None) -> None:
    """One regular checkpoint file of whole state dicts under the state's names, written by rank 0
    atomically (see [Note: named state]). ``filter[name](key, value)`` keeps an entry of that state
    dict. A collective: stage 3 gathers the weights, and the optimizer states are consolidated."""
    named = split_state(state, engines, call)
    model = named.model
    full: dict[str, Any] = {}
    for key, value in state.items():
        if key == named.module_key:
            value = model.full_state_dict()
        elif key in named.optimizer_keys:
            value = value.state_dict()
        elif _stateful(value):
            value = value.state_dict()
        if filter and key in filter and isinstance(value, dict):
            value = {k: v for k, v in value.items() if filter[key](k, v)}
        full[key] = value
    full[STATE_KEY] = model.precision.state_dict()
    error = ""
    if model.comm.rank == 0:
        try:
            atomic_write(Path(path), lambda tmp: torch.save(full, tmp))
        except Exception as err:  # every rank must reach the broadcast below
            error = f"{type(err).__name__}: {err}"
    error = model.comm.broadcast_object(error)
    if error:
        raise CheckpointError(f"{call}: writing {path} failed on rank 0: {error}")


# ---- load ----------------------------------------------------------------------------------


def load_named_state(path: Path, state: dict[str, Any], engines: Sequence[EngineModel], call: str, strict: bool,
                     verify: bool, weights_only: Optional[bool]) -> dict[str, Any]:
    """Restore ``state``'s model, optimizers and other entries from a sharded checkpoint directory,
    a DeepSpeed checkpoint directory or a regular file, at any world size and stage; entries
    without a ``load_state_dict`` are replaced in ``state``. Returns what the checkpoint holds beyond
    ``state``. A collective."""
    named = split_state(state, engines, call)
    model = named.model
    held_back: set = set()  # entries the checkpoint holds but did not restore: see [Note: pickled objects]
    if is_sharded_checkpoint(path):
        rest, held_back = _load_sharded(path, named, call, strict, verify, weights_only)
    elif is_deepspeed_checkpoint(path):
        checkpoint = fit_to_module(read_deepspeed(path, model.comm), list(model.module.state_dict(keep_vars=True)))
        load_full_model(model, checkpoint["state_dict"], strict)
        if named.optimizers:
            chosen = named.with_optimizers(named.optimizer_keys)
            load_full_optimizers(chosen, [deepspeed_optimizer_state(checkpoint, chosen)])
            model.precision.load_state_dict(checkpoint.get(STATE_KEY, {}))
        rest = deepspeed_client_state(checkpoint)
    elif Path(path).is_file():
        rest = _load_file(path, named, call, strict, weights_only)
    else:
        raise FileNotFoundError(f"{call}: {path} is not a checkpoint: neither a sharded checkpoint directory (with "
                                "index.json), a DeepSpeed checkpoint directory, nor a file.")
    missing = [key for key in named.extras if key not in rest and key not in held_back]
    if strict and missing:
        raise KeyError(f"{call}: the state asks for {missing}, which the checkpoint at {path} does not hold (it holds "
                       f"{sorted(rest)}); pass strict=False to load the rest.")
    for key, obj in named.extras.items():
        if key in rest:
            value = rest.pop(key)
            if _stateful(obj):
                obj.load_state_dict(value)
            else:
                state[key] = value
    return rest


def _load_sharded(path: Path, named: NamedState, call: str, strict: bool, verify: bool,
                  weights_only: Optional[bool]) -> tuple[dict[str, Any], set]:
    """The checkpoint's entries beyond the model and optimizers, and the top-level keys of those not
    restored (held back without ``weights_only=False``: see [Note: pickled objects])."""
    model = named.model
    reader, rest, saved = open_sharded(path, model.comm, verify, weights_only,
                                       f"{call}(path, state, weights_only=False)")
    names = rest.pop(NAMES_KEY, None)
    precision = rest.pop(STATE_KEY, {})
    load_sharded_model(model, reader, saved, strict)
    if named.optimizer_keys:
        order = names["optimizers"] if names is not None else named.optimizer_keys  # a Trainer's: the state's order
        if sorted(order) != sorted(named.optimizer_keys):
            raise CheckpointError(f"{call}: the checkpoint at {path} holds the optimizers {order}, the state "
                                  f"{named.optimizer_keys}; pass the optimizers it was saved with, under the same "
                                  "names (or none, to load the model alone).")
        load_sharded_optimizers(named.with_optimizers(order), reader, saved)
        model.precision.load_state_dict(precision)
    return rest, {p[0] for p in saved["not_restored"] if p[0] not in rest}


def _load_file(path: Path, named: NamedState, call: str, strict: bool, weights_only: Optional[bool]) -> dict[str, Any]:
    model = named.model
    rest = dict(read_file(path, model.comm, weights_only))
    names = rest.pop(NAMES_KEY, None)  # a consolidated checkpoint of named state keeps the names
    lightning = "state_dict" in rest and named.module_key not in rest  # a Lightning checkpoint, or a consolidated one
    module_key = "state_dict" if lightning else named.module_key
    if module_key not in rest:
        raise CheckpointError(f"{call}: {path} holds no {named.module_key!r} (nor Lightning's 'state_dict'); its "
                              f"keys are {sorted(rest)[:10]}. Load it under the name it was saved with, or save it "
                              f"with fabric.save(path, {{{named.module_key!r}: model}}).")
    state_dict = rest.pop(module_key)
    load_full_model(model, state_dict, strict)
    if named.optimizer_keys:
        if lightning:
            order = names["optimizers"] if names is not None else named.optimizer_keys
            if sorted(order) != sorted(named.optimizer_keys):
                raise CheckpointError(f"{call}: {path} holds the optimizers {order}, the state {named.optimizer_keys}; "
                                      "pass the optimizers it was saved with, under the same names.")
            states = list(rest.pop("optimizer_states", []))
            load_full_optimizers(named.with_optimizers(order), states, state_dict)
        else:
            absent = [k for k in named.optimizer_keys if k not in rest]
            if absent:
                raise CheckpointError(f"{call}: {path} holds no optimizer state under {absent}; its keys are "
                                      f"{sorted(rest)[:10]}. Pass only the optimizers it was saved with.")
            states = [rest.pop(k) for k in named.optimizer_keys]
            load_full_optimizers(named.with_optimizers(named.optimizer_keys), states, state_dict)
        model.precision.load_state_dict(rest.get(STATE_KEY, {}))
    rest.pop(STATE_KEY, None)
    return rest
