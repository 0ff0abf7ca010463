"""What a script does to a model built in the init context between its construction and setup: recorded
as the construction is, replayed after it, or refused.

[Note: changes before setup]
A script that builds its model under ``fabric.init_module(empty_init=True)`` (or ``sharded_init``)
often initialises it itself before ``fabric.setup``: ``normal_`` on its parameters,
``model.apply(init_fn)``, ``reset_parameters`` partials that it sets and calls. On the meta device
those calls do nothing, so they are recorded into the construction's Recording (see [Note: recorded
construction] in engine/params/deferred_init.py): when the construction ends, its meta parameters and
buffers become *tracked*, the same objects with their class swapped for a subclass of theirs whose
``__torch_function__`` records each call on them, and makes the meta tensors such a call returns
(``p.data``, ``p[0]``) tracked too; torch.nn.init's functions that return at once on a meta tensor
(``trunc_normal_``, ``orthogonal_``...) are recorded by name while such a recording is open. Setup
``seal``s the recording first (the classes go back, nothing more is recorded), and the replay runs the
changes after the construction from the random state the process had at the first of them that draws
random numbers: the state an eager script under DDP draws from, since there
``init_module(empty_init=True)`` skips the modules' own initialisation. So the values are those of
DDP, bit for bit, whatever the construction drew. What cannot be replayed so is refused at setup,
before anything is materialised, naming the tensor and what to do:
- a parameter or buffer changed in place by a call the record did not see (its version counter
  moved: a view taken during the construction and written after), or a meta one made outside the
  record (``peft.get_peft_model`` after the context: it builds its layers real, then moves them to
  the base layer's meta device, their values lost);
- random numbers drawn on real tensors, or a seed set, between two changes that draw: the replay
  cannot draw them in between;
- a ``reset_parameters`` set on a module after its construction and not called (FSDP calls such
  partials when it materialises a meta model; DDP does not): call it before setup;
- ranks that recorded different calls (an initialisation under ``if rank == 0``), and changes to a
  tensor after a file was attached as its source: see ``fill_deferred`` in engine/params/materialize.py.
A tensor given real values before setup (``p.data = tensor``, ``load_state_dict(assign=True)``)
keeps them.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from .recording import QUERIES, Recording, Ref, _Call, _recorded_buffers, _recorded_params, forget, record_call

_CLASSES: dict[type, type] = {}  # a tensor class -> its tracked subclass
_TRACKABLE = (nn.Parameter, torch.Tensor)  # exactly these: another subclass keeps its own torch functions


class _Tracked:
    """Mixed into a tensor class: its objects' calls go to their Recording (see [Note: changes before setup])."""

    _zero_base: type

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunction():  # the call's own calls are its part, as in the construction
            rec = next((x.__dict__.get("_zero_recording") for x in tree_flatten((args, kwargs))[0]
                        if isinstance(x, _Tracked)), None)
            if rec is None:
                return func(*args, **kwargs)
            return _record_change(rec, func, args, kwargs, lambda: func(*args, **kwargs))


def _tracked_class(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Tracked{base.__name__}", (_Tracked, base), {"_zero_base": base})
    return _CLASSES[base]


def _track(rec: Recording, t: torch.Tensor) -> torch.Tensor:
    if type(t) in _TRACKABLE:
        t.__class__ = _tracked_class(type(t))
    if isinstance(t, _Tracked):
        t._zero_recording = rec
    return t


def _untrack(t: torch.Tensor) -> None:
    if isinstance(t, _Tracked):
        t.__class__ = type(t)._zero_base
        t.__dict__.pop("_zero_recording", None)


def _record_change(rec: Recording, func: Callable, args: tuple, kwargs: dict, run: Callable[[], Any]) -> Any:
    name = getattr(func, "__name__", "")
    if rec.sealed:
        if name in QUERIES:
            return run()
        raise RuntimeError(f"{name} on a meta tensor of a model that setup has taken over (a view of its parameters "
                           "taken before setup?): it would change nothing. Change the model before setup, or after it "
                           "inside zero_strategy.gathered_parameters(model, modifier_rank=0).")
    tracked = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, _Tracked)]
    versions = [x._version for x in tracked]
    before = len(rec.calls)
    out = record_call(rec, func, args, kwargs, run)
    if len(rec.calls) > before:
        written = {x.untyped_storage()._cdata for x, v in zip(tracked, versions) if x._version != v}
        _changed(rec, rec.calls[-1], written)
    for x in tracked:  # what the record saw: see seal()
        for t in (x, x._base):
            if t is not None and id(t) in rec.seen_version:
                rec.seen_version[id(t)] = t._version
    return tree_map(lambda t: _track(rec, t) if isinstance(t, torch.Tensor) and t.is_meta else t, out)


def _changed(rec: Recording, call: _Call, written: set[int]) -> None:
    """Book a change made after the construction: what it wrote, and the random state it draws from."""
    whole = rec._overwritten(call)
    rec.writes[len(rec.calls) - 1] = frozenset(written | ({whole} if whole is not None else set()))
    if not call.draws:
        return
    state = torch.random.get_rng_state()
    if rec.post_rng is None:
        rec.post_rng = (len(rec.calls) - 1, state)
    elif rec.rng_moved is None and not torch.equal(state, rec.post_rng[1]):
        shapes = [r.shape for r in tree_flatten((call.args, call.kwargs))[0] if isinstance(r, Ref)]
        rec.rng_moved = f"{call.name} on a tensor of shape {shapes[0] if shapes else '?'}"


# ---- torch.nn.init's functions that return at once on a meta tensor ------------------------------

_SKIPPING_META = ("_no_grad_trunc_normal_", "dirac_", "orthogonal_", "sparse_")
constructions: list = []  # the construction recorders open now, innermost last (deferred_init.py's)
_patched: list[tuple[dict, str, Callable]] = []
_holders = 0


def _init_wrapper(original: Callable) -> Callable:
    def wrapper(tensor, *args, **kwargs):
        if isinstance(tensor, torch.Tensor) and tensor.is_meta:
            with torch._C.DisableTorchFunction():
                if isinstance(tensor, _Tracked) and "_zero_recording" in tensor.__dict__:
                    return _record_change(tensor._zero_recording, original, (tensor, *args), kwargs, lambda: tensor)
                if constructions and not constructions[-1]._depth:
                    return record_call(constructions[-1].recording, original, (tensor, *args), kwargs, lambda: tensor)
        return original(tensor, *args, **kwargs)
    wrapper.__name__ = original.__name__
    wrapper._zero_original = original
    return wrapper


def hold_init_functions() -> Callable[[], None]:
    """Record torch.nn.init's (and transformers') functions that skip meta tensors until the returned
    function is called; holders count, so that the last one puts the originals back."""
    global _holders
    _holders += 1
    tables = [vars(torch.nn.init)]
    hf_init = sys.modules.get("transformers.initialization")
    if hf_init is not None and isinstance(getattr(hf_init, "TORCH_INIT_FUNCTIONS", None), dict):
        tables.append(hf_init.TORCH_INIT_FUNCTIONS)
    for table in tables:
        for name in _SKIPPING_META:
            if name in table and not hasattr(table[name], "_zero_original"):
                _patched.append((table, name, table[name]))
                table[name] = _init_wrapper(table[name])
    released = [False]

    def release() -> None:
        global _holders
        if released[0]:
            return
        released[0] = True
        _holders -= 1
        if _holders == 0:
            while _patched:
                table, name, original = _patched.pop()
                table[name] = original
    return release


# ---- from the construction's end to setup ---------------------------------------------------------


def track_changes(rec: Recording, registered: list[tuple[nn.Module, str, bool]]) -> None:
    """The construction ended: record what is done to its meta tensors from now until ``seal``."""
    rec.built = len(rec.calls)
    for m, name, is_param in registered:
        t = (m._parameters if is_param else m._buffers).get(name)
        if t is None or not t.is_meta:
            continue
        _track(rec, t)
        rec.seen_version[id(t)] = t._version
        rec.resets[m] = vars(m).get("reset_parameters")
    rec.release = hold_init_functions()
    weakref.finalize(rec, rec.release)  # a model dropped before setup puts them back too


def _named_tensors(module: nn.Module):
    for path, m in module.named_modules():
        for table, is_param in ((m._parameters, True), (m._buffers, False)):
            for name, t in table.items():
                if t is not None:
                    yield f"{path}.{name}" if path else name, m, name, t, is_param


def seal(module: nn.Module) -> None:
    """Setup begins: stop recording changes to ``module``'s recorded tensors, point each at the view
    it has now, and refuse what cannot be replayed (see [Note: changes before setup])."""
    open_: dict[int, Recording] = {}
    unrecorded = []
    for key, m, name, t, is_param in _named_tensors(module):
        entry = _recorded_params.get(t) if is_param else _recorded_buffers.get(m, {}).get(name)
        rec = entry[0] if entry is not None else t.__dict__.get("_zero_recording")
        if rec is not None and not rec.sealed:
            open_.setdefault(id(rec), rec)
        if entry is None and t.is_meta:  # nn.Parameter(a tensor a recorded change made), or made outside
            unrecorded.append((key, m, name, t, is_param))
    problems: list[str] = []
    outside: list[str] = []
    for key, m, name, t, is_param in _named_tensors(module):
        entry = _recorded_params.get(t) if is_param else _recorded_buffers.get(m, {}).get(name)
        if entry is None or id(entry[0]) not in open_:
            continue
        rec, ref = entry
        _untrack(t)
        if not t.is_meta:  # given real values: they win
            if is_param:
                forget(t)
            else:
                forget(module=m, name=name)
            continue
        seen = rec.seen_version.get(id(t))
        if seen is not None and t._version != seen:
            problems.append(f"{key} was changed in place by a call the record did not see (through a view of it "
                            "taken while the model was built?); change it through the parameter itself")
        elif t.untyped_storage()._cdata not in rec.nbytes:
            problems.append(f"{key} was replaced by a meta tensor made outside the model's record; build it from "
                            "the model's own tensors, or give it real values")
        elif rec.ref(t) != ref and not _converted(rec, ref.root, t.untyped_storage()._cdata, rec.built or 0):
            _point(rec, m, name, t, is_param)  # its .data was set, or it was converted and changed after
    for key, m, name, t, is_param in unrecorded:
        _untrack(t)
        rec = next((r for r in open_.values() if t.untyped_storage()._cdata in r.nbytes), None)
        if rec is not None:
            _point(rec, m, name, t, is_param)
        elif open_:  # (a model built on meta outside any record is initialised by reset_parameters instead)
            outside.append(key)
    if outside:
        problems.append(f"{outside[:5]} are on the meta device but were made outside the model's record (a layer "
                        "added after the model was built and moved to meta, as peft's get_peft_model does), so "
                        "their values are unknown; add them inside the init context (fabric.init_module("
                        "empty_init=True), configure_model), or give them real values")
    for rec in open_.values():
        rec.sealed = True
        rec.release()
        rec.seen_version.clear()
        problems += _unreplayable(module, rec)
    if problems:
        raise ValueError(f"{type(module).__name__} was changed after it was built on the meta device (in the "
                         f"strategy's init context) in ways its replay at setup cannot reproduce exactly: "
                         + "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
                         + ". See [Note: changes before setup] in zero_strategy/engine/params/edits.py.")


_CONVERSIONS = {"to", "type", "half", "float", "double", "bfloat16"}  # model.to(dtype), the precision's convert_module


def _converted(rec: Recording, root_then: int, root_now: int, first: int) -> bool:
    """Whether storage ``root_now`` is ``root_then`` converted by one call from ``first`` on, and not
    written since: its values are then the conversion of ``root_then``'s, which the load of the
    flat groups makes alike (a bf16 working weight from the fp32 value, whose master stays exact)."""
    maker = rec.made_by(root_now, first)
    return (maker is not None and maker.name in _CONVERSIONS and _inputs(maker) == {root_then}
            and not any(root_now in roots for roots in rec.writes.values()))


def _inputs(call: _Call) -> set[int]:
    return {r.root for r in tree_flatten((call.args, call.kwargs))[0] if isinstance(r, Ref)}


def changed_since_source(rec: Recording, key: Any, root_now: int) -> bool:
    """Whether a call recorded after a file became the source of the tensor that ``key`` names (see
    ``set_param_source`` in engine/params/materialize.py) wrote it, replaced it, or computed another
    tensor from it: the replay knows the file's values only at the end. Converting its dtype is none
    of these."""
    marked = rec.sourced.get(key)
    if marked is None:
        return False
    first, root_then = marked
    family = {root_then}  # the tensor, and its dtype conversions
    for i, call in enumerate(rec.calls[first:], first):
        if not call.roots & family:
            continue
        if call.name in _CONVERSIONS and len(call.makes) == 1 and _inputs(call) <= family:
            family.add(call.makes[0][1].root)
        elif call.makes or rec.writes.get(i) or call.name.endswith("_") or call.name == "__setitem__":
            return True
    return root_now not in family


def _point(rec: Recording, m: nn.Module, name: str, t: torch.Tensor, is_param: bool) -> None:
    """``t``'s values are those of its view now."""
    if is_param:
        _recorded_params[t] = (rec, rec.ref(t))
    else:
        _recorded_buffers.setdefault(m, {})[name] = (rec, rec.ref(t))


def _unreplayable(module: nn.Module, rec: Recording) -> list[str]:
    problems = []
    if rec.rng_moved is not None:
        problems.append(f"random numbers were drawn on real tensors, or a seed was set, between two changes that "
                        f"draw random numbers (before {rec.rng_moved}); set the seed and draw other random numbers "
                        "before changing the model, or after setup")
    changed = rec.changed_after(rec.built or 0)
    pending = []
    for path, m in module.named_modules():
        if m not in rec.resets:
            continue
        now = vars(m).get("reset_parameters")
        if now is None or now is rec.resets[m]:
            continue
        own = [entry[1].root for entry in (*(_recorded_params.get(p) for p in m._parameters.values() if p is not None),
                                           *_recorded_buffers.get(m, {}).values()) if entry is not None]
        if own and not any(root in changed for root in own):
            pending.append(f"{path or 'the model'} ({type(m).__name__})")
    if pending:
        problems.append(f"reset_parameters was set on {', '.join(pending[:5])} after the model was built and not "
                        "called (FSDP calls it when it materialises a meta model; this strategy replays what was "
                        "done instead): call it before setup, e.g. `for m in model.modules(): m.reset_parameters()`")
    return problems

