"""Checkpoints of a module on the engine, in the forms every front end reads and writes.

[Note: one checkpoint format for every front end]
Each front end saves this package's sharded checkpoint directory (see [Note: checkpoint layout] in
checkpoint/store.py) through ``save_sharded_model``: every rank writes its pieces of the weights,
fp32 masters and optimizer state; rank 0 writes the front end's own state (the Trainer's loops and
callbacks, Fabric's extra objects, the DeepSpeed engine's counters and client state) into
``trainer_state.pt``, and the precision's under ``STATE_KEY`` ("ZeroPrecision"). So each loads the
others' checkpoints: the weights, optimizer state and loss scale always, the rest where it means
something to it. Loading reads three forms, each into any world size and stage:

- a sharded directory (``open_sharded``, then ``load_sharded_model`` / ``load_sharded_optimizers``):
  each rank reads only the ranges it owns;
- a whole state dict, from a regular file (DDP's, a consolidated one) or a DeepSpeed checkpoint
  directory (``read_file`` / ``read_deepspeed``, then ``load_full_model`` / ``load_full_optimizers``):
  stage 3 keeps its slices of each tensor, nothing gathered (see [Note: loading a full state dict] in
  engine/params/whole_state.py);
- either way the fp32 masters of bf16/fp16 weights are restored from the most precise values the
  checkpoint holds (its masters, or fp32 weights), never from the rounded working weights.
A load that fails on one rank fails on every rank (``on_every_rank``), so none waits in a collective.
"""

from __future__ import annotations

import contextlib
import io
import warnings
import zipfile
from collections.abc import Iterator, Mapping
from typing import Any, Optional, Sequence

import torch
from torch import nn

from ..checkpoint import (CheckpointError, CheckpointReader, align_optimizer_state, load_model, load_optimizers,
                          read_deepspeed_checkpoint, save_sharded)
from ..checkpoint.format import PICKLED_OBJECTS, PickledObjectsWarning
from ..checkpoint.pickled import dotted, load_pickled, merge_pickled
from ..checkpoint.sharded import masters_from_state_dict, on_every_rank, parameter_names
from ..engine import Collectives
from ..engine.params.flat_parameters import gathered_parameters, owners_of
from .precision import STATE_KEY
from .setup import EngineModel

ZERO_RECORD = "zero_checkpoint"  # the entry of trainer_state.pt that save_sharded adds (see checkpoint/sharded.py)
# keys read_deepspeed_checkpoint adds to DeepSpeed's client state (its own, and Lightning's defaults)
_DEEPSPEED_READER_KEYS = {"state_dict", "optimizer_states", "deepspeed", STATE_KEY}
_LIGHTNING_DEFAULTS = {"pytorch-lightning_version", "global_step", "lr_schedulers"}


def check_safe_to_load(state: dict[str, Any], call: str) -> None:
    """What rank 0 will write must load with ``weights_only=True``: say so at save, not at resume."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, ...
        raise ValueError(f"{call}: the state holds objects that a safe load (torch.load(weights_only=True)) refuses: "
                         f"{err}. Keep it to tensors, numbers, strings, lists and dicts (objects with a state_dict() "
                         "are saved as their state dict).") from None


# ---- save ----------------------------------------------------------------------------------


def save_sharded_model(path: Any, state: dict[str, Any], model: EngineModel) -> None:
    """Write ``state`` (the front end's own, saved by rank 0) and the engine's weights, masters and,
    when ``state`` has an ``"optimizer_states"`` key, optimizer state (each rank its pieces) as a
    sharded checkpoint directory, atomically. A collective. With ``async_save`` it returns once the
    tensors are copied out, and the files are written in the background (see [Note: saving in the
    background] in checkpoint/background.py)."""
    with whole_modules_in(state, model):
        save_sharded(path, state, model.module, model.optimizers, model.sharder, model.comm, model.stage,
                     background=model.saver)


@contextlib.contextmanager
def whole_modules_in(state: Any, model: EngineModel) -> Iterator[None]:
    """Stage 3: the modules of ``model`` that ``state`` holds (a network in Lightning's hyper-parameters)
    gathered while ``state`` is pickled, so that the pickle holds their whole weights (see [Note: a
    module's copies hold what the user sees] in engine/params/attached.py). A collective: every rank's
    ``state`` holds the same modules (the same code built it)."""
    found = [m for m in _modules_in(state, set()) if owners_of(m)] if model.stage == 3 else []
    if not found:
        yield
        return
    with gathered_parameters([p for m in found for p in m.parameters()]):
        yield


def _modules_in(value: Any, seen: set[int]) -> Iterator[nn.Module]:
    """The modules in ``value``'s dicts, lists and tuples (not inside a module, nor tensors)."""
    if id(value) in seen or isinstance(value, torch.Tensor):
        return
    seen.add(id(value))
    if isinstance(value, nn.Module):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _modules_in(item, seen)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _modules_in(item, seen)


# ---- open ----------------------------------------------------------------------------------


def open_sharded(path: Any, comm: Collectives, verify: bool = True, weights_only: Optional[bool] = None,
                 opt_in: str = "weights_only=False") -> tuple[CheckpointReader, dict, dict]:
    """A sharded checkpoint directory: its reader, the front end's state (``trainer_state.pt`` without
    the engine's record) and that record. Raises on every rank, naming what is wrong, for anything
    else (a missing or damaged file, a partial save, another package's directory).

    Objects a safe load refuses, saved beside the state (see [Note: pickled objects] in
    checkpoint/pickled.py), are put back into it only with ``weights_only=False``; otherwise rank 0
    warns, naming them and ``opt_in`` (the call that restores them), and ``saved["not_restored"]``
    lists their key paths."""
    opened: dict[str, Any] = {}
    restore = weights_only is False

    def open_() -> None:
        reader = CheckpointReader(path, verify=verify)
        opened.update(reader=reader, state=reader.trainer_state(weights_only))
        paths = [tuple(p) for p in opened["state"].get(ZERO_RECORD, {}).get("pickled_objects", [])]
        opened["pickled"] = load_pickled(reader.checked_bytes(PICKLED_OBJECTS)) if paths and restore else {}
        opened["paths"] = paths

    on_every_rank(comm, open_)
    state = opened["state"]
    saved = state.pop(ZERO_RECORD, None)
    if saved is None:
        raise CheckpointError(f"{path} has no {ZERO_RECORD} entry in its trainer state: it was not written by this "
                              "package (ZeroStrategy, ZeroFabricStrategy or initialize's save_checkpoint).")
    merge_pickled(state, opened["pickled"])
    saved["not_restored"] = [] if restore else opened["paths"]
    if saved["not_restored"] and comm.rank == 0:
        names = ", ".join(dotted(p) for p in saved["not_restored"])
        warnings.warn(f"{path} holds objects that only full unpickling loads, saved beside its state in "
                      f"{PICKLED_OBJECTS}: {names}. They were not restored (a safe load never unpickles them). If "
                      f"you trust this checkpoint, restore them too with {opt_in}.", PickledObjectsWarning,
                      stacklevel=3)
    return opened["reader"], state, saved


def read_deepspeed(path: Any, comm: Collectives) -> dict[str, Any]:
    """A DeepSpeed checkpoint directory as a whole state dict and optimizer state (see
    ``read_deepspeed_checkpoint``), read on every rank."""
    read: list[dict[str, Any]] = []
    on_every_rank(comm, lambda: read.append(read_deepspeed_checkpoint(path)))
    return read[0]


def read_state_dict_file(path: Any, weights_only: Optional[bool] = None) -> Any:
    """A file of a state dict (``torch.save(model.state_dict(), path)``), its tensors memory-mapped when
    torch's zip format allows (every ``torch.save`` since torch 1.6): loading it into a stage-3 model
    then reads only this rank's slices of the file (see [Note: loading a full state dict] in
    engine/params/whole_state.py), never the whole model."""
    safe = True if weights_only is None else weights_only
    return torch.load(path, map_location="cpu", weights_only=safe, mmap=zipfile.is_zipfile(path))


def read_file(path: Any, comm: Collectives, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """A regular checkpoint file, on every rank; never unpickling arbitrary objects unless
    ``weights_only=False`` is passed for a file you trust."""
    read: list[Any] = []
    safe = True if weights_only is None else weights_only
    on_every_rank(comm, lambda: read.append(torch.load(path, map_location="cpu", weights_only=safe)))
    if not isinstance(read[0], dict):
        raise CheckpointError(f"{path} holds a {type(read[0]).__name__}, not a checkpoint dict (names to state dicts "
                              "and values); save one with torch.save({'model': model.state_dict(), ...}).")
    return read[0]


# ---- load ----------------------------------------------------------------------------------


def load_sharded_model(model: EngineModel, reader: CheckpointReader, saved: dict[str, Any], strict: bool) -> None:
    """Weights, buffers and masters from a sharded checkpoint: each rank reads its own ranges."""
    on_every_rank(model.comm, lambda: load_model(reader, saved, model.module, model.groups, strict))


def load_sharded_optimizers(model: EngineModel, reader: CheckpointReader, saved: dict[str, Any]) -> None:
    """Every optimizer's state (and the masters) from a sharded checkpoint; the checkpoint's optimizers
    in ``model.optimizers``' order."""
    on_every_rank(model.comm, lambda: load_optimizers(reader, saved, model.module, model.optimizers))


@torch.no_grad()
def load_full_model(model: EngineModel, state_dict: dict[str, Any], strict: bool = True) -> None:
    """Whole tensors into the engine, at any stage: stage 3 keeps its slices of each tensor; stages 1-2
    load the module, then refresh the masters from the loaded weights. Then the masters take the state
    dict's values where they are more precise than the working weights. A load that fails on one rank
    fails on every rank."""
    if model.sharder is not None and model.stage == 3:
        on_every_rank(model.comm, lambda: model.sharder.load_full_state_dict(state_dict, strict=strict))
    else:
        on_every_rank(model.comm, lambda: model.module.load_state_dict(state_dict, strict=strict))
        for g in model.groups:
            g.masters_from_weights()
    if model.optimizers:
        masters_from_state_dict(state_dict, model.module, model.optimizers)


def load_full_optimizers(model: EngineModel, states: Sequence[dict[str, Any]],
                         state_dict: Optional[dict[str, Any]] = None) -> None:
    """Optimizer state dicts in torch's unsharded layout into ``model.optimizers`` (each rank keeps its
    pieces); then the masters from ``state_dict`` where it is more precise than the working weights."""
    if len(states) != len(model.optimizers):
        raise CheckpointError(f"the checkpoint holds {len(states)} optimizer states for {len(model.optimizers)} "
                              "optimizers; load it with the optimizers it was saved with.")
    for optimizer, state in zip(model.optimizers, states):
        on_every_rank(model.comm, lambda optimizer=optimizer, state=state: optimizer.load_state_dict(state))
    if state_dict is not None:
        masters_from_state_dict(state_dict, model.module, model.optimizers)


def deepspeed_client_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What the caller of DeepSpeed's ``save_checkpoint`` passed as ``client_state``, from a ``read_deepspeed``
    result (Lightning's DeepSpeedStrategy puts the Trainer's loops there, Fabric's its extra objects)."""
    keys = checkpoint["deepspeed"].get("client_keys")
    if keys is None:  # the reader does not list them: its own keys and Lightning's defaults are not client state
        keys = [k for k in checkpoint if k not in _DEEPSPEED_READER_KEYS | _LIGHTNING_DEFAULTS]
    return {k: checkpoint[k] for k in keys if k in checkpoint}


def deepspeed_optimizer_state(checkpoint: dict[str, Any], model: EngineModel) -> dict[str, Any]:
    """The optimizer state of a DeepSpeed checkpoint (``read_deepspeed``) renumbered for the one
    optimizer of ``model``: DeepSpeed kept the trainable parameters only, numbered by name."""
    if len(model.optimizers) != 1:
        raise CheckpointError(f"a DeepSpeed checkpoint holds one optimizer, this run has {len(model.optimizers)}; load "
                              "it into a module with one optimizer.")
    names = parameter_names(model.module)
    groups = [[names[p] for p in group["params"]] for group in model.optimizers[0].param_groups]
    return align_optimizer_state(checkpoint, groups)
