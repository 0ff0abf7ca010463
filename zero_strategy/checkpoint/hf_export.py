"""Export to the Hugging Face layout, tensor by tensor: from a sharded checkpoint, or from a running job.

Both go through ``write_export``: an ``ExportPlan`` (hf_plan.py) says which tensors, under which
names, with which LoRA merges; a source gives each tensor whole, one at a time; hf_layout.py writes
them into the shards as they come (see [Note: streaming safetensors]). So host memory holds about
one tensor (a merged one: the weight, its adapters and the delta), never a shard file or the model.

- ``export_hf_checkpoint`` (``zero-consolidate CKPT_DIR --hf OUT_DIR``) reads a sharded checkpoint
  offline: no process group, no model. Each tensor comes from its most precise saved values (the
  fp32 masters where the run kept them), read part by part from the rank files; the plan is the
  one the save recorded (``hf_record``), or, for a module that held no Hugging Face model, every
  key under a prefix, with ``--config`` giving config.json.
- ``export_module`` (``strategy.save_pretrained(dir)``) runs on every rank of a job: see [Note:
  gathering one tensor for an export].

[Note: gathering one tensor for an export]
Every rank walks the plan in the same order; for a tensor in a flat group each rank fills the
elements of its own pieces into a buffer of the whole tensor filled with -0.0, and one all-reduce
(a sum) puts the tensor together: -0.0 is the one value that leaves every float unchanged when
added (+0.0 would turn a -0.0 into +0.0), so the sum is the tensor bit for bit. The pieces are
the masters' where they are more precise than the working weights (bf16 or fp16 training), so a
running job exports what a checkpoint of it would. Tensors whole on every rank (buffers, frozen
parameters at stages 1-2, resident groups without masters) need no collective. Only rank 0 keeps
and writes; a failure there is broadcast at the end, after every rank has made the same
collectives, so no rank waits on another.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from ..engine.comm.collectives import Collectives
from ..engine.buffers.flat import FlatGroup
from ..engine.params.attached import attach_attribute
from . import hf_layout as layout
from .format import DTYPES
from .hf_plan import Entry, ExportPlan, is_peft_model, is_pretrained_model, make_plan, plain_plan
from .sharded import MODEL, _best_source
from .store import CheckpointError, CheckpointReader

HF_RECORD = "hf_export"  # the entry of the checkpoint's zero_checkpoint record holding the export plan
DEFAULT_ADAPTER_DIR = "adapter"  # beside config.json, from_pretrained would load adapter_config.json on top


@dataclass
class Exported:
    """What an export wrote: the directory, its weight files, tensors and bytes, and where the adapter went."""

    path: Path
    files: list[str]
    tensors: int
    bytes: int
    adapter: Optional[Path] = None


class _Source:
    """Whole tensors by the module's state-dict key: shapes and dtypes up front, values one at a time."""

    writes = True  # whether this process writes the files (rank 0)

    def shape(self, key: str) -> torch.Size:
        raise NotImplementedError

    def dtype(self, key: str) -> torch.dtype:
        raise NotImplementedError

    def fetch(self, key: str) -> Optional[torch.Tensor]:
        """The tensor, whole, on the CPU (None on a process that does not write)."""
        raise NotImplementedError

    def agree(self, error: str) -> str:
        """Every process's view of whether the export failed (a collective for a live job)."""
        return error


class CheckpointSource(_Source):
    """A sharded checkpoint's tensors, each from its most precise saved values."""

    def __init__(self, reader: CheckpointReader, model_keys: dict[str, str]) -> None:
        self.reader, self.model_keys = reader, model_keys

    def _stored(self, key: str) -> str:
        if key not in self.model_keys:
            raise CheckpointError(f"the checkpoint at {self.reader.path} holds no tensor {key!r}.")
        return _best_source(self.reader, self.model_keys[key])

    def shape(self, key: str) -> torch.Size:
        return self.reader.shape(self._stored(key))

    def dtype(self, key: str) -> torch.dtype:
        return DTYPES[self.reader.tensors[self._stored(key)]["dtype"]]

    def fetch(self, key: str) -> Optional[torch.Tensor]:
        try:
            return self.reader.full(self._stored(key))
        finally:
            self.reader.close()  # the mapped pages read go with it: memory stays near one tensor


class LiveSource(_Source):
    """A running job's tensors, gathered one at a time (see [Note: gathering one tensor for an export])."""

    def __init__(self, module: nn.Module, groups: Sequence[FlatGroup], comm: Collectives,
                 contributes: bool = True) -> None:
        self.comm = comm
        self.writes = comm.rank == 0
        self.contributes = contributes  # False: a replica's ranks under hybrid sharding add nothing (writes_shards)
        self.tensors = {k: v for k, v in module.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}
        self.place: dict[torch.Tensor, tuple[FlatGroup, int]] = {}
        for g in groups:
            for i, p in enumerate(g.params):
                self.place[p] = (g, i)

    @staticmethod
    def _uses_master(g: FlatGroup) -> bool:
        return g.master_shard is not None and g.master_shard.dtype.itemsize > g.dtype.itemsize

    def shape(self, key: str) -> torch.Size:
        t = self.tensors[key]
        return self.place[t][0].shapes[self.place[t][1]] if t in self.place else t.shape

    def dtype(self, key: str) -> torch.dtype:
        t = self.tensors[key]
        if t not in self.place:
            return t.dtype
        g = self.place[t][0]
        return g.master_shard.dtype if self._uses_master(g) else g.dtype

    @torch.no_grad()
    def fetch(self, key: str) -> Optional[torch.Tensor]:
        t = self.tensors[key]
        place = self.place.get(t)
        if place is None or (place[0].resident and not self._uses_master(place[0])):  # whole on every rank
            return t.detach().to("cpu", copy=True) if self.writes else None
        g, i = place
        master = self._uses_master(g)
        whole = torch.full((g.shapes[i].numel(),), -0.0, dtype=self.dtype(key), device=g.device)
        for piece in g.pieces if self.contributes else ():
            if piece.param == i:
                whole[piece.param_start:piece.param_end] = (g.stepped(piece) if master else g.weights(piece))
        self.comm.all_reduce(whole, what=lambda: f"the all-reduce that gathers {key!r} for a Hugging Face export")
        return whole.view(g.shapes[i]).cpu() if self.writes else None

    def agree(self, error: str) -> str:
        return self.comm.broadcast_object(error)


def _merged(entry: Entry, source: _Source) -> Optional[torch.Tensor]:
    """The entry's values, its LoRA adapters added as peft's merge adds them (see [Note: merging LoRA in
    an export]); every process fetches the same tensors in the same order."""
    value = source.fetch(entry.source)
    for a_key, b_key, scaling, fan_in_fan_out in entry.merges:
        a, b = source.fetch(a_key), source.fetch(b_key)
        if value is not None:  # in fp32 at least (peft too casts half precision up on the CPU), rounded once
            work = torch.promote_types(value.dtype, torch.float32)
            delta = b.to(work) @ a.to(work)
            value = value.to(work) + (delta.T if fan_in_fan_out else delta) * scaling
    return value


def _out_dtype(source_dtype: torch.dtype, dtype: Optional[torch.dtype]) -> torch.dtype:
    """``dtype`` for floating-point tensors; integer and boolean buffers keep theirs."""
    return dtype if dtype is not None and source_dtype.is_floating_point else source_dtype


class _Files:
    """The writing half of an export: on the process that writes, each step runs, and the first failure
    is kept; the later steps are skipped, while the gathers go on (a live job's other ranks are in
    them). ``strict`` (offline, one process) raises at once instead."""

    def __init__(self, enabled: bool, strict: bool) -> None:
        self.enabled, self.strict, self.error = enabled, strict, ""

    def run(self, step: Callable[[], Any]) -> Any:
        if not self.enabled or self.error:
            return None
        try:
            return step()
        except Exception as err:  # noqa: BLE001 - kept, and reported on every rank at the end
            if self.strict:
                raise
            self.error = f"{type(err).__name__}: {err}"
            return None


def _write_weights(files: _Files, folder: Path, entries: Sequence[Entry], source: _Source,
                   dtype: Optional[torch.dtype], max_bytes: int, single: str) -> tuple[list[str], int, dict[str, str]]:
    """Stream ``entries`` into shard files in ``folder``; returns the files, total bytes and weight map."""
    specs = {e.out: (source.shape(e.source), _out_dtype(source.dtype(e.source), dtype)) for e in entries}
    sizes = [(e.out, layout.tensor_bytes(*specs[e.out])) for e in entries]
    shards = layout.plan_shards(sizes, max_bytes)
    names = layout.shard_file_names(len(shards), single)
    by_out = {e.out: e for e in entries}
    weight_map: dict[str, str] = {}
    for keys, name in zip(shards, names):
        writer = files.run(lambda: layout.StreamingSafetensors(folder / name, [(k, *specs[k]) for k in keys]))
        for key in keys:
            value = _merged(by_out[key], source)  # on every process: a live job gathers here
            files.run(lambda: writer.write(key, value.to(specs[key][1])))
            weight_map[key] = name
        if writer is not None and files.error:
            writer.abandon()
        elif writer is not None:
            files.run(writer.close)
    return names, sum(n for _, n in sizes), weight_map


def _config_with(text: str, dtype: torch.dtype) -> dict[str, Any]:
    config = json.loads(text)
    config["dtype"] = str(dtype).removeprefix("torch.")  # as save_pretrained records the dtype it wrote
    return config


def write_export(out_dir: Any, plan: ExportPlan, source: _Source, dtype: Optional[torch.dtype] = None,
                 max_shard_size: Union[int, str] = layout.DEFAULT_MAX_SHARD_SIZE, config: Optional[str] = None,
                 adapter_dir: Optional[str] = DEFAULT_ADAPTER_DIR, adapter_only: bool = False) -> Exported:
    """Write ``plan``'s tensors from ``source`` as a Hugging Face model directory at ``out_dir``,
    atomically (see [Note: an export directory swapped whole]); the adapter, if the plan has one, into
    ``out_dir/adapter_dir`` (None: left out), or alone at ``out_dir`` with ``adapter_only``."""
    out_dir = Path(out_dir)
    max_bytes = layout.parse_size(max_shard_size)
    config = config if config is not None else plan.config
    if config is None and not adapter_only:
        raise CheckpointError("the export needs a config.json, and none is known: the module held no transformers "
                              "model whose config could be copied. Pass the model's config (--config PATH, or "
                              "config=PATH: a config.json or a directory holding one).")
    if adapter_only and not plan.adapter_entries:
        raise CheckpointError("adapter_only: the exported model has no peft adapter to export.")
    files = _Files(source.writes, strict=not isinstance(source, LiveSource))
    staged = layout.partial_dir(out_dir)
    files.run(lambda: layout.check_export_target(out_dir, None if adapter_only else adapter_dir))
    files.run(lambda: layout.begin_export(out_dir))
    try:
        names, total, weight_map = [], 0, {}
        if not adapter_only:
            names, total, weight_map = _write_weights(files, staged, plan.entries, source, dtype, max_bytes,
                                                      layout.SINGLE_FILE)
        adapter_path = None
        if plan.adapter_entries and (adapter_dir is not None or adapter_only):
            adapter_path = out_dir if adapter_only else out_dir / adapter_dir
            folder = staged if adapter_only else staged / adapter_dir
            files.run(lambda: folder.mkdir(exist_ok=True))
            _write_weights(files, folder, plan.adapter_entries, source, dtype, 2**62, layout.ADAPTER_WEIGHTS)
            files.run(lambda: layout.write_json(folder / layout.ADAPTER_CONFIG, json.loads(plan.adapter_config)))
        if not adapter_only:
            first = dtype or (source.dtype(plan.entries[0].source) if plan.entries else torch.float32)
            files.run(lambda: layout.write_json(staged / layout.CONFIG_FILE, _config_with(config, first)))
            if plan.generation_config is not None:
                files.run(lambda: layout.write_json(staged / layout.GENERATION_CONFIG_FILE,
                                                    json.loads(plan.generation_config)))
            if len(names) > 1:
                files.run(lambda: layout.write_json(staged / layout.INDEX_FILE, {
                    "metadata": {"total_size": total}, "weight_map": weight_map}))
        files.run(lambda: layout.finish_export(out_dir))
    except BaseException:
        if source.writes:
            layout.abandon_export(out_dir)
        raise
    if files.error:
        layout.abandon_export(out_dir)
    error = source.agree(files.error)
    if error:
        raise CheckpointError(f"exporting to {out_dir} failed on rank 0: {error}. Nothing was written over an earlier "
                              "export there.")
    return Exported(out_dir, names, len(plan.entries), total, adapter_path)


def read_config(path: Any) -> str:
    """A config.json's text, from its path or the directory holding it."""
    path = Path(path)
    file = path / layout.CONFIG_FILE if path.is_dir() else path
    try:
        text = file.read_text()
        json.loads(text)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read the config {file}: {err}; give a config.json (or the directory of a "
                              "model saved with save_pretrained).") from err
    return text


def _common_prefix(keys: Sequence[str]) -> str:
    """The first dotted component every key shares (a LightningModule's one attribute), or ''."""
    heads = {k.split(".", 1)[0] for k in keys}
    return f"{heads.pop()}." if len(heads) == 1 and all("." in k for k in keys) else ""


def checkpoint_plan(saved: dict[str, Any], reader: CheckpointReader, prefix: Optional[str] = None) -> ExportPlan:
    """The plan the save recorded, or (none recorded, or ``prefix`` given) every key under a prefix."""
    record = saved.get(HF_RECORD)
    if prefix is None and isinstance(record, dict) and "error" in record:
        raise CheckpointError(f"the checkpoint at {reader.path} recorded no Hugging Face export plan: making it at "
                              f"save time failed ({record['error']}). Pass --prefix to export its keys as they are.")
    if prefix is None and record is not None:
        return ExportPlan.from_record(record)
    keys = [k for k in saved["model_keys"]]
    prefix = _common_prefix(keys) if prefix is None else prefix
    by_stored: dict[str, Any] = {}  # tied parameters: one stored tensor under several keys
    tensors = {k: by_stored.setdefault(stored, object()) for k, stored in saved["model_keys"].items()}
    canonical = sorted(keys, key=lambda k: saved["model_keys"][k] != MODEL + k)  # the stored name first
    plan = plain_plan(canonical, prefix, tensors)
    if isinstance(record, dict) and "error" not in record:  # the keys as they are, the model's configs kept
        plan.config, plan.generation_config = record.get("config"), record.get("generation_config")
    order = {k: i for i, k in enumerate(keys)}
    plan.entries.sort(key=lambda e: order[e.source])
    return plan


def export_hf_checkpoint(ckpt_dir: Any, out_dir: Any, dtype: Union[str, torch.dtype, None] = None,
                         max_shard_size: Union[int, str] = layout.DEFAULT_MAX_SHARD_SIZE, config: Any = None,
                         prefix: Optional[str] = None, adapter_dir: Optional[str] = DEFAULT_ADAPTER_DIR,
                         verify: bool = True) -> Exported:
    """Write the sharded checkpoint ``ckpt_dir`` as a Hugging Face model directory ``out_dir``, one
    tensor at a time, without a process group or the model (see the module's docstring)."""
    reader = CheckpointReader(ckpt_dir, verify=verify)
    saved = reader.trainer_state().get("zero_checkpoint")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{reader.path} has no zero_checkpoint entry in its trainer state: it was not written "
                              "by this package.")
    plan = checkpoint_plan(saved, reader, prefix)
    return write_export(out_dir, plan, CheckpointSource(reader, saved["model_keys"]), layout.export_dtype(dtype),
                        max_shard_size, read_config(config) if config is not None else None, adapter_dir)


def export_module(module: nn.Module, groups: Sequence[FlatGroup], comm: Collectives, out_dir: Any,
                  dtype: Union[str, torch.dtype, None] = None,
                  max_shard_size: Union[int, str] = layout.DEFAULT_MAX_SHARD_SIZE, config: Any = None,
                  prefix: Optional[str] = None, adapter_dir: Optional[str] = DEFAULT_ADAPTER_DIR,
                  adapter_only: bool = False, contributes: bool = True) -> Exported:
    """Write a running job's ``module`` (on the engine, its flat ``groups``) as a Hugging Face model
    directory from rank 0, gathering one tensor at a time over ``comm`` (every rank). A collective:
    call it on every rank; ``contributes=False`` on the ranks whose pieces another rank holds too
    (hybrid sharding's replicas: checkpoint/sharded.py ``writes_shards``)."""
    error, plan, config_text = "", None, None
    try:  # what can fail on one rank alone (a config file it cannot read) fails on every rank, before a gather
        plan = make_plan(module, prefix, merge=not adapter_only)
        layout.export_dtype(dtype), layout.parse_size(max_shard_size)
        config_text = read_config(config) if config is not None else None
    except Exception as err:  # noqa: BLE001 - said on every rank together
        error = f"{type(err).__name__}: {err}"
    errors = [(r, e) for r, e in enumerate(comm.all_gather_object(error)) if e]
    if errors:
        raise ValueError(f"save_pretrained failed on rank {errors[0][0]} before anything was gathered: {errors[0][1]}")
    assert plan is not None
    return write_export(out_dir, plan, LiveSource(module, groups, comm, contributes), layout.export_dtype(dtype),
                        max_shard_size, config_text, adapter_dir, adapter_only)


# ---- transformers' and peft's own save_pretrained on a sharded model -------------------------

_UNSET = object()


def guard_save_pretrained(module: nn.Module, export: Callable[..., Exported]) -> None:
    """Replace the ``save_pretrained`` of every transformers and peft model inside ``module`` (whose
    parameters stage 3 shards: their own would write empty tensors) by the streaming export.

    [Note: save_pretrained at stage 3]
    transformers' convention for a distributed job is to call ``save_pretrained`` on every process
    with ``is_main_process`` true on one: called so, the instance's method runs the export (a
    collective), writing the full weights (peft's writes the adapter alone, as peft does). Called
    without ``is_main_process``, it is most likely called on rank 0 alone (``if rank == 0:``), where
    a collective would hang the job: it raises at once, naming the call that works, and writes
    nothing. With ``state_dict=`` the caller gathered the weights: transformers' own method runs.
    """
    for path, sub in list(module.named_modules()):
        own = getattr(type(sub), "save_pretrained", None)  # peft's LoraModel forwards it to the model inside
        if own is None or not (is_peft_model(sub) or is_pretrained_model(sub)):
            continue
        prefix = path + "." if path else ""
        peft_model = is_peft_model(sub)

        def save_pretrained(save_directory: Any, *args: Any, is_main_process: Any = _UNSET, state_dict: Any = None,
                            max_shard_size: Any = "50GB", _sub: nn.Module = sub, _own: Any = own,
                            _prefix: str = prefix, _peft: bool = peft_model, **kwargs: Any) -> Any:
            if state_dict is not None:
                options = {} if is_main_process is _UNSET else {"is_main_process": is_main_process}
                return _own(_sub, save_directory, *args, state_dict=state_dict, max_shard_size=max_shard_size,
                            **options, **kwargs)
            if is_main_process is _UNSET:
                raise RuntimeError(
                    f"{type(_sub).__name__}.save_pretrained: at ZeRO stage 3 this model's weights are sharded over "
                    "the ranks, so saving them is a collective. Call it on every rank with "
                    "save_pretrained(dir, is_main_process=(rank == 0)), or the strategy's save_pretrained(dir) on "
                    "every rank (zero-consolidate CKPT --hf DIR converts a checkpoint offline). Nothing was written.")
            unsupported = {k: v for k, v in kwargs.items() if k not in ("safe_serialization", "save_embedding_layers")}
            if args or unsupported or kwargs.get("safe_serialization", True) is False:
                raise TypeError(f"{type(_sub).__name__}.save_pretrained at ZeRO stage 3 writes safetensors with "
                                f"max_shard_size only; {sorted(unsupported) or list(args)} are not supported here.")
            return export(save_directory, prefix=_prefix, max_shard_size=max_shard_size, adapter_only=_peft)

        # on this instance only (the class is the user's), and not in its copies: engine/params/attached.py
        attach_attribute(sub, "save_pretrained", save_pretrained)
