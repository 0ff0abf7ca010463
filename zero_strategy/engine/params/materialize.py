"""A model built on the meta device gets real tensors here, one unit at a time.

[Note: init-time sharding]
A model built on the meta device (ZeroStrategy's ``model_sharded_context``, around Lightning's
``configure_model``) never exists whole: units are materialised one at a time, in unit order,
broadcast from rank 0, sharded, and released before the next unit is built. Each parameter's values
come from one of three places, in this order of precedence:
1. a *source* set by ``load_pretrained`` or ``from_pretrained`` (a pretrained file): after sharding,
   each rank reads the element ranges of its own pieces (see [Note: reading pretrained slices] in
   checkpoint/pretrained_files.py), never the whole tensor at stage 3;
2. its *recorded construction* (a model built inside the context, see [Note: recorded construction] in
engine/params/deferred_init.py), and the changes the script made to it before setup (see [Note:
   changes before setup] in engine/params/edits.py): after sharding they are replayed, one tensor at
   a time, and each rank keeps its pieces, so the model equals an eager build with the same seed;
3. else its module's own ``reset_parameters()``, run when the unit is materialised (the way for
   modules built on meta outside a recording).
For 1 and 2 materialisation only allocates (nothing is drawn or initialised then), and
``fill_deferred`` writes the values once every unit is sharded, so no ``reset_parameters`` ever
overwrites a loaded weight. Every rank replays from rank 0's random state, so the same seed gives
the same model on 1 or 2 ranks. Buffers are whole on every rank and get their values the same way.
"""

from __future__ import annotations

import warnings
import weakref
import zlib
from typing import Callable, Mapping, Optional, Protocol, Sequence

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..buffers.flat import FlatGroup
from . import edits
from .edits import changed_since_source
from .recording import Recording, Ref, _recorded_params, forget, recorded_buffer, recorded_param

Reader = Callable[[int, int], torch.Tensor]  # elements [start, end) of the flattened value, any dtype


class Source(Protocol):
    """Where a parameter's (or buffer's) values come from: see [Note: init-time sharding]."""

    def read(self, start: int, end: int) -> torch.Tensor: ...


_param_sources: "WeakIdKeyDictionary" = WeakIdKeyDictionary()  # nn.Parameter -> Source
_buffer_sources: "weakref.WeakKeyDictionary[nn.Module, dict[str, Source]]" = weakref.WeakKeyDictionary()


def set_param_source(p: nn.Parameter, source: Source) -> None:
    _param_sources[p] = source
    _mark_source(recorded_param(p), id(p), p)


def set_buffer_source(module: nn.Module, name: str, source: Source) -> None:
    _buffer_sources.setdefault(module, {})[name] = source
    _mark_source(recorded_buffer(module, name), (id(module), name), module._buffers[name])


def _mark_source(entry: Optional[tuple[Recording, Ref]], key: object, t: torch.Tensor) -> None:
    """A recorded tensor's values now come from a file: a change recorded after this would be lost
    (``fill_deferred`` refuses it: see [Note: changes before setup] in engine/params/edits.py). Inside
    the construction (``from_pretrained``) its Recording is the one being recorded."""
    rec = entry[0] if entry is not None else (edits.constructions[-1].recording if edits.constructions else None)
    if rec is not None and t.is_meta:
        rec.sourced[key] = (len(rec.calls), t.untyped_storage()._cdata)


def is_deferred(p: nn.Parameter) -> bool:
    """Whether ``p`` gets its values from ``fill_deferred`` (a source, or a recorded construction)."""
    return p in _param_sources or recorded_param(p) is not None


_deferred_param = is_deferred


def _deferred_buffer(m: nn.Module, name: str) -> bool:
    return name in _buffer_sources.get(m, {}) or recorded_buffer(m, name) is not None


def materialize_meta(params: Sequence[nn.Parameter], owners_of: Mapping[nn.Parameter, Sequence[nn.Module]],
                     device: torch.device) -> None:
    """Give the meta parameters among ``params`` storage on ``device``, and their modules' own
    initialisation unless ``fill_deferred`` will give them their values; ``owners_of`` names the
    modules that hold each parameter directly."""
    on_meta = [p for p in params if p.is_meta]
    if on_meta:
        _materialize(list(dict.fromkeys(m for p in on_meta for m in owners_of[p])), device)


def _allocate(m: nn.Module, device: torch.device) -> None:
    # not Module.to_empty: it replaces meta Parameters by new objects, and the sharder, the
    # optimizer and tied modules all hold these ones; swap_tensors keeps each object
    for p in m.parameters(recurse=False):
        if p.is_meta:  # swap_tensors refuses a tensor with weak references: the registries' step aside
            recorded, source = _recorded_params.pop(p, None), _param_sources.pop(p, None)
            fresh = nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
            torch.utils.swap_tensors(p, fresh)
            p.__dict__.update(fresh.__dict__)  # it swaps the attributes too: the parameter keeps its own (use_muon...)
            if recorded is not None:
                _recorded_params[p] = recorded
            if source is not None:
                _param_sources[p] = source
    for name, b in m.named_buffers(recurse=False):
        if b.is_meta:
            m._buffers[name] = torch.empty_like(b, device=device)


def _materialize(owners: Sequence[nn.Module], device: torch.device) -> None:
    for m in owners:
        deferred = all(_deferred_param(p) for p in m.parameters(recurse=False) if p.is_meta) and all(
            _deferred_buffer(m, n) for n, b in m.named_buffers(recurse=False) if b.is_meta)
        if not deferred and not hasattr(m, "reset_parameters"):
            raise ValueError(
                f"{type(m).__name__} was built on the meta device (in configure_model at stage 3, or under "
                "fabric.init_module(empty_init=True)) outside the strategy's recording and has no reset_parameters() "
                "to initialise it; add one, build the model inside that context (see [Note: recorded construction]), "
                "or build it with real tensors (in __init__, or outside init_module).")
        _allocate(m, device)
        if not deferred:
            m.reset_parameters()


def materialize_buffers(module: nn.Module, device: torch.device) -> None:
    """Stage 3, a model built on meta: modules that hold buffers but no parameters (a rotary cache, a
    mask) get their buffers on ``device``, from their recording or source later (``fill_deferred``),
    else from their own ``reset_parameters()`` now; the sharder materialises the modules with
    parameters, unit by unit (see [Note: init-time sharding])."""
    for path, m in module.named_modules():
        meta = [name for name, b in m.named_buffers(recurse=False) if b.is_meta]
        if not meta or any(True for _ in m.parameters(recurse=False)):
            continue
        if all(_deferred_buffer(m, name) for name in meta):
            _allocate(m, device)
            continue
        if not callable(getattr(m, "reset_parameters", None)):
            raise ValueError(f"{path or 'the model'} ({type(m).__name__}) holds buffers on the meta device ({meta}) "
                             "and no parameters, and has no reset_parameters() to fill them; give it one, build the "
                             "model inside the strategy's context, or build that module with real tensors.")
        _allocate(m, device)
        m.reset_parameters()


# ---- writing whole values into the flat groups ---------------------------------------------


def group_places(groups: Sequence[FlatGroup]) -> dict[nn.Parameter, tuple[FlatGroup, int]]:
    """Each grouped parameter's flat group and index in it."""
    return {p: (g, i) for g in groups for i, p in enumerate(g.params)}


def write_parameter(p: nn.Parameter, read: Reader, place: Optional[tuple[FlatGroup, int]]) -> None:
    """Give ``p`` the values ``read`` returns: into this rank's pieces of its flat group (and their
    master copies, straight from the values read: a bf16 file into fp32 masters loses nothing more),
    or into the whole tensor where it is whole on this rank (a resident group, an ungrouped one)."""
    with torch.no_grad():
        if place is None:
            p.data.view(-1).copy_(read(0, p.numel()))
            return
        group, index = place
        group.prepare_master_write()
        master = group.master_shard if group.master_shard is not getattr(group, "shard", None) else None
        pieces = [piece for piece in group.pieces if piece.param == index]
        if group.resident:
            value = read(0, group.layout.numels[index])
            p.data.view(-1).copy_(value)
            for piece in pieces:
                if master is not None:
                    FlatGroup.shard_slice(master, piece).copy_(value[piece.param_start:piece.param_end])
            return
        for piece in pieces:
            value = read(piece.param_start, piece.param_end)
            FlatGroup.shard_slice(group.shard, piece).copy_(value)  # type: ignore[attr-defined]
            if master is not None:
                FlatGroup.shard_slice(master, piece).copy_(value)


def _whole(value: torch.Tensor) -> Reader:
    flat = value.reshape(-1)
    return lambda start, end: flat[start:end]


def fill_deferred(module: nn.Module, groups: Sequence[FlatGroup], broadcast_rng: Callable[[torch.Tensor], None],
                  device: torch.device, any_rank: Callable[[bool], bool] = bool) -> None:
    """Write the values of ``module``'s deferred parameters and buffers (sources, then recordings: see
    [Note: init-time sharding]) into ``groups`` and the buffers. ``broadcast_rng`` makes a tensor
    rank 0's (in place): every rank replays from rank 0's random state; ``any_rank(flag)`` is whether
    the flag is set on some rank. A collective: every rank must call it."""
    places = group_places(groups)
    params = list(dict.fromkeys(module.parameters()))
    buffers = [(m, name) for m in module.modules() for name in m._buffers if m._buffers[name] is not None]
    recordings: dict[int, tuple[Recording, dict[int, list], bool]] = {}

    def wanted(entry: Optional[tuple[Recording, Ref]], key: object) -> None:
        rec, ref = entry  # type: ignore[misc]
        _, table, _ = recordings.setdefault(id(rec), (rec, {}, False))
        table.setdefault(ref.root, []).append((key, ref))

    skipped: set[int] = set()
    for p in params:
        entry = recorded_param(p)
        if p in _param_sources:
            if entry is not None:
                skipped.add(id(entry[0]))
        elif entry is not None:
            wanted(entry, ("param", p))
    for m, name in buffers:
        entry = recorded_buffer(m, name)
        if name in _buffer_sources.get(m, {}):
            if entry is not None:
                skipped.add(id(entry[0]))
        elif entry is not None:
            wanted(entry, ("buffer", m, name))

    _check_agreed(module, [rec for rec, _, _ in recordings.values()], broadcast_rng, any_rank)

    def sink(key: tuple, value: torch.Tensor) -> None:
        if key[0] == "param":
            write_parameter(key[1], _whole(value), places.get(key[1]))
        else:
            _, m, name = key
            m._buffers[name] = value.to(device=device, dtype=m._buffers[name].dtype, copy=True)

    for rec_id, (rec, table, _) in recordings.items():
        partial = rec_id in skipped  # a pretrained model's build: its loaded weights are not computed
        if not rec.exact and not partial:
            warnings.warn("the model's construction drew random numbers on real tensors (a factory given "
                          "device='cpu'?); its replay on meta tensors does not draw them, so the initial values "
                          "differ from an eager build's with the same seed.", stacklevel=3)
        state = rec.rng_state.clone()
        broadcast_rng(state)
        rec.rng_state = state
        if rec.post_rng is not None:  # the changes after the construction: see [Note: changes before setup]
            state = rec.post_rng[1].clone()
            broadcast_rng(state)
            rec.post_rng = (rec.post_rng[0], state)
        rec.replay(table, sink, only_needed=partial)
    for p in params:
        source = _param_sources.pop(p, None)
        if source is not None:
            write_parameter(p, source.read, places.get(p))
        forget(p)
    for m, name in buffers:
        source = _buffer_sources.get(m, {}).pop(name, None)
        if source is not None:
            target = m._buffers[name]
            m._buffers[name] = source.read(0, target.numel()).view(target.shape).to(device=device, dtype=target.dtype)
        forget(module=m, name=name)


def _check_agreed(module: nn.Module, recordings: Sequence[Recording], broadcast_rng: Callable[[torch.Tensor], None],
                  any_rank: Callable[[bool], bool]) -> None:
    """Every rank recorded the same calls (each replays its own record), and no recorded change came
    after a file was attached as the changed tensor's source (the file's values would win): see [Note:
    changes before setup] in engine/params/edits.py."""
    mine = torch.tensor([len(recordings), zlib.crc32(str([rec.digest() for rec in recordings]).encode())])
    rank0 = mine.clone()
    broadcast_rng(rank0)
    if any_rank(not torch.equal(mine, rank0)):
        raise ValueError(f"the ranks built or changed {type(module).__name__} differently before setup (its recorded "
                         f"calls differ from rank 0's{'' if torch.equal(mine, rank0) else ' on this rank'}): every "
                         "rank replays its own record of the model's construction and of the changes made to it "
                         "before setup, so build and initialise the model the same way on every rank (no "
                         "`if rank == 0:` around its initialisation; rank 0's random state is used everywhere).")
    changed = [name for name, p in module.named_parameters(remove_duplicate=False) if p in _param_sources and
               recorded_param(p) is not None and changed_since_source(recorded_param(p)[0], id(p),
                                                                      recorded_param(p)[1].root)]
    changed += [f"{path}.{name}" if path else name for path, m in module.named_modules() for name in
                _buffer_sources.get(m, {}) if recorded_buffer(m, name) is not None and changed_since_source(
                    recorded_buffer(m, name)[0], (id(m), name), recorded_buffer(m, name)[1].root)]
    if changed:
        raise ValueError(f"{changed[:5]} were changed, or used to compute other tensors, before setup after weights "
                         "were loaded into them from a file (load_pretrained, fabric.load_raw, from_pretrained): the "
                         "replay has the file's values only at the end, so the change would be lost. "
                         "Change them after setup (inside zero_strategy.gathered_parameters(model, modifier_rank=0)), "
                         "or load after changing them.")


def materialize_whole(module: nn.Module, device: torch.device, broadcast_rng: Callable[[torch.Tensor], None],
                      any_rank: Callable[[bool], bool] = bool) -> None:
    """Stages 1-2, where every rank holds the whole model anyway: a model built inside the init context
    (recorded, or with pretrained sources) gets its tensors on ``device`` and their values, read once
    into them (no second copy). Meta tensors with neither are left for ``sync_module`` to refuse."""
    owners = [m for m in module.modules()
              if any(p.is_meta for p in m.parameters(recurse=False)) or any(b.is_meta for b in m.buffers(recurse=False))]
    deferred = [m for m in owners if all(_deferred_param(p) for p in m.parameters(recurse=False) if p.is_meta)
                and all(_deferred_buffer(m, n) for n, b in m.named_buffers(recurse=False) if b.is_meta)]
    if not deferred:
        return
    for m in deferred:
        _allocate(m, device)
    fill_deferred(module, [], broadcast_rng, device, any_rank)

