"""``ZeroEngine.save_checkpoint`` and ``load_checkpoint``: DeepSpeed's directory layout around this
package's sharded checkpoints, and DeepSpeed's own checkpoints read back.

[Note: the engine's checkpoint layout]
``save_dir/<tag>/`` is a sharded checkpoint (see [Note: checkpoint layout] in checkpoint/store.py):
each rank writes its pieces of the weights, fp32 masters and optimizer state, and rank 0 the index
and trainer_state.pt, which holds the engine's counters, LR scheduler and loss scaler state under
``zero_engine`` and the caller's ``client_state``. After the save is complete on every rank, rank 0
writes ``save_dir/latest`` naming the tag (atomically), as DeepSpeed does; a failed save leaves
both the previous tag folder and ``latest`` as they were. Files describe parameters, not buffers,
so any world size and stage loads them. ``load`` also takes a directory DeepSpeed wrote
(``engine.save_checkpoint``'s layout, stages 1-3): read whole, without DeepSpeed, by
``read_deepspeed_checkpoint``, then loaded into this engine at its own world size and stage.
"""

from __future__ import annotations

import io
import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..checkpoint import (CheckpointError, CheckpointReader, is_sharded_checkpoint, load_model, load_optimizers,
                          save_sharded)
from ..checkpoint.deepspeed import align_optimizer_state, is_deepspeed_checkpoint, read_deepspeed_checkpoint
from ..checkpoint.files import atomic_write
from ..checkpoint.sharded import flat_groups, masters_from_state_dict, on_every_rank, parameter_names

if TYPE_CHECKING:
    from .engine import ZeroEngine

log = logging.getLogger(__name__)

LATEST = "latest"
ENGINE_STATE = "zero_engine"
CLIENT_STATE = "client_state"
# keys read_deepspeed_checkpoint adds to DeepSpeed's client state (its own, and Lightning's defaults)
_READER_KEYS = {"state_dict", "optimizer_states", "deepspeed", "ZeroPrecision"}
_LIGHTNING_DEFAULTS = {"pytorch-lightning_version", "global_step", "lr_schedulers"}


# ---- save ----------------------------------------------------------------------------------


def _check_tag(engine: "ZeroEngine", tag: str) -> None:
    if not tag or tag in (".", "..") or "/" in tag or "\\" in tag:
        raise ValueError(f"save_checkpoint(tag={tag!r}): a tag is the name of one folder in save_dir, such as "
                         "'global_step100'; give a name without path separators.")
    tags = engine.comm.all_gather_object(tag)
    if len(set(tags)) > 1:
        raise ValueError(f"save_checkpoint(): the ranks gave different tags, {tags} by rank; every rank must save "
                         "under the same tag (derive it from engine.global_steps, not from the time or the rank).")


def _engine_state(engine: "ZeroEngine") -> dict[str, Any]:
    scaler = engine.precision.scaler
    return {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps, "micro_steps": engine.micro_steps,
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "loss_scaler": scaler.state_dict() if scaler is not None else None,
            "stage": engine.zero_optimization_stage(), "world_size": engine.world_size, "ds_config": engine.config}


def _check_loadable(state: dict[str, Any]) -> None:
    """What rank 0 will write must load with ``weights_only=True``: say so at save, not at resume."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, ...
        raise ValueError(f"save_checkpoint(client_state=...): the state holds objects that a safe load "
                         f"(torch.load(weights_only=True)) refuses: {err}. Keep client_state to tensors, numbers, "
                         "strings, lists and dicts.") from None


def save(engine: "ZeroEngine", save_dir: Any, tag: Any, client_state: Optional[dict], save_latest: bool,
         exclude_frozen_parameters: bool) -> bool:
    """See ``ZeroEngine.save_checkpoint`` and [Note: the engine's checkpoint layout]. A collective."""
    if exclude_frozen_parameters:
        raise ValueError("save_checkpoint(exclude_frozen_parameters=True) is not supported: frozen parameters are "
                         "always saved (once, by rank 0 at stages 1-2), so the checkpoint loads into the whole model; "
                         "drop the argument.")
    if client_state is not None and not isinstance(client_state, dict):
        raise TypeError(f"save_checkpoint(client_state={type(client_state).__name__}): give a dict.")
    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
    _check_tag(engine, tag)
    state = {ENGINE_STATE: _engine_state(engine), CLIENT_STATE: dict(client_state or {})}
    _check_loadable(state)
    if engine.optimizer is not None:
        state["optimizer_states"] = []  # the flag for save_sharded: write the optimizer's pieces too
    optimizers = [engine.optimizer] if engine.optimizer is not None else []
    folder = Path(save_dir) / tag
    save_sharded(folder, state, engine.module, optimizers, engine.sharder, engine.comm, engine.zero_config.stage)
    error = ""
    if save_latest and engine.comm.rank == 0:
        try:
            atomic_write(Path(save_dir) / LATEST, lambda tmp: tmp.write_text(tag))
        except OSError as err:
            error = f"{type(err).__name__}: {err}"
    error = engine.comm.broadcast_object(error)
    if error:
        raise CheckpointError(f"saved {folder}, but writing {Path(save_dir) / LATEST} failed: {error}; load the save "
                              f"with load_checkpoint(..., tag={tag!r}).")
    return True


# ---- load ----------------------------------------------------------------------------------


def _folder(load_dir: Path, tag: Any) -> Optional[Path]:
    """The save to load: ``load_dir/tag``, else the one ``latest`` names, else ``load_dir`` itself
    when it is one save; None when there is nothing to load (DeepSpeed's "no latest")."""
    if tag is not None:
        folder = load_dir / str(tag)
        if not folder.is_dir():
            there = sorted(p.name for p in load_dir.iterdir() if p.is_dir()) if load_dir.is_dir() else []
            raise FileNotFoundError(f"load_checkpoint(tag={tag!r}): {folder} does not exist; the folders in "
                                    f"{load_dir} are {there or 'none'}.")
        return folder
    latest = load_dir / LATEST
    if latest.is_file():
        named = latest.read_text().strip()
        if not (load_dir / named).is_dir():
            raise CheckpointError(f"{latest} names the tag {named!r}, but {load_dir / named} does not exist: the save "
                                  "did not finish or the folder was removed. Pass tag= the save to load.")
        return load_dir / named
    if is_sharded_checkpoint(load_dir) or is_deepspeed_checkpoint(load_dir):
        return load_dir
    return None


def load(engine: "ZeroEngine", load_dir: Any, tag: Any, strict: bool, load_optimizer_states: bool,
         load_lr_scheduler_states: bool, load_module_only: bool, custom_load_fn: Any) -> tuple[Any, Any]:
    """See ``ZeroEngine.load_checkpoint``. A collective."""
    if custom_load_fn is not None:
        raise ValueError("load_checkpoint(custom_load_fn=...) is not supported: weights load into the engine's shards "
                         "directly. Drop the argument, and change the weights after loading inside "
                         "zero_strategy.gathered_parameters(engine.module, modifier_rank=0).")
    load_dir = Path(load_dir)
    folder = _folder(load_dir, tag)
    if folder is None:
        log.warning("load_checkpoint: %s has no %s file, so there is nothing to load (returning None, None as "
                    "DeepSpeed does); pass tag= to load a particular save.", load_dir, LATEST)
        return None, None
    with_optimizer = load_optimizer_states and not load_module_only and engine.optimizer is not None
    with_scheduler = load_lr_scheduler_states and not load_module_only and engine.lr_scheduler is not None
    if is_sharded_checkpoint(folder):
        client = _load_sharded(engine, folder, strict, with_optimizer, with_scheduler, not load_module_only)
    elif is_deepspeed_checkpoint(folder):
        client = _load_deepspeed(engine, folder, strict, with_optimizer, with_scheduler, not load_module_only)
    else:
        raise CheckpointError(f"{folder} is neither a checkpoint saved by save_checkpoint (no index.json) nor a "
                              "DeepSpeed one (no *_model_states.pt); give the directory passed to save_checkpoint.")
    return str(folder), client


def _restore_counters(engine: "ZeroEngine", counters: dict[str, Any]) -> None:
    for name in ("global_steps", "global_samples", "skipped_steps", "micro_steps"):
        if counters.get(name) is not None:
            setattr(engine, name, int(counters[name]))


def _load_sharded(engine: "ZeroEngine", folder: Path, strict: bool, with_optimizer: bool, with_scheduler: bool,
                  with_counters: bool) -> dict:
    reader = CheckpointReader(folder)
    state = reader.trainer_state()
    saved, ours = state.get("zero_checkpoint"), state.get(ENGINE_STATE)
    if saved is None or ours is None:
        raise CheckpointError(f"{folder} was not written by the engine's save_checkpoint (its trainer state has no "
                              f"{ENGINE_STATE!r}): a ZeroStrategy checkpoint resumes with Trainer.fit(ckpt_path=...); "
                              "for this engine, consolidate it (zero-consolidate) and load its state_dict.")
    optimizer = engine.optimizer
    groups = flat_groups([optimizer] if optimizer is not None else [], engine.sharder)
    on_every_rank(engine.comm, lambda: load_model(reader, saved, engine.module, groups, strict))
    if with_optimizer:
        on_every_rank(engine.comm, lambda: load_optimizers(reader, saved, engine.module, [optimizer]))
        if engine.precision.scaler is not None and ours.get("loss_scaler"):
            engine.precision.scaler.load_state_dict(ours["loss_scaler"])
    if with_scheduler and ours.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(ours["lr_scheduler"])
    if with_counters:
        _restore_counters(engine, ours)
    return dict(state.get(CLIENT_STATE, {}))


def _load_deepspeed(engine: "ZeroEngine", folder: Path, strict: bool, with_optimizer: bool, with_scheduler: bool,
                    with_counters: bool) -> dict:
    read: list[dict[str, Any]] = []
    on_every_rank(engine.comm, lambda: read.append(read_deepspeed_checkpoint(folder)))
    checkpoint = read[0]
    state_dict = checkpoint["state_dict"]
    if engine.sharder is not None:  # a collective: every rank gathers each unit once
        engine.sharder.load_full_state_dict(state_dict, strict=strict)
    else:
        on_every_rank(engine.comm, lambda: engine.module.load_state_dict(state_dict, strict=strict))
    if engine.optimizer is not None:  # fp32 values into the masters: through bf16 weights they would round
        masters_from_state_dict(state_dict, engine.module, [engine.optimizer])
    source = checkpoint["deepspeed"]
    if with_optimizer:
        assert engine.optimizer is not None
        names = parameter_names(engine.module)
        param_names = [[names[p] for p in group["params"]] for group in engine.optimizer.param_groups]
        aligned = align_optimizer_state(checkpoint, param_names)
        on_every_rank(engine.comm, lambda: engine.optimizer.load_state_dict(aligned))
        scaler = checkpoint.get("ZeroPrecision", {}).get("loss_scaler")
        if engine.precision.scaler is not None and scaler:
            engine.precision.scaler.load_state_dict(scaler)
    if with_scheduler and source.get("lr_scheduler"):
        _load_deepspeed_scheduler(engine.lr_scheduler, source["lr_scheduler"])
    if with_counters:
        _restore_counters(engine, source)
    keys = source.get("client_keys")
    if keys is None:  # the reader does not list them: its own keys and Lightning's defaults are not client state
        keys = [k for k in checkpoint if k not in _READER_KEYS | _LIGHTNING_DEFAULTS]
    return {k: checkpoint[k] for k in keys if k in checkpoint}


def _load_deepspeed_scheduler(scheduler: Any, state: dict[str, Any]) -> None:
    """DeepSpeed's schedules save ``{"last_batch_iteration": i}``; the same schedule here sits at
    ``last_epoch = i + 1`` (see [Note: DeepSpeed's iteration count] in schedulers.py). Any other
    state is a torch scheduler's own, loaded as it is."""
    if set(state) == {"last_batch_iteration"} and hasattr(scheduler, "lrs_at"):
        scheduler.last_epoch = int(state["last_batch_iteration"])
        with warnings.catch_warnings():  # the optimizer has not stepped in this process yet, on purpose
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            scheduler.step()  # to last_epoch = i + 1, setting the learning rates (and OneCycle's momenta)
        return
    try:
        scheduler.load_state_dict(state)
    except Exception as err:  # noqa: BLE001 - whatever the scheduler class raises
        raise CheckpointError(f"the DeepSpeed checkpoint's LR scheduler state {sorted(state)} does not load into "
                              f"{type(scheduler).__name__} ({err}); build the scheduler the DeepSpeed run used, or "
                              "pass load_lr_scheduler_states=False.") from None
