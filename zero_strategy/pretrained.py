"""Pretrained weights straight into the shards: ``load_pretrained``, and ``from_pretrained`` inside the
strategies' init context (``sharded_init``).

[Note: pretrained weights into shards]
``load_pretrained(module, path)`` matches the module's state-dict names against the safetensors
headers (strict by default: missing, unexpected and wrongly shaped keys are an error before
anything is read), then gives each parameter and buffer its values where they live:
- on the meta device (built in ``configure_model`` at stage 3, or under
  ``fabric.init_module(empty_init=True)``): it records the file as the tensor's source, and setup
  streams each rank's element ranges into its shards once they exist (see [Note: init-time sharding] in
  engine/params/materialize.py), so the model is never whole on a rank;
- on an engine already (after setup, any stage): into this rank's pieces of the flat groups and
  their master copies, each rank reading only its ranges at stage 3;
- real and whole (stages 1 and 2 before setup, or a model built in ``__init__``): into the
  tensors themselves, read once, with no second copy.
Inside ``sharded_init`` (the context the strategies open around ``configure_model`` at stage 3)
``PreTrainedModel.from_pretrained`` builds the model from its config, recorded on meta, and
attaches its files the same way, with transformers' rules for missing and unexpected keys (they warn,
and missing ones keep the model's own initialisation). transformers is never told that DeepSpeed runs.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
from torch import nn

from .checkpoint.pretrained_files import PretrainedFiles
from .engine.params.deferred_init import record_construction
from .engine.params.materialize import group_places, set_buffer_source, set_param_source, write_parameter
from .engine.params.flat_parameters import owners_of

PathLike = Union[str, os.PathLike]


class PretrainedMismatchError(ValueError):
    """The checkpoint does not fit the module: raised before any tensor is read."""


@dataclass
class LoadPlan:
    """What ``load_pretrained`` reads: (checkpoint name, parameter) and (checkpoint name, module,
    buffer name) pairs, and what does not match."""

    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    buffers: list[tuple[str, nn.Module, str]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # module keys no checkpoint name fills
    unexpected: list[str] = field(default_factory=list)  # checkpoint names no module key takes
    mismatched: list[str] = field(default_factory=list)  # "key: checkpoint shape vs module shape"


class _FileSource:
    def __init__(self, files: PretrainedFiles, name: str) -> None:
        self.files, self.name = files, name

    def read(self, start: int, end: int) -> torch.Tensor:
        return self.files.read_elements(self.name, start, end)


def _true_shape(p: torch.Tensor, places: dict) -> tuple[int, ...]:
    """A parameter's shape, also when stage 3 has released it (its own shape is then (0,))."""
    if p in places:
        group, index = places[p]
        return tuple(group.shapes[index])
    return tuple(p.shape)


def _places_of(module: nn.Module) -> dict:
    return {p: place for s in owners_of(module) for p, place in group_places(s.groups).items()}


def plan_load(module: nn.Module, files: PretrainedFiles, prefix: str = "", strip: str = "",
              places: Optional[dict] = None) -> LoadPlan:
    """Match ``module``'s state-dict keys (those under ``prefix``, less it, with ``strip`` put in front)
    with the checkpoint's names. Tied parameters (one object under several keys) load once."""
    places = _places_of(module) if places is None else places
    plan = LoadPlan()
    owner_of = {}
    for mname, m in module.named_modules():
        for bname in m._buffers:
            if bname not in m._non_persistent_buffers_set:
                owner_of[f"{mname}.{bname}" if mname else bname] = (m, bname)
    by_target: dict[int, list[tuple[str, Any]]] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if not key.startswith(prefix):
            continue
        by_target.setdefault(id(value), []).append((key, value))
    used: set[str] = set()
    for keys in by_target.values():
        names = [(k, strip + k[len(prefix):]) for k, _ in keys]
        found = [(k, n) for k, n in names if n in files.entries]
        used.update(n for _, n in found)
        if not found:
            plan.missing.append(keys[0][0])
            continue
        key, name = found[0]
        value = keys[0][1]
        want = _true_shape(value, places)
        if tuple(files.entries[name].shape) != want:
            plan.mismatched.append(f"{key}: checkpoint {tuple(files.entries[name].shape)} vs model {want}")
        elif isinstance(value, nn.Parameter):
            plan.params.append((name, value))
        else:
            plan.buffers.append((name, *owner_of[key]))
    plan.unexpected = [n for n in files.entries if n not in used]
    return plan


def _refuse(plan: LoadPlan, path: Path, strict: bool) -> None:
    problems = []
    if plan.mismatched:
        problems.append(f"wrongly shaped: {plan.mismatched[:10]}")
    if strict and plan.missing:
        problems.append(f"missing from the checkpoint: {plan.missing[:10]}" + (
            f" and {len(plan.missing) - 10} more" if len(plan.missing) > 10 else ""))
    if strict and plan.unexpected:
        problems.append(f"unexpected (in the checkpoint, not in the model): {plan.unexpected[:10]}" + (
            f" and {len(plan.unexpected) - 10} more" if len(plan.unexpected) > 10 else ""))
    if problems:
        hint = ("give prefix= the part of the module's names in front of the checkpoint's (e.g. 'model.' for a "
                "LightningModule's self.model), or call it on the submodule the checkpoint is of")
        relax = "; strict=False loads what matches and leaves the rest as initialised" if strict else ""
        raise PretrainedMismatchError(f"{path} does not fit the model, nothing was loaded: {'; '.join(problems)}. "
                                      f"{hint}{relax} (wrongly shaped keys are refused either way).")


def _apply(plan: LoadPlan, files: PretrainedFiles, places: dict) -> None:
    for name, p in plan.params:
        source = _FileSource(files, name)
        if p.is_meta:
            set_param_source(p, source)  # streamed into the shards at setup
        else:
            write_parameter(p, source.read, places.get(p))
    for name, m, bname in plan.buffers:
        target = m._buffers[bname]
        if target.is_meta:
            set_buffer_source(m, bname, _FileSource(files, name))
        else:
            with torch.no_grad():
                target.copy_(files.read(name))


def load_pretrained(module: nn.Module, path: PathLike, strict: bool = True, prefix: str = "") -> LoadPlan:
    """Load the safetensors weights at ``path`` (a file, an index .json, or a Hugging Face model
    directory) into ``module``, wherever its tensors are: see [Note: pretrained weights into shards].

    ``prefix``: what the module's state-dict keys have in front of the checkpoint's (``"model."`` for a
    LightningModule whose ``self.model`` the checkpoint is of); keys without it are left alone.
    ``strict``: every key under the prefix must be in the checkpoint and every checkpoint tensor used,
    else nothing is loaded; ``strict=False`` loads what matches (with a warning naming the rest). A
    shape mismatch is always refused. Dtypes convert (a bf16 file into fp32 weights, and back).
    Call it on every rank. Returns what was matched and what was not.
    """
    files = PretrainedFiles(path)
    places = _places_of(module)
    plan = plan_load(module, files, prefix, places=places)
    _refuse(plan, files.path, strict)
    if plan.missing or plan.unexpected:
        warnings.warn(f"load_pretrained({str(path)!r}, strict=False): {len(plan.missing)} keys of the model are not "
                      f"in the checkpoint and keep their values ({plan.missing[:5]}), {len(plan.unexpected)} "
                      f"checkpoint tensors are not used ({plan.unexpected[:5]}).", stacklevel=2)
    _apply(plan, files, places)
    return plan


# ---- from_pretrained inside the init context -------------------------------------------------

_REFUSED = ("device_map", "max_memory", "offload_folder", "offload_buffers", "quantization_config", "gguf_file",
            "tp_plan", "tp_size", "device_mesh", "distributed_config", "state_dict", "load_in_8bit", "load_in_4bit",
            "adapter_kwargs", "key_mapping")
_IGNORED = ("cache_dir", "force_download", "local_files_only", "token", "revision", "use_safetensors",
            "weights_only", "disable_mmap", "trust_remote_code", "low_cpu_mem_usage", "_from_auto", "_from_pipeline",
            "output_loading_info", "subfolder", "variant", "proxies")


def _asks_for_something(key: str, value: Any) -> bool:
    """Whether a refused loading argument was given a value that asks for what the strategy cannot do. The
    Auto classes pass ``adapter_kwargs`` on every call, holding only the hub's options (revision, token)
    unless the directory is a PEFT adapter's (``_adapter_model_path``)."""
    if key == "adapter_kwargs" and isinstance(value, dict):
        return "_adapter_model_path" in value
    return value not in (None, {}, [], (), False)


def _from_pretrained_sharded(cls: type, pretrained_model_name_or_path: PathLike, *model_args: Any,
                             config: Any = None, **kwargs: Any) -> nn.Module:
    """``cls.from_pretrained`` inside ``sharded_init``: the model built from its config (recorded on meta),
    its files attached as the sources of its tensors (see [Note: pretrained weights into shards])."""
    refused = [k for k in _REFUSED if _asks_for_something(k, kwargs.pop(k, None))]
    if refused or model_args:
        raise ValueError(f"{cls.__name__}.from_pretrained({refused or list(model_args)}) inside the ZeRO stage-3 init "
                         f"context (configure_model, fabric.init_module(empty_init=True)): the strategy places and "
                         f"shards the weights itself; drop these arguments (supported: config, dtype, "
                         f"attn_implementation and config overrides).")
    path = Path(pretrained_model_name_or_path)
    if not path.is_dir():
        raise ValueError(f"{cls.__name__}.from_pretrained({str(pretrained_model_name_or_path)!r}) inside the ZeRO "
                         "stage-3 init context needs a local model directory: download it first (e.g. "
                         "`huggingface-cli download NAME --local-dir DIR`) and pass DIR.")
    for k in _IGNORED:
        kwargs.pop(k, None)
    dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None)
    attn = {k: kwargs.pop(k) for k in ("attn_implementation",) if k in kwargs}
    if config is None or isinstance(config, (str, os.PathLike)):
        config, unused = cls.config_class.from_pretrained(config or path, return_unused_kwargs=True, **kwargs)
    else:
        unused = {k: v for k, v in kwargs.items() if not hasattr(config, k) or setattr(config, k, v)}
    if unused:
        raise ValueError(f"{cls.__name__}.from_pretrained: arguments {sorted(unused)} are neither loading options "
                         "nor fields of the model's config; remove them.")
    files = PretrainedFiles(path)
    if dtype in (None, "auto"):
        dtype = getattr(config, "dtype", None) or next(
            (e.dtype for e in files.entries.values() if e.dtype.is_floating_point), torch.get_default_dtype())
    model = cls._from_config(config, dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype, **attn)
    plan = _plan_as_transformers_does(model, files)
    _refuse(plan, path, strict=False)
    if plan.missing:
        warnings.warn(f"Some weights of {cls.__name__} were not initialized from the model checkpoint at {path} and "
                      f"are newly initialized: {plan.missing}", stacklevel=3)
    if plan.unexpected:
        warnings.warn(f"Some weights of the model checkpoint at {path} were not used when initializing "
                      f"{cls.__name__}: {plan.unexpected}", stacklevel=3)
    _apply(plan, files, {})
    model.eval()  # as from_pretrained returns it
    return model


def _plan_as_transformers_does(model: nn.Module, files: PretrainedFiles) -> LoadPlan:
    """A base model's checkpoint into a model with a head (``bert.`` in front of its names), or the
    reverse; keys the model says to ignore are neither missing nor unexpected."""
    base = getattr(model, "base_model_prefix", "")
    own = list(model.state_dict(keep_vars=True))
    has_base = bool(base) and any(k.startswith(base + ".") for k in own)
    ckpt_base = bool(base) and any(n.startswith(base + ".") for n in files.entries)
    if has_base and not ckpt_base:
        plan = plan_load(model, files, prefix=base + ".", places={})
        plan.missing += [k for k in own if not k.startswith(base + ".")]
    elif ckpt_base and not has_base:
        plan = plan_load(model, files, strip=base + ".", places={})
    else:
        plan = plan_load(model, files, places={})

    def ignored(key: str, attr: str) -> bool:
        return any(re.search(pattern, key) for pattern in (getattr(model, attr, None) or ()))

    plan.missing = [k for k in plan.missing if not ignored(k, "_keys_to_ignore_on_load_missing")]
    plan.unexpected = [k for k in plan.unexpected if not ignored(k, "_keys_to_ignore_on_load_unexpected")]
    return plan


@contextlib.contextmanager
def _from_pretrained_patched() -> Iterator[None]:
    """``PreTrainedModel.from_pretrained`` replaced while open, also when transformers is first imported
    inside (``from transformers import ...`` in ``configure_model``): every rank must intercept it,
    whatever it imported before."""
    patched: list[tuple[type, Any]] = []

    def patch(modeling: Any) -> None:
        cls = modeling.PreTrainedModel
        patched.append((cls, cls.__dict__["from_pretrained"]))
        cls.from_pretrained = classmethod(_from_pretrained_sharded)

    modeling = sys.modules.get(_MODELING)
    hook = None
    if modeling is not None:
        patch(modeling)
    else:
        hook = _PatchOnImport(patch)
        sys.meta_path.insert(0, hook)
    try:
        yield
    finally:
        if hook is not None:
            sys.meta_path.remove(hook)
        for cls, original in patched:
            cls.from_pretrained = original


_MODELING = "transformers.modeling_utils"


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` once transformers' modeling module is imported (the real finders find it)."""

    def __init__(self, patch: Any) -> None:
        self.patch = patch

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _MODELING:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return None
        loader, patch = spec.loader, self.patch

        class PatchingLoader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                patch(module)

        spec.loader = PatchingLoader()
        return spec


@contextlib.contextmanager
def sharded_init() -> Iterator[None]:
    """Modules built inside are recorded on the meta device (see [Note: recorded construction]) and
    ``from_pretrained`` attaches its files; a ZeRO stage-3 setup then materialises them into the
    shards, unit by unit, so no rank holds the whole model. The strategies open it around
    ``configure_model`` (Trainer) and ``init_module(empty_init=True)`` (Fabric); a plain loop opens
    it itself before ``initialize``."""
    with record_construction(), _from_pretrained_patched():
        yield
