"""``ZeroEngine.save_checkpoint`` and ``load_checkpoint``: DeepSpeed's directory layout around this
package's sharded checkpoints, and DeepSpeed's own checkpoints read back.

[Note: the engine's checkpoint layout]
``save_dir/<tag>/`` is a sharded checkpoint (see [Note: one checkpoint format for every front end]
in frontend/checkpoint.py): each rank writes its pieces of the weights, fp32 masters and optimizer
state, and rank 0 the index and trainer_state.pt, which holds the engine's counters and LR scheduler
state under ``zero_engine``, the caller's ``client_state``, and the loss scaler under
``ZeroPrecision``, where the Trainer and Fabric read it too. After the save is complete on every
rank, rank 0 writes ``save_dir/latest`` naming the tag (atomically), as DeepSpeed does; a failed save
leaves both the previous tag folder and ``latest`` as they were. Files describe parameters, not buffers,
so any world size and stage loads them. ``load`` also takes a directory DeepSpeed wrote
(``engine.save_checkpoint``'s layout, stages 1-3): read whole, without DeepSpeed, by
``read_deepspeed_checkpoint``, then loaded into this engine at its own world size and stage.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, Optional, Protocol

from torch import nn

from ..checkpoint import CheckpointError, is_sharded_checkpoint
from ..checkpoint.deepspeed import is_deepspeed_checkpoint
from ..checkpoint.files import atomic_write
from ..engine import Collectives
from ..frontend import (STATE_KEY, check_safe_to_load, deepspeed_client_state, deepspeed_optimizer_state,
                        load_full_model, load_full_optimizers, load_sharded_model, load_sharded_optimizers,
                        open_sharded, read_deepspeed, save_sharded_model)
from ..frontend.setup import EngineModel

log = logging.getLogger(__name__)

LATEST = "latest"
ENGINE_STATE = "zero_engine"
CLIENT_STATE = "client_state"


class ZeroEngine(Protocol):
    """What saving and loading read and set of a ``ZeroEngine`` (engine.py, which calls this module: a
    Protocol instead of an import keeps the two modules out of an import circle)."""

    module: nn.Module
    engine_model: EngineModel
    comm: Collectives
    optimizer: Optional[Any]
    lr_scheduler: Optional[Any]
    precision: Any  # frontend.precision's engine precision: the loss scaler's state
    config: dict
    world_size: int
    global_steps: int
    global_samples: int
    skipped_steps: int
    micro_steps: int

    def zero_optimization_stage(self) -> int: ...


# ---- save ----------------------------------------------------------------------------------


def save_16bit_model(engine: "ZeroEngine", save_dir: Any, save_filename: str, exclude_frozen: bool) -> bool:
    if not isinstance(save_filename, str) or not save_filename or "/" in save_filename:
        raise ValueError(f"save_16bit_model(save_filename={save_filename!r}): give a file name (no folder), such as "
                         "'pytorch_model.bin'; the folder is save_dir.")
    state = engine.engine_model.full_state_dict()  # a collective at stage 3: every rank gathers
    if exclude_frozen:
        frozen = {name for name, p in engine.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
        state = {k: v for k, v in state.items() if k not in frozen}
    if engine.comm.rank == 0:
        import torch

        folder = Path(save_dir)
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(folder / save_filename, lambda tmp: torch.save(state, tmp))
    engine.comm.all_gather_object(None)  # no rank returns before the file is there
    return True


def _check_tag(engine: "ZeroEngine", tag: str) -> None:
    if not tag or tag in (".", "..") or "/" in tag or "\\" in tag:
        raise ValueError(f"save_checkpoint(tag={tag!r}): a tag is the name of one folder in save_dir, such as "
                         "'global_step100'; give a name without path separators.")
    tags = engine.comm.all_gather_object(tag)
    if len(set(tags)) > 1:
        raise ValueError(f"save_checkpoint(): the ranks gave different tags, {tags} by rank; every rank must save "
                         "under the same tag (derive it from engine.global_steps, not from the time or the rank).")


def _engine_state(engine: "ZeroEngine") -> dict[str, Any]:
    return {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps, "micro_steps": engine.micro_steps,
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "stage": engine.zero_optimization_stage(), "world_size": engine.world_size, "ds_config": engine.config}


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
    state = {ENGINE_STATE: _engine_state(engine), CLIENT_STATE: dict(client_state or {}),
             STATE_KEY: engine.precision.state_dict()}  # the loss scale where every front end reads it
    check_safe_to_load(state, "save_checkpoint(client_state=...)")
    if engine.optimizer is not None:
        state["optimizer_states"] = []  # the flag for save_sharded: write the optimizer's pieces too
    folder = Path(save_dir) / tag
    save_sharded_model(folder, state, engine.engine_model)
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
    reader, state, saved = open_sharded(folder, engine.comm)
    ours = state.get(ENGINE_STATE)
    if ours is None:
        raise CheckpointError(f"{folder} was not written by the engine's save_checkpoint (its trainer state has no "
                              f"{ENGINE_STATE!r}): a ZeroStrategy checkpoint resumes with Trainer.fit(ckpt_path=...); "
                              "for this engine, consolidate it (zero-consolidate) and load its state_dict.")
    load_sharded_model(engine.engine_model, reader, saved, strict)
    if with_optimizer:
        load_sharded_optimizers(engine.engine_model, reader, saved)
        # where every front end writes it; an earlier save of this engine kept it in its own state
        engine.precision.load_state_dict(state.get(STATE_KEY) or {"loss_scaler": ours.get("loss_scaler")})
    if with_scheduler and ours.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(ours["lr_scheduler"])
    if with_counters:
        _restore_counters(engine, ours)
    return dict(state.get(CLIENT_STATE, {}))


def _load_deepspeed(engine: "ZeroEngine", folder: Path, strict: bool, with_optimizer: bool, with_scheduler: bool,
                    with_counters: bool) -> dict:
    checkpoint = read_deepspeed(folder, engine.comm)
    state_dict = checkpoint["state_dict"]
    load_full_model(engine.engine_model, state_dict, strict)  # fp32 values into the masters too
    source = checkpoint["deepspeed"]
    if with_optimizer:
        load_full_optimizers(engine.engine_model, [deepspeed_optimizer_state(checkpoint, engine.engine_model)])
        engine.precision.load_state_dict(checkpoint.get(STATE_KEY, {}))
    if with_scheduler and source.get("lr_scheduler"):
        _load_deepspeed_scheduler(engine.lr_scheduler, source["lr_scheduler"])
    if with_counters:
        _restore_counters(engine, source)
    return deepspeed_client_state(checkpoint)


def _load_deepspeed_scheduler(scheduler: Any, state: dict[str, Any]) -> None:
    """DeepSpeed's schedules save ``{"last_batch_iteration": i}``; the same schedule here sits at
    ``last_epoch = i + 1`` (see [Note: DeepSpeed's iteration count] in deepspeed/schedulers.py). Any other
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
