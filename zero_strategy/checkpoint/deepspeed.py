"""DeepSpeed ZeRO checkpoints (stages 1-3; fp32, fp16 or bf16) read as regular Lightning checkpoints.

``read_deepspeed_checkpoint`` puts a checkpoint written by DeepSpeed's ``engine.save_checkpoint`` (or
Lightning's DeepSpeedStrategy) back together as the dict a single-process run would have saved:
whole fp32 weights, the optimizer state in torch's unsharded layout, and the client state. Loading
that dict is this package's regular path, so any world size and stage can resume from it.
``consolidate_deepspeed_checkpoint`` writes it as one file. No DeepSpeed install is needed, and no
pickled code runs: see [Note: safe unpickling of DeepSpeed files] in checkpoint/deepspeed_files.py.

[Note: DeepSpeed flat partitions]
DeepSpeed steps one flat fp32 tensor per param group (stage 3: per sub-group), cut into one
partition per rank; each rank's optimizer file holds its partition of the master weights and of
every elementwise optimizer state (exp_avg...), all laid out alike. ``param_shapes`` (in the
model file) lists the trainable parameters of each flat tensor in their order there.
- Stages 1-2: the ranks' partitions, joined in rank order, are the flat tensor: the parameters one
  after the other, each followed by ``param_alignment_paddings`` elements. The masters are saved
  without the padding at the group's end; the optimizer state with it.
- Stage 3: every parameter is cut into world_size equal parts (ceil(numel / world_size), the last
  zero-padded); rank r's flat tensor is part r of each parameter, one after the other.
Frozen parameters are not in the flat tensors: stage 1 keeps them whole in the model file's module
state dict (working dtype), stage 2 in ``frozen_param_fragments`` whole, stage 3 there as each rank's
part. Tied parameters are stored once, under their first name; ``shared_params`` maps the others.
"""

from __future__ import annotations

import importlib.metadata
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from safetensors.torch import save

from .deepspeed_files import (DeepSpeedFiles, atomic_write, check_world_size, find_files, is_deepspeed_checkpoint,
                              load_safely, tag_folder)
from .store import CheckpointError

__all__ = ["align_optimizer_state", "consolidate_deepspeed_checkpoint", "fit_to_module", "is_deepspeed_checkpoint",
           "read_deepspeed_checkpoint"]

# DeepSpeed's own entries of the model file; every other entry is the caller's client state
_DEEPSPEED_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                   "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps",
                   "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
                   "checkpoint_parallel_dimensions", "universal_checkpoint_info", "sparse_tensor_module_names"}


@dataclass
class _Group:
    """One torch param group as the source optimizer had it: its trainable parameters (by name, in
    flat order), their fp32 masters and their optimizer state."""

    hyper: dict[str, Any]
    names: list[str] = field(default_factory=list)
    masters: dict[str, torch.Tensor] = field(default_factory=dict)
    state: dict[str, dict[str, Any]] = field(default_factory=dict)


def read_deepspeed_checkpoint(path: Any, tag: Optional[str] = None) -> dict[str, Any]:
    """A DeepSpeed ZeRO checkpoint as a Lightning checkpoint dict.

    ``path`` is the directory given to ``engine.save_checkpoint`` (its ``latest`` file names the
    save to read unless ``tag`` does) or one tag folder. The result holds ``state_dict`` (every
    key of the module's state dict: fp32 weights from DeepSpeed's fp32 masters where it kept them,
    tied weights as one tensor under each name, frozen weights and buffers, half-precision ones
    in fp32), ``optimizer_states`` (one state dict in torch's unsharded layout, parameters numbered
    in param-group order), the client state (Lightning's ``epoch``, ``loops``, ``callbacks``,
    ``lr_schedulers``... when Lightning's DeepSpeedStrategy saved it) and ``deepspeed``, which
    describes the source: stage, world_size, dtype, tag, version, step counters, the parameter
    names of each param group, DeepSpeed's LR scheduler and loss scaler state. A plain DeepSpeed
    checkpoint also gets the few keys Lightning needs to resume (``pytorch-lightning_version``,
    ``global_step``, an empty ``lr_schedulers``); an fp16 one gets its loss scale under
    ``ZeroPrecision``. Raises CheckpointError, naming the file, for missing, damaged or
    unsupported files.
    """
    folder = tag_folder(Path(path), tag)
    files = find_files(folder)
    optim_files = [load_safely(f) for f in files.optimizer_files]
    optims = [_optimizer_entry(f, p) for f, p in zip(optim_files, files.optimizer_files)]
    stage, world_size = _stage_and_world_size(optims, files)
    check_world_size(files, world_size)
    model_paths = files.model_files(stage)
    models = [load_safely(p) for p in model_paths]
    for model, p in zip(models, model_paths):
        if not isinstance(model.get("module"), dict) or model.get("param_shapes") is None:
            raise CheckpointError(f"{p} has no module state dict or no param_shapes: it was not saved by a ZeRO engine "
                                  "with an optimizer, so the weights cannot be put back together.")
    groups = _groups_stage3(optims, models[0], world_size, folder) if stage == 3 else \
        _groups_stage12(optims, models[0], folder)
    masters = {name: value for g in groups for name, value in g.masters.items()}
    state_dict = _state_dict(stage, models, masters, folder)
    model = models[0]
    client = {k: v for k, v in model.items() if k not in _DEEPSPEED_KEYS}
    checkpoint = {**client, "state_dict": state_dict, "optimizer_states": [_torch_layout(groups)]}
    first = groups[0].names[0] if groups and groups[0].names else None
    scaler = optims[0].get("loss_scaler")
    checkpoint["deepspeed"] = {
        "stage": stage, "world_size": world_size, "tag": folder.name, "version": model.get("ds_version"),
        "dtype": str(model["module"][first].dtype).removeprefix("torch.") if first in model["module"] else None,
        "global_steps": model.get("global_steps"), "global_samples": model.get("global_samples"),
        "skipped_steps": model.get("skipped_steps"), "param_names": [list(g.names) for g in groups],
        "lr_scheduler": model.get("lr_scheduler"), "loss_scaler": scaler, "config": model.get("ds_config"),
        "client_keys": sorted(client),  # what the saver's client_state held
    }
    _lightning_defaults(checkpoint, model)
    if checkpoint["deepspeed"]["dtype"] == "float16" and isinstance(scaler, dict):
        checkpoint.setdefault("ZeroPrecision", {"loss_scaler": _loss_scaler(scaler, model.get("skipped_steps", 0))})
    return checkpoint


def _optimizer_entry(saved: dict[str, Any], path: Path) -> dict[str, Any]:
    entry = saved.get("optimizer_state_dict")
    if not isinstance(entry, dict) or "zero_stage" not in entry:
        raise CheckpointError(f"{path} has no ZeRO optimizer state (no optimizer_state_dict.zero_stage): it was "
                              "written by DeepSpeed's BF16_Optimizer (bf16 with ZeRO stage 1 and fp32 gradient "
                              "accumulation) or is not a DeepSpeed optimizer file; this reader reads ZeRO stages 1-3. "
                              "Export the weights with DeepSpeed's zero_to_fp32.py instead.")
    return entry


def _stage_and_world_size(optims: list[dict[str, Any]], files: DeepSpeedFiles) -> tuple[int, int]:
    first = optims[0]
    counts = first.get("partition_count")
    world_size = max(counts) if isinstance(counts, (list, tuple)) else int(counts)
    stage = int(first["zero_stage"])
    if stage not in (1, 2, 3):
        raise CheckpointError(f"{files.optimizer_files[0]} records ZeRO stage {stage}; stages 1, 2 and 3 are read.")
    for entry, path in zip(optims[1:], files.optimizer_files[1:]):
        if int(entry["zero_stage"]) != stage or entry.get("partition_count") != counts:
            raise CheckpointError(f"{path} records stage {int(entry['zero_stage'])} and partition count "
                                  f"{entry.get('partition_count')}, rank 0's file stage {stage} and {counts}: the "
                                  "files come from different saves. Keep the files of one save together.")
    return stage, world_size


# ---- the flat partitions (see [Note: DeepSpeed flat partitions]) ---------------------------


def _rank_states(entries: list[dict[str, Any]], where: str) -> dict[str, Any]:
    """One flat tensor's optimizer state from every rank: elementwise tensors as a list by rank,
    numbers (the step) once, after checking that the ranks agree."""
    keys = set(entries[0])
    out: dict[str, Any] = {}
    for rank, entry in enumerate(entries):
        if set(entry) != keys:
            raise CheckpointError(f"{where}: rank {rank} has optimizer state {sorted(entry)}, rank 0 {sorted(keys)}: "
                                  "the files come from different saves.")
    for key in sorted(keys):
        values = [entry[key] for entry in entries]
        if isinstance(values[0], torch.Tensor) and values[0].dim() > 0:
            out[key] = values
            continue
        if any(not _same(v, values[0]) for v in values[1:]):
            raise CheckpointError(f"{where}: the ranks' optimizer files disagree on {key!r} ({values}): the files come "
                                  "from different saves. Keep the files of one save together.")
        out[key] = values[0]
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return a == b


def _cut(flat: torch.Tensor, start: int, numel: int, what: str) -> torch.Tensor:
    if start + numel > flat.numel():
        raise CheckpointError(f"{what} holds {flat.numel()} values, but the parameters param_shapes lists need "
                              f"{start + numel}: the model and optimizer files do not belong together.")
    return flat[start : start + numel]


def _state_entry(flat_state: dict[str, Any], cut) -> dict[str, Any]:
    """One parameter's state: ``cut(key, by_rank)`` of each elementwise value, numbers copied."""
    return {key: cut(key, value) if isinstance(value, list) else
            (value.clone() if isinstance(value, torch.Tensor) else value) for key, value in flat_state.items()}


def _groups_stage12(optims: list[dict[str, Any]], model: dict[str, Any], folder: Path) -> list[_Group]:
    base = [entry.get("base_optimizer_state") for entry in optims]
    if not all(isinstance(b, dict) and "state" in b and "param_groups" in b for b in base):
        raise CheckpointError(f"the optimizer files in {folder} hold DeepSpeed's elastic optimizer state (saved with "
                              "zero_optimization.elastic_checkpoint=true), which this reader does not convert. Export "
                              "the weights with DeepSpeed's zero_to_fp32.py, or save again without elastic_checkpoint.")
    shapes: list[dict[str, torch.Size]] = model["param_shapes"]
    paddings = optims[0].get("param_alignment_paddings") or [[0] * len(s) for s in shapes]
    if len(base[0]["param_groups"]) != len(shapes):
        raise CheckpointError(f"{folder}: the optimizer has {len(base[0]['param_groups'])} param groups, the model "
                              f"file's param_shapes {len(shapes)}: the files do not belong together.")
    groups = []
    for g, group_shapes in enumerate(shapes):
        saved_group = base[0]["param_groups"][g]
        group = _Group({k: v for k, v in saved_group.items() if k != "params"})
        partitions = [entry["single_partition_of_fp32_groups"][g] for entry in optims]
        masters = torch.cat(partitions)
        flat_state = _rank_states([b["state"].get(saved_group["params"][0], {}) for b in base], f"{folder}, group {g}")
        joined = {k: torch.cat(v) for k, v in flat_state.items() if isinstance(v, list)}
        offset = 0
        for (name, shape), padding in zip(group_shapes.items(), paddings[g]):
            numel = math.prod(shape)

            def cut(key: str, _by_rank: Any) -> torch.Tensor:
                return _cut(joined[key], offset, numel, f"optimizer state {key!r} of group {g}").view(shape).clone()

            group.names.append(name)
            group.masters[name] = _cut(masters, offset, numel, f"the fp32 masters of group {g}").view(shape).clone()
            group.state[name] = _state_entry(flat_state, cut)
            offset += numel + padding
        if offset < masters.numel():
            raise CheckpointError(f"{folder}: group {g}'s fp32 masters hold {masters.numel()} values, its parameters "
                                  f"{offset}: the model and optimizer files do not belong together.")
        groups.append(group)
    return groups


def _groups_stage3(optims: list[dict[str, Any]], model: dict[str, Any], world_size: int, folder: Path) -> list[_Group]:
    inner = [entry["optimizer_state_dict"] for entry in optims]
    param_groups = inner[0]["param_groups"]
    sub_groups = [(gi, index) for gi, g in enumerate(param_groups) for index in g["params"]]  # flat order
    shapes: list[dict[str, torch.Size]] = model["param_shapes"]
    flats = [entry["fp32_flat_groups"] for entry in optims]
    if not len(sub_groups) == len(shapes) == len(flats[0]):
        raise CheckpointError(f"{folder}: {len(shapes)} sub-groups in param_shapes, {len(flats[0])} flat fp32 groups "
                              f"and {len(sub_groups)} in the optimizer: the files do not belong together.")
    groups = [_Group({k: v for k, v in g.items() if k != "params"}) for g in param_groups]
    for k, ((gi, index), sub_shapes) in enumerate(zip(sub_groups, shapes)):
        group = groups[gi]
        flat_state = _rank_states([st["state"].get(index, {}) for st in inner], f"{folder}, sub-group {k}")
        offset = 0
        for name, shape in sub_shapes.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world_size)

            def whole(by_rank: list[torch.Tensor], what: str) -> torch.Tensor:
                parts = [_cut(flat, offset, part, f"rank {r}'s {what} of sub-group {k}")
                         for r, flat in enumerate(by_rank)]
                return torch.cat(parts)[:numel].view(shape).clone()

            group.names.append(name)
            group.masters[name] = whole([f[k] for f in flats], "fp32 masters")
            group.state[name] = _state_entry(flat_state, lambda key, by_rank: whole(by_rank, f"{key!r}"))
            offset += part
        for r, f in enumerate(flats):
            if offset != f[k].numel():
                raise CheckpointError(f"{folder}: rank {r}'s fp32 masters of sub-group {k} hold {f[k].numel()} values, "
                                      f"its parameters' parts {offset}: the files do not belong together.")
    return groups


def _torch_layout(groups: list[_Group]) -> dict[str, Any]:
    """What ``torch.optim.Optimizer.state_dict()`` gives: the trainable parameters numbered in
    param-group order, each with its own state."""
    state, param_groups, index = {}, [], 0
    for group in groups:
        ids = []
        for name in group.names:
            if group.state[name]:
                state[index] = group.state[name]
            ids.append(index)
            index += 1
        param_groups.append({**group.hyper, "params": ids})
    return {"state": state, "param_groups": param_groups}


# ---- the module's state dict ---------------------------------------------------------------


def _fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16):
        return value.float()
    return value


def _frozen(models: list[dict[str, Any]], name: str, shape: torch.Size, stage: int) -> torch.Tensor:
    fragments = [m.get("frozen_param_fragments") or {} for m in models]
    if any(name not in f for f in fragments):
        raise CheckpointError(f"the frozen parameter {name!r} is listed in frozen_param_shapes but its values are "
                              "missing from a model file: the files do not belong together.")
    if stage <= 2:
        return fragments[0][name].reshape(shape).clone()
    numel = math.prod(shape)
    return torch.cat([f[name].reshape(-1) for f in fragments])[:numel].view(shape).clone()


def _state_dict(stage: int, models: list[dict[str, Any]], masters: dict[str, torch.Tensor],
                folder: Path) -> dict[str, Any]:
    model = models[0]
    module: dict[str, Any] = model["module"]
    buffers = set(model.get("buffer_names") or ())
    shared: dict[str, str] = model.get("shared_params") or {}
    frozen_shapes = model.get("frozen_param_shapes") or {}
    out: dict[str, Any] = {}
    for key, saved in module.items():
        if key in masters:
            out[key] = masters[key]
        elif key in shared:
            continue  # below, as the very tensor of its source
        elif key in frozen_shapes:
            out[key] = _fp32(_frozen(models, key, frozen_shapes[key], stage))
        elif key in buffers or stage <= 2 or not isinstance(saved, torch.Tensor):
            out[key] = _fp32(saved)  # buffers; at stages 1-2 also frozen weights, whole in the module
        else:
            raise CheckpointError(f"{folder}: {key!r} is a stage-3 parameter that is neither trained, frozen nor "
                                  "tied: the checkpoint has no values for it.")
    for alias, source in shared.items():
        if alias in module:
            if source not in out:
                raise CheckpointError(f"{folder}: {alias!r} is tied to {source!r}, which has no saved values.")
            out[alias] = out[source]
    return {key: out[key] for key in module}


# ---- Lightning -----------------------------------------------------------------------------


def _lightning_defaults(checkpoint: dict[str, Any], model: dict[str, Any]) -> None:
    """The keys Lightning's Trainer needs to resume (its version, for migrations; scheduler states),
    where the client state does not hold them: a plain DeepSpeed checkpoint."""
    if "pytorch-lightning_version" not in checkpoint:
        for dist in ("lightning", "pytorch-lightning"):
            try:
                checkpoint["pytorch-lightning_version"] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    checkpoint.setdefault("global_step", model.get("global_steps", 0))
    checkpoint.setdefault("lr_schedulers", [])  # DeepSpeed's own scheduler state is in checkpoint["deepspeed"]


def _loss_scaler(scaler: dict[str, Any], skipped_steps: int) -> dict[str, Any]:
    """DeepSpeed's fp16 loss scaler as this package's LossScaler fields (engine/grads/scaler.py)."""
    if not scaler.get("dynamic"):
        return {"scale": float(scaler["cur_scale"]), "dynamic": False, "skipped_steps": int(skipped_steps)}
    # LossScaler moves the scale as DeepSpeed does (see [Note: DeepSpeed's dynamic loss scale]). Its
    # good_steps counts the clean steps since the last overflow: DeepSpeed has taken cur_iter steps,
    # the last overflow at index last_overflow_iter (-1: none), so those after it are all clean.
    good_steps = int(scaler["cur_iter"]) - int(scaler["last_overflow_iter"]) - 1
    return {"scale": float(scaler["cur_scale"]), "dynamic": True, "window": int(scaler["scale_window"]),
            "hysteresis": int(scaler["delayed_shift"]), "min_scale": float(scaler["min_scale"]),
            "skipped_steps": int(skipped_steps), "good_steps": max(good_steps, 0),
            "overflows_left": int(scaler["cur_hysteresis"])}  # DeepSpeed's cur_hysteresis, the same count


def align_optimizer_state(checkpoint: dict[str, Any], param_names: Sequence[Sequence[str]]) -> dict[str, Any]:
    """The optimizer state of ``read_deepspeed_checkpoint``'s result, renumbered for an optimizer
    whose param groups hold the parameters named ``param_names`` (one list per group; a tied
    parameter under its first name in ``named_parameters()``).

    DeepSpeed keeps only the trainable parameters of each group, so an optimizer built as DeepSpeed
    users build it, over ``model.parameters()`` with frozen ones included, numbers its parameters
    differently; parameters DeepSpeed did not train get no state, as in torch.
    """
    saved = checkpoint["optimizer_states"][0]
    saved_names: list[list[str]] = checkpoint["deepspeed"]["param_names"]
    if len(saved_names) != len(param_names):
        raise CheckpointError(f"the DeepSpeed checkpoint has {len(saved_names)} param groups, this optimizer "
                              f"{len(param_names)}: build the optimizer with the param groups of the DeepSpeed run.")
    state, groups, index = {}, [], 0
    for g, (saved_group, names, ours) in enumerate(zip(saved["param_groups"], saved_names, param_names)):
        ours_set = set(ours)
        missing = [n for n in names if n not in ours_set]
        if missing:
            raise CheckpointError(f"param group {g} of the DeepSpeed checkpoint trains {missing[:10]}, which are "
                                  f"not in param group {g} of this optimizer: build it with the param groups of the "
                                  "DeepSpeed run.")
        by_name = dict(zip(names, saved_group["params"]))
        ids = []
        for name in ours:
            if name in by_name and by_name[name] in saved["state"]:
                state[index] = saved["state"][by_name[name]]
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


def fit_to_module(checkpoint: dict[str, Any], module_keys: Sequence[str]) -> dict[str, Any]:
    """``read_deepspeed_checkpoint``'s result with its names as ``module_keys`` (a module's state dict
    keys) spell them, when they differ by one prefix: DeepSpeed trained the bare model, which a
    LightningModule holds as an attribute (``self.model``), and Lightning before 2.1 saved its own
    wrapper's ``_forward_module.``. Renamed only when every key matches; otherwise as it was, for
    the loader to report the keys that differ."""
    saved = list(checkpoint["state_dict"])
    ours = set(module_keys)
    if set(saved) == ours:
        return checkpoint
    candidates = {"", *(k[: len(k) - len(s)] for k in ours for s in saved[:1] if k.endswith("." + s))}
    for prefix in sorted(candidates, key=len):
        for strip in ("", "_forward_module."):
            rename = {k: prefix + k.removeprefix(strip) for k in saved}
            if set(rename.values()) == ours:
                names = [[rename.get(n, prefix + n.removeprefix(strip)) for n in group]
                         for group in checkpoint["deepspeed"]["param_names"]]
                return {**checkpoint, "state_dict": {rename[k]: v for k, v in checkpoint["state_dict"].items()},
                        "deepspeed": {**checkpoint["deepspeed"], "param_names": names}}
    return checkpoint


def consolidate_deepspeed_checkpoint(path: Any, out_path: Any, tag: Optional[str] = None,
                                     safetensors_path: Any = None, weights_only: bool = False) -> Path:
    """Write the DeepSpeed checkpoint at ``path`` as one regular Lightning checkpoint file at
    ``out_path``: ``read_deepspeed_checkpoint``'s dict, which ``torch.load(weights_only=True)`` reads.
    ``weights_only`` leaves out the optimizer, scheduler and callback state; ``safetensors_path``
    also writes the weights alone as safetensors (tied ones as copies: it stores no shared
    tensors). Each write is atomic (a temporary file beside the target, renamed over it) and
    leaves a file whose mode follows the umask."""
    checkpoint = read_deepspeed_checkpoint(path, tag)
    if weights_only:
        for key in ("optimizer_states", "lr_schedulers", "callbacks"):
            checkpoint.pop(key, None)
    out_path = Path(out_path)
    atomic_write(out_path, lambda f: torch.save(checkpoint, f))
    if safetensors_path is not None:
        tensors, seen = {}, set()
        for key, value in checkpoint["state_dict"].items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value.clone() if id(value) in seen else value.contiguous()
                seen.add(id(value))
        atomic_write(Path(safetensors_path), lambda f: f.write(save(tensors, metadata={"format": "pt"})))
    return out_path
