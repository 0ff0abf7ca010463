"""Sharded checkpoints of a ZeRO-trained module: each rank saves what it owns, and loads the ranges it needs.

Names (see [Note: checkpoint layout] in checkpoint/store.py): ``model/<name>`` is a parameter's working weights
or a buffer, ``master/<name>`` the fp32 master copy of a low-precision parameter, and
``optim/<i>/<key>/<name>`` an elementwise state tensor (``exp_avg``...) of optimizer ``i``. A
parameter's ``<name>`` is its first name in ``module.named_parameters()``; a tied parameter's other
names map to it through ``model_keys``. What a rank owns is its pieces (see [Note: pieces]): the
flat groups say which ranges of which parameters those are. Everything else (frozen parameters at
stages 1 and 2, buffers) is whole on every rank, and rank 0 saves it.

[Note: stored optimizer state]
With ``optimizer_state_dtype`` "bf16" or "int8" a checkpoint keeps the state as the step stores it
(engine/optim/step/lowp.py), not decoded to fp32: bf16 values under the key's usual name, and int8 state
as two tensors, ``optim/<i>/<key>:codes/<name>`` (uint8, one per element of the flattened
parameter) and ``optim/<i>/<key>:scales/<name>`` (fp32, one per ``block`` elements from the
parameter's start). The optimizer's record says so in ``stored_form`` (per parameter and key: the
form, and for int8 the block, the map and the parameter's shape). In every layout of the same
block the blocks start at multiples of ``block`` from the parameter's start (the flat layout pads to
them: see [Note: blocks that survive a reshard] in engine/optim/lowp.py), so each rank saves whole ranges
of both tensors; a rank loading any other layout reads the blocks that cover its range and decodes
them (``StoredInt8``). A load into the same dtype and block encodes the decoded values again, which
gives the same codes (a decoded value encodes to itself); into another dtype it converts, with a log
line. ``zero-consolidate`` decodes the state into torch's fp32 layout.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..engine.comm.collectives import Collectives
from ..engine.optim.lowp import Int8State
from ..engine.buffers.flat import FlatGroup
from ..engine.comm.topology import HybridGroups
from ..engine.optim.optimizer import ZeroOptimizer
from ..engine.params.flat_parameters import FlatParameters
from ..engine.optim.state import is_elementwise
from . import store
from .files import write_durably
from .hf_plan import hf_record
from .pickled import PickledEntries, pickled_bytes, split_pickled
from .store import CheckpointError, CheckpointReader, RankWriter

if TYPE_CHECKING:
    from .background import BackgroundSaver

MODEL, MASTER = "model/", "master/"
CODES, SCALES = ":codes", ":scales"  # an int8 state tensor's two parts (see [Note: stored optimizer state])

log = logging.getLogger(__name__)


def optim_name(i: int, key: str, name: str) -> str:
    return f"optim/{i}/{key}/{name}"


def parameter_names(module: nn.Module) -> dict[nn.Parameter, str]:
    """Each parameter's canonical name: its first in ``named_parameters()`` (tied ones have several)."""
    return {p: n for n, p in reversed(list(module.named_parameters(remove_duplicate=False)))}


def flat_groups(optimizers: Sequence[ZeroOptimizer], sharder: Optional[FlatParameters]) -> list[FlatGroup]:
    """The flat groups holding the module's parameters: ``sharder``'s, or (a plain loop that kept none)
    those of the sharder each optimizer built (see [Note: one owner of the flat groups])."""
    owners = [sharder] if sharder is not None else list({id(o.sharder): o.sharder for o in optimizers}.values())
    return [g for owner in owners for g in owner.groups]


def _hybrid(optimizers: Sequence[ZeroOptimizer], sharder: Optional[FlatParameters]) -> Optional[HybridGroups]:
    """The owner of the flat groups' hybrid sharding (see [Note: hybrid sharding] in engine/comm/topology.py),
    None without it: one owner's, as every owner is built from the same config."""
    owners = [sharder] if sharder is not None else [o.sharder for o in optimizers]
    return next((o.hybrid for o in owners if o.hybrid is not None), None)


def shard_group_size(optimizers: Sequence[ZeroOptimizer], sharder: Optional[FlatParameters]) -> Optional[int]:
    """K of hybrid sharding, None without it."""
    hybrid = _hybrid(optimizers, sharder)
    return hybrid.mesh.shard_size if hybrid is not None else None


def writes_shards(optimizers: Sequence[ZeroOptimizer], sharder: Optional[FlatParameters]) -> bool:
    """Whether this rank writes its pieces: with hybrid sharding only the first shard group does (the
    others hold the same pieces), so a checkpoint is written once, not once per replica."""
    hybrid = _hybrid(optimizers, sharder)
    return hybrid is None or hybrid.replica == 0


# ---- save ----------------------------------------------------------------------------------


@dataclass
class _RankRecord:
    """What one rank wrote, sent to rank 0 for the index."""

    file: str = ""
    bytes: int = 0
    parts: list = field(default_factory=list)  # [name, file, key, start, end]
    specs: dict = field(default_factory=dict)  # name -> (shape, dtype)
    optim_scalars: list = field(default_factory=list)  # per optimizer: name -> {key: value}
    optim_tensors: list = field(default_factory=list)  # per optimizer: name -> [keys]
    optim_forms: list = field(default_factory=list)  # per optimizer: name -> {key: stored form}
    checksums: dict = field(default_factory=dict)  # key -> checksum of that part's bytes
    error: str = ""


def _collect(rank: int, module: nn.Module, optimizers: Sequence[ZeroOptimizer],
             sharder: Optional[FlatParameters], checksums: bool,
             buffers: Optional[dict[str, torch.Tensor]] = None) -> tuple[RankWriter, _RankRecord]:
    names = parameter_names(module)
    writer, record = RankWriter(rank, with_checksums=checksums, buffers=buffers), _RankRecord()

    def add(name: str, values: torch.Tensor, start: int, shape: torch.Size) -> None:
        record.specs[name] = (list(shape), str(values.dtype).removeprefix("torch."))
        writer.add(name, values, start)

    grouped: set[nn.Parameter] = set()
    mine = writes_shards(optimizers, sharder)  # see [Note: hybrid sharding] in engine/comm/topology.py
    for g in flat_groups(optimizers, sharder):
        grouped.update(g.params)
        for i, (p, shape) in enumerate(zip(g.params, g.shapes)):
            record.specs[MODEL + names[p]] = (list(shape), str(g.dtype).removeprefix("torch."))
            if g.master_shard is not None:
                record.specs[MASTER + names[p]] = (list(shape), str(g.master_shard.dtype).removeprefix("torch."))
        for piece in g.pieces if mine else ():
            p, shape = g.params[piece.param], g.shapes[piece.param]
            add(MODEL + names[p], g.weights(piece), piece.param_start, shape)
            if g.master_shard is not None:
                add(MASTER + names[p], g.stepped(piece), piece.param_start, shape)
    for key, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor) or value in grouped:
            continue
        name = MODEL + (names[value] if isinstance(value, nn.Parameter) else key)
        if rank == 0 and name not in record.specs:  # a tied parameter has several keys but one name
            add(name, value, 0, value.shape)
        record.specs.setdefault(name, (list(value.shape), str(value.dtype).removeprefix("torch.")))

    for i, zopt in enumerate(optimizers):
        scalars: dict[str, dict[str, Any]] = {}
        tensors: dict[str, list[str]] = {}
        forms: dict[str, dict[str, dict[str, Any]]] = {}

        def add_state(key: str, name: str) -> None:
            if key not in tensors.setdefault(name, []):
                tensors[name].append(key)

        if zopt.step_backend.whole_parameters:  # each owner writes its parameters' state whole (whole.py)
            for param, state in zopt.step_backend.owned_items() if mine else ():
                name = names[param]
                for key, value in state.items():
                    if is_elementwise(value):
                        add(optim_name(i, key, name), value.detach().reshape(-1), 0, value.shape)
                        add_state(key, name)
                    else:
                        scalars.setdefault(name, {})[key] = value.detach().cpu().clone() if isinstance(
                            value, torch.Tensor) else value
        with zopt.materialized_state(decoded=False):  # state offloaded to disk is read back for this
            for ref in zopt.pieces() if mine and not zopt.step_backend.whole_parameters else ():
                name, start, shape = names[ref.param], ref.piece.param_start, ref.group.shapes[ref.piece.param]
                for key, value in zopt.piece_state(ref).items():
                    if is_elementwise(value):
                        add(optim_name(i, key, name), value, start, shape)
                        add_state(key, name)
                    else:  # a number per parameter (the step count), the same in each of its pieces
                        scalars.setdefault(name, {})[key] = value.detach().cpu().clone() if isinstance(
                            value, torch.Tensor) else value
                for key, stored in zopt.step_backend.stored_state((ref.group_index, ref.index)).items():
                    add_state(key, name)
                    if isinstance(stored, Int8State):  # see [Note: stored optimizer state]
                        assert start % stored.block == 0, "int8 blocks start at multiples of the block"
                        add(optim_name(i, key + CODES, name), stored.codes, start, torch.Size([shape.numel()]))
                        add(optim_name(i, key + SCALES, name), stored.scales, start // stored.block,
                            torch.Size([-(-shape.numel() // stored.block)]))
                        forms.setdefault(name, {})[key] = {"form": "int8", "block": stored.block,
                                                           "signed": stored.signed, "shape": list(shape)}
                    else:  # bf16 values
                        add(optim_name(i, key, name), stored.values, start, shape)
                        forms.setdefault(name, {})[key] = {"form": "bf16"}
        record.optim_scalars.append(scalars)
        record.optim_tensors.append(tensors)
        record.optim_forms.append(forms)
    return writer, record


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def on_every_rank(comm: Collectives, load: Callable[[], None]) -> None:
    """Run ``load`` (no collectives inside) and raise on every rank if it failed on any: a rank that
    cannot read its part must not leave the others waiting in the next collective."""
    error, mine = "", None
    try:
        load()
    except Exception as err:  # every rank must reach the all-gather below
        error, mine = _error(err), err
    failed = [(r, e) for r, e in enumerate(comm.all_gather_object(error)) if e]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"loading the checkpoint failed on rank {rank}: {message}") from mine


def save_sharded(path: Any, checkpoint: dict[str, Any], module: nn.Module, optimizers: Sequence[ZeroOptimizer],
                 sharder: Optional[FlatParameters], comm: Collectives, stage: int, checksums: bool = True,
                 background: Optional["BackgroundSaver"] = None) -> None:
    """Write ``checkpoint`` (Lightning's dict) as a sharded checkpoint directory. A collective.

    ``checkpoint["state_dict"]`` and ``checkpoint["optimizer_states"]`` are ignored: the weights and
    optimizer state come from the engine, each rank writing its own pieces. Without an
    ``"optimizer_states"`` key (a weights-only save) no optimizer state is written.
    ``checksums=False`` records none (see [Note: checksums]): only to measure what they cost, as
    benchmarks/bench_checkpoint.py does; such a checkpoint loads unverified, with a warning.
    With a ``background`` saver the call returns once each rank's tensors are copied into its host
    buffers, and the files are written behind it (see [Note: saving in the background] in checkpoint/background.py).
    """
    path = Path(path)
    if background is not None:
        background.wait()  # a second save waits for the first (and raises what it failed with)
    snapshot = _snapshot(path, checkpoint, module, optimizers, sharder, comm, stage, checksums,
                         background.buffers if background is not None else None)
    if background is None:
        snapshot.write(comm)
    else:
        background.start(snapshot, comm)


@dataclass
class _Snapshot:
    """A save's state once the foreground part is done: this rank's tensors copied out of the engine
    (``writer``), and what rank 0 needs for the index, taken from the module and the optimizers as they
    were at the save. ``write`` writes it and commits it; it touches neither the module nor the optimizers,
    so it may run on another thread while training goes on."""

    path: Path
    state: dict[str, Any]  # Lightning's dict without the weights, and the module's keys
    with_optimizers: bool
    param_groups: list  # per optimizer: its param groups, parameters by name
    writer: Optional[RankWriter]
    record: _RankRecord
    stage: int
    checksums: bool
    shard_group_size: Optional[int] = None  # hybrid sharding's K: the layout that wrote it
    pickled: bytes = b""  # rank 0: pickled_objects.pt, the objects a safe load refuses (checkpoint/pickled.py)

    def write(self, comm: Collectives) -> None:
        """Write the rank file, agree over ``comm`` that every rank did, and commit (rank 0). A collective
        of ``comm``; raises the same CheckpointError on every rank if any failed."""
        tmp, record = store.partial_dir(self.path), self.record
        try:
            if record.error:
                raise CheckpointError(record.error)
            record.file, record.bytes = self.writer.file, self.writer.write(tmp)
            record.parts = [[p.name, p.file, p.key, p.start, p.end] for p in self.writer.parts]
            record.checksums = self.writer.checksums
        except Exception as err:  # every rank must reach the all-gather below, whatever went wrong
            record.error = record.error or _error(err)
        try:
            records: list[_RankRecord] = comm.all_gather_object(record)
        except Exception as err:  # a rank died or left: its file may be half written
            if comm.rank == 0:
                store.discard(self.path)
            raise CheckpointError(f"saving the checkpoint {self.path} failed: the ranks could not agree that every "
                                  f"file was written (another rank died or stopped?): {_error(err)}. Nothing was "
                                  "written over the previous checkpoint.") from err
        failed = [(r, rec.error) for r, rec in enumerate(records) if rec.error]
        status = ""
        if comm.rank == 0:
            if not failed:
                try:
                    _finish(self, records)
                except Exception as err:
                    failed, status = [(0, _error(err))], _error(err)
            if failed:
                store.discard(self.path)
        status = comm.broadcast_object(status)
        if failed or status:
            where = failed[0] if failed else (0, status)
            raise CheckpointError(f"saving the checkpoint {self.path} failed on rank {where[0]}: {where[1]}. Nothing "
                                  "was written over the previous checkpoint.")


def _snapshot(path: Path, checkpoint: dict[str, Any], module: nn.Module, optimizers: Sequence[ZeroOptimizer],
              sharder: Optional[FlatParameters], comm: Collectives, stage: int, checksums: bool,
              buffers: Optional[dict[str, torch.Tensor]]) -> _Snapshot:
    """The foreground part of a save: the partial directory made, and this rank's tensors copied out."""
    with_optimizers = "optimizer_states" in checkpoint
    layout = shard_group_size(optimizers, sharder)
    optimizers = list(optimizers) if with_optimizers else []
    # the front end's state, which rank 0 alone writes; what a safe load refuses goes beside it
    state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    pickled: PickledEntries = {}
    status = ""
    if comm.rank != 0:
        state = {}  # written by rank 0 alone: nothing to copy here
    else:
        try:
            state, pickled = split_pickled(state)  # see [Note: pickled objects] in checkpoint/pickled.py
            store.prepare_partial(path)
        except CheckpointError as err:
            status = f"saving the checkpoint {path}: {err}"
        except OSError as err:
            status = f"cannot create the checkpoint directory next to {path}: {_error(err)}"
    status = comm.broadcast_object(status)
    if status:
        raise CheckpointError(status)
    writer, record = None, _RankRecord()
    try:
        writer, record = _collect(comm.rank, module, optimizers, sharder, checksums, buffers)
    except Exception as err:  # reported by every rank in write(), after the agreement
        record.error = _error(err)
    names = parameter_names(module)
    model_keys, extra = {}, {}
    for key, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):
            model_keys[key] = MODEL + (names[value] if isinstance(value, nn.Parameter) else key)
        else:
            extra[key] = value
    param_groups = [[{**{k: v for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
                     for g in zopt.param_groups] for zopt in optimizers]
    if buffers is not None:  # the state outlives this call: training may change what it refers to
        state, extra, param_groups = copy.deepcopy((state, extra, param_groups))
    state["zero_checkpoint"] = {"model_keys": model_keys, "model_extra_state": extra}
    if pickled:
        state["zero_checkpoint"]["pickled_objects"] = [list(p) for p in pickled]
    export_plan = hf_record(module)  # what zero-consolidate --hf writes: see checkpoint/hf_plan.py
    if export_plan is not None:
        state["zero_checkpoint"]["hf_export"] = copy.deepcopy(export_plan) if buffers is not None else export_plan
    return _Snapshot(path, state, with_optimizers, param_groups, writer, record, stage, checksums, layout,
                     pickled_bytes(pickled) if pickled else b"")  # pickled now: the objects may change later


def _finish(snapshot: _Snapshot, records: list[_RankRecord]) -> None:
    """Rank 0: the index and trainer state, then the swap into place."""
    tmp = store.partial_dir(snapshot.path)
    tensors: dict[str, dict[str, Any]] = {}
    for rec in records:
        for name, (shape, dtype) in rec.specs.items():
            tensors.setdefault(name, {"shape": shape, "dtype": dtype, "parts": []})
        for name, file, key, start, end in rec.parts:
            tensors[name]["parts"].append([file, key, start, end])
    state = dict(snapshot.state)
    state["zero_checkpoint"] = {
        **state["zero_checkpoint"],
        "optimizers": _optimizer_records(snapshot.param_groups, records) if snapshot.with_optimizers else None,
    }
    trainer_state = store.write_trainer_state(tmp, state)
    index = {"format": store.FORMAT, "world_size": len(records), "stage": snapshot.stage,
             "shard_group_size": snapshot.shard_group_size,
             "files": {rec.file: {"bytes": rec.bytes} for rec in records}, "tensors": tensors}
    if snapshot.pickled:  # see [Note: pickled objects] in checkpoint/pickled.py
        write_durably(tmp / store.PICKLED_OBJECTS, snapshot.pickled)
        index["pickled_objects"] = {"bytes": len(snapshot.pickled)}
        if snapshot.checksums:
            index["pickled_objects"]["checksum"] = store.checksum(snapshot.pickled)
    if snapshot.checksums:  # see [Note: checksums]
        for rec in records:
            index["files"][rec.file]["checksums"] = rec.checksums
        index.update(checksum=store.CHECKSUM, trainer_state=trainer_state)
    store.write_index(tmp, index)
    store.commit(snapshot.path)


def _optimizer_records(param_groups: list, records: list[_RankRecord]) -> list[dict[str, Any]]:
    """Per optimizer: its param groups (parameters by name) and the state keys of each parameter."""
    out = []
    for i, groups in enumerate(param_groups):
        scalars: dict[str, dict[str, Any]] = {}
        tensors: dict[str, list[str]] = {}
        forms: dict[str, dict[str, Any]] = {}
        for rec in records:
            for name, values in rec.optim_scalars[i].items():
                scalars.setdefault(name, {}).update(values)
            for name, keys in rec.optim_tensors[i].items():
                tensors.setdefault(name, [])
                tensors[name] += [k for k in keys if k not in tensors[name]]
            for name, by_key in rec.optim_forms[i].items():
                forms.setdefault(name, {}).update(by_key)
        out.append({"state": scalars, "tensor_state": tensors, "param_groups": groups, "stored_form": forms})
    return out


# ---- load ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredTensor:
    """An elementwise optimizer state tensor in a checkpoint, read a range at a time (engine/optim/state.py
    slices it with ``read_range``, so a rank reads only its pieces)."""

    reader: CheckpointReader
    name: str

    @property
    def shape(self) -> torch.Size:
        return self.reader.shape(self.name)

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    def read_range(self, start: int, end: int) -> torch.Tensor:
        return self.reader.read(self.name, start, end)


@dataclass(frozen=True)
class StoredInt8:
    """An int8 state tensor in a checkpoint (codes and scales: see [Note: stored optimizer state]), read
    a range at a time as fp32, decoding the blocks that cover it."""

    reader: CheckpointReader
    codes: str
    scales: str
    signed: bool
    block: int
    shape: torch.Size

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    def read_range(self, start: int, end: int) -> torch.Tensor:
        lo, hi = start - start % self.block, min(self.numel(), -(-end // self.block) * self.block)
        state = Int8State(self.reader.read(self.codes, lo, hi), self.reader.read(self.scales, lo // self.block,
                                                                                  -(-hi // self.block)),
                          self.signed, self.block)
        return state.decode()[start - lo: end - lo]


def state_source(reader: CheckpointReader, rec: dict[str, Any], i: int, key: str, name: str) -> Any:
    """Optimizer ``i``'s elementwise state ``key`` of parameter ``name``, to read a range at a time."""
    form = rec.get("stored_form", {}).get(name, {}).get(key, {})
    if form.get("form") == "int8":
        return StoredInt8(reader, optim_name(i, key + CODES, name), optim_name(i, key + SCALES, name),
                          form["signed"], form["block"], torch.Size(form["shape"]))
    return StoredTensor(reader, optim_name(i, key, name))


def _log_conversion(rec: dict[str, Any], zopt: ZeroOptimizer, i: int) -> None:
    """Say when the state's stored form in the checkpoint is not the one this run stores."""
    config = zopt.config
    here = config.optimizer_state_dtype, (config.optimizer_state_block_size if config.optimizer_state_dtype == "int8"
                                          else None)
    saved = {(f["form"], f.get("block")) for by_key in rec.get("stored_form", {}).values() for f in by_key.values()}
    if saved and saved != {here}:
        log.info("optimizer %d: the checkpoint stores its state as %s; this run stores it as %s: converted on load",
                 i, ", ".join(f"{form} (block {block})" if block else form for form, block in sorted(saved)),
                 f"{here[0]} (block {here[1]})" if here[1] else here[0])


def _master_name(stored: str) -> str:
    return MASTER + stored[len(MODEL):]


def _best_source(reader: CheckpointReader, stored: str) -> str:
    """A parameter's most precise saved values: the fp32 master when there is one."""
    master = _master_name(stored)
    return master if master in reader else stored


def check_model_keys(saved: dict[str, Any], reader: CheckpointReader, module: nn.Module,
                     groups: Sequence[FlatGroup], strict: bool) -> None:
    """Raise, naming the keys, when the checkpoint is for another model."""
    entries = module.state_dict(keep_vars=True)
    model_keys: dict[str, str] = saved["model_keys"]
    missing = [k for k, v in entries.items() if isinstance(v, torch.Tensor) and k not in model_keys]
    unexpected = [k for k in model_keys if k not in entries]
    if strict and (missing or unexpected):
        raise CheckpointError(f"the checkpoint at {reader.path} does not match the model: missing keys {missing[:10]}, "
                              f"unexpected keys {unexpected[:10]}. Load it into the model it was saved from, or pass "
                              "strict=False (LightningModule.strict_loading) to load the keys that match.")
    shape_of = {p: shape for g in groups for p, shape in zip(g.params, g.shapes)}
    for key, value in entries.items():
        if key in model_keys and isinstance(value, torch.Tensor):
            ours, theirs = shape_of.get(value, value.shape), reader.shape(model_keys[key])
            if ours != theirs:
                raise CheckpointError(f"checkpoint tensor {key!r} has shape {tuple(theirs)}, the model's has "
                                      f"{tuple(ours)}: the checkpoint at {reader.path} is for a different model.")


@torch.no_grad()
def load_model(reader: CheckpointReader, saved: dict[str, Any], module: nn.Module, groups: Sequence[FlatGroup],
               strict: bool = True) -> None:
    """Load weights and buffers; sharded groups read only this rank's ranges. Not a collective."""
    check_model_keys(saved, reader, module, groups, strict)
    model_keys: dict[str, str] = saved["model_keys"]
    source_of: dict[torch.Tensor, str] = {}  # each tensor's saved values, under its first key (tied: once)
    for key, value in module.state_dict(keep_vars=True).items():
        if key in model_keys and isinstance(value, torch.Tensor) and value not in source_of:
            stored = model_keys[key]
            source_of[value] = _best_source(reader, stored) if isinstance(value, nn.Parameter) else stored
    sharded = [g for g in groups if not g.resident]
    in_shards = {p for g in sharded for p in g.params}
    for value, source in source_of.items():
        if value not in in_shards:  # whole on every rank
            value.data.copy_(reader.full(source))
    for g in sharded:  # this rank's pieces only
        for piece in g.pieces:
            source = source_of.get(g.params[piece.param])
            if source is not None:
                g.weights(piece).copy_(reader.read(source, piece.param_start, piece.param_end))
        g.shard_written()  # a gathered copy no longer matches: its unit gathers it again
    for key, value in saved.get("model_extra_state", {}).items():
        _set_extra_state(module, key, value)
    load_masters(reader, saved, module, groups)


def _set_extra_state(module: nn.Module, key: str, value: Any) -> None:
    """``key`` is ``<submodule path>._extra_state`` (``_extra_state`` for the module itself)."""
    module.get_submodule(key.removesuffix("_extra_state").rstrip(".")).set_extra_state(value)


@torch.no_grad()
def load_masters(reader: CheckpointReader, saved: dict[str, Any], module: nn.Module,
                 groups: Sequence[FlatGroup]) -> None:
    """fp32 master copies from the checkpoint's masters (or its weights, saved without masters)."""
    names = parameter_names(module)
    model_keys: dict[str, str] = saved["model_keys"]
    for g in groups:
        if g.master_shard is None:
            continue
        g.prepare_master_write()
        for piece in g.pieces:
            key = names.get(g.params[piece.param])
            if key in model_keys:
                values = reader.read(_best_source(reader, model_keys[key]), piece.param_start, piece.param_end)
                g.stepped(piece).copy_(values)


@torch.no_grad()
def masters_from_state_dict(state_dict: dict[str, Any], module: nn.Module,
                            optimizers: Sequence[ZeroOptimizer]) -> None:
    """Low-precision weights' fp32 masters from a whole state dict that holds more precise values than
    the weights (a consolidated or DeepSpeed checkpoint: fp32), each rank its own pieces; loading the
    state dict into the bf16/fp16 module alone would round them. Not a collective."""
    names = parameter_names(module)
    for zopt in optimizers:
        for g in zopt.groups:
            if g.master_shard is None:
                continue
            g.prepare_master_write()
            for piece in g.pieces:
                value = state_dict.get(names.get(g.params[piece.param], ""))
                if isinstance(value, torch.Tensor) and value.dtype.itemsize > g.dtype.itemsize:
                    g.stepped(piece).copy_(value.reshape(-1)[piece.param_start : piece.param_end])


def load_optimizers(reader: CheckpointReader, saved: dict[str, Any], module: nn.Module,
                    optimizers: Sequence[ZeroOptimizer]) -> None:
    """Load each optimizer's state from the checkpoint, reading only this rank's ranges; then the
    master weights. A collective (as ``ZeroOptimizer.load_state_dict``)."""
    records = saved.get("optimizers")
    if records is None:
        raise CheckpointError(f"the checkpoint at {reader.path} holds weights only (saved with weights_only=True or "
                              "ModelCheckpoint(save_weights_only=True)), so training cannot resume from it; load its "
                              "weights into the model instead, or resume from a full checkpoint.")
    if len(records) != len(optimizers):
        raise CheckpointError(f"the checkpoint at {reader.path} has {len(records)} optimizers, this run has "
                              f"{len(optimizers)}: configure_optimizers returns a different set.")
    names = parameter_names(module)
    for i, (zopt, rec) in enumerate(zip(optimizers, records)):
        ours = [[names.get(p, "<not in the module>") for p in g["params"]] for g in zopt.param_groups]
        theirs = [g["params"] for g in rec["param_groups"]]
        if ours != theirs:
            raise CheckpointError(f"optimizer {i} of the checkpoint at {reader.path} steps other parameters than this "
                                  f"run's: {_first_difference(theirs, ours)}. It was saved for a different model or "
                                  "configure_optimizers.")
        _log_conversion(rec, zopt, i)
        zopt.load_state_dict(torch_layout(rec, lambda key, name, i=i, rec=rec: state_source(reader, rec, i, key, name)))
        load_masters(reader, saved, module, zopt.groups)


def torch_layout(rec: dict[str, Any], tensor: Callable[[str, str], Any]) -> dict[str, Any]:
    """One saved optimizer as torch's state dict: parameters numbered in param-group order, the
    elementwise state ``tensor(key, name)`` (a whole tensor, or one read a range at a time)."""
    state, groups, index = {}, [], 0
    for group in rec["param_groups"]:
        ids = []
        for name in group["params"]:
            entry = dict(rec["state"].get(name, {}))
            for key in rec["tensor_state"].get(name, []):
                entry[key] = tensor(key, name)
            if entry:
                state[index] = entry
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


def _first_difference(theirs: list[list[str]], ours: list[list[str]]) -> str:
    if len(theirs) != len(ours):
        return f"{len(theirs)} param groups saved, {len(ours)} here"
    for gi, (a, b) in enumerate(zip(theirs, ours)):
        for j in range(max(len(a), len(b))):
            x, y = (a[j] if j < len(a) else None), (b[j] if j < len(b) else None)
            if x != y:
                return f"param group {gi}, position {j}: saved {x!r}, here {y!r}"
    return "none found"
