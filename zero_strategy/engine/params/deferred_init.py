"""A model built on the meta device, recorded, so that its real values can be computed later, one tensor at a time.

[Note: recorded construction]
Inside ``record_construction()`` tensor factories without a device (``torch.empty``, ``torch.randn``,
``torch.arange``...) make meta tensors, and every torch call that takes or makes a meta tensor is
recorded, in order: the modules' default initialisation in their constructors, transformers'
``_init_weights`` pass in ``post_init`` (which runs, since the default device is not meta), rotary
``inv_freq``, ``position_ids``, causal masks, dtype conversions. No random number is drawn. Each
recorded call names its tensors by *storage* (two views of one tensor share one), with the shape,
strides and offset they had then. ``Recording.replay`` runs the calls again on CPU from the random
state the construction started from, under no_grad: the same calls, drawing the same numbers in the
same order as an eager build, so the values are those of the eager build, bit for bit. Memory: a
storage is allocated when a call first makes it and dropped after its last use; one that a later
call overwrites whole (``normal_``, ``copy_``, an init function) is dropped until then, so the default
init of a weight and transformers' re-init of it do not keep every weight alive in between. A
parameter's or buffer's final value goes to a sink (the sharder keeps this rank's slices of it) at
its storage's last use: the largest transient is one tensor, or the few a call uses together.

What replays exactly: calls on meta tensors. Random draws made during construction on real tensors
(a factory given ``device="cpu"``) would be missing from the replay; ``Recording.exact`` says whether
the random state was the same at the end of the construction as at its start.
"""

from __future__ import annotations

import contextlib
import math
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.randint,
              torch.randperm, torch.arange, torch.range, torch.linspace, torch.logspace, torch.eye,
              torch.empty_strided, torch.tril_indices, torch.triu_indices}  # not torch.tensor: see _Recorder
_QUERIES = {"dim", "size", "numel", "stride", "storage_offset", "is_contiguous", "element_size", "nelement",
            "ndimension", "__len__", "untyped_storage", "_typed_storage", "data_ptr", "__get__", "__set__",
            "is_floating_point", "is_complex", "__format__", "__repr__", "__hash__", "get_device", "type"}
# calls that write every element of their first tensor without reading it: its old value is dead before
_OVERWRITES = {"normal_", "uniform_", "zero_", "fill_", "copy_", "random_", "bernoulli_", "exponential_",
               "geometric_", "log_normal_", "cauchy_", "zeros_", "ones_", "constant_", "trunc_normal_",
               "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "orthogonal_", "eye_",
               "dirac_", "sparse_"}


@dataclass(frozen=True)
class Ref:
    """A meta tensor as a recorded call saw it: which storage (``root``), and the view of it."""

    root: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class _Call:
    func: Callable
    args: Any  # the call's args and kwargs, meta tensors replaced by Refs
    kwargs: Any
    makes: tuple[tuple[int, Ref], ...]  # (output position, ref) of outputs on storages new at this call
    roots: frozenset[int]  # every storage it touches

    @property
    def name(self) -> str:
        return getattr(self.func, "__name__", "")


class Recording:
    """The calls of one construction (see [Note: recorded construction])."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self.rng_state = torch.random.get_rng_state()  # the construction's start: the replay's
        self.exact = True
        self.nbytes: dict[int, int] = {}  # storage -> its size
        self._storages: list = []  # the meta storages, alive so that their ids stay theirs

    def root_of(self, t: torch.Tensor) -> int:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.nbytes:
            self.nbytes[key] = storage.nbytes()
            self._storages.append(storage)
        return key

    def ref(self, t: torch.Tensor) -> Ref:
        return Ref(self.root_of(t), t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def _overwritten(self, call: _Call) -> Optional[int]:
        """The storage ``call`` writes whole without reading it, if any."""
        if call.name not in _OVERWRITES:
            return None
        first = call.args[0] if call.args else call.kwargs.get("tensor", call.kwargs.get("self"))
        if not isinstance(first, Ref) or first.offset != 0 or first.numel * _size(first.dtype) != self.nbytes[first.root]:
            return None
        others = [r for r in tree_flatten((call.args[1:], call.kwargs))[0] if isinstance(r, Ref) and r is not first]
        return None if any(r.root == first.root for r in others) else first.root

    def replay(self, wanted: dict[int, list[tuple[Any, Ref]]], sink: Callable[[Any, torch.Tensor], None],
               only_needed: bool = False) -> None:
        """Run the calls again on CPU from the construction's random state; ``sink(key, value)`` gets the
        value of each ``(key, ref)`` in ``wanted[root]`` after that storage's last use. ``only_needed``
        skips the calls whose results reach no wanted storage (their random draws too: the values of the
        rest then differ from an eager build's)."""
        calls = list(enumerate(self.calls))
        if only_needed:
            needed, keep = set(wanted), []
            for i, call in reversed(calls):
                if call.roots & needed:
                    needed |= call.roots
                    keep.append((i, call))
            calls = keep[::-1]
        last: dict[int, int] = {}
        next_of: dict[tuple[int, int], int] = {}  # (storage, call) -> the next call touching it
        for i, call in calls:
            for r in call.roots:
                if r in last:
                    next_of[(r, last[r])] = i
                last[r] = i
        overwrites = {i: self._overwritten(call) for i, call in calls}
        real: dict[int, torch.UntypedStorage] = {}
        torch.random.set_rng_state(self.rng_state)

        def view(ref: Ref) -> torch.Tensor:
            if ref.root not in real:
                raise RuntimeError(f"a recorded call uses a meta tensor of shape {ref.shape} that no recorded call "
                                   "made (it was built outside the recording): it cannot be computed.")
            return torch.empty(0, dtype=ref.dtype).set_(real[ref.root], ref.offset, ref.shape, ref.stride)

        with torch.no_grad():
            for i, call in calls:
                dead = overwrites[i]
                if dead is not None and dead not in real:  # dropped until this call overwrote it
                    real[dead] = torch.UntypedStorage(self.nbytes[dead])
                args, kwargs = tree_map(lambda x: view(x) if isinstance(x, Ref) else x, (call.args, call.kwargs))
                out = call.func(*args, **kwargs)
                flat = tree_flatten(out)[0]
                for position, ref in call.makes:
                    made = flat[position]
                    if tuple(made.stride()) != ref.stride or made.storage_offset() != ref.offset:
                        raise RuntimeError(f"{call.name} made a tensor laid out otherwise on CPU than on meta "
                                           f"(strides {tuple(made.stride())} vs {ref.stride}).")
                    real[ref.root] = made.untyped_storage()
                del args, kwargs, out, flat
                for r in call.roots:
                    following = next_of.get((r, i))
                    if following is None:
                        for key, ref in wanted.get(r, ()):
                            sink(key, view(ref))
                        real.pop(r, None)
                    elif overwrites[following] == r:
                        real.pop(r, None)


def _size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


class _Recorder(TorchFunctionMode):
    """Meta factories, and a record of every call on meta tensors (see [Note: recorded construction]).
    ``torch.tensor`` stays real: transformers reads the device a construction runs on from
    ``torch.tensor([])``, and would skip its ``_init_weights`` pass on meta."""

    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording
        self._depth = 0  # calls made by a recorded call (an init function's own ops) are its part

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._depth:
            return func(*args, **kwargs)
        run_kwargs = kwargs
        if func in _FACTORIES and kwargs.get("device") is None:
            run_kwargs = {**kwargs, "device": torch.device("meta")}
        self._depth += 1
        try:
            rec = self.recording
            inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.is_meta]
            if not inputs and func not in _FACTORIES:
                return func(*args, **run_kwargs)
            known = set(rec.nbytes)
            template = tree_map(_to_template(rec), (args, kwargs))
            out = func(*args, **run_kwargs)
            if not inputs and not any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_flatten(out)[0]):
                return out  # a factory told to make a real tensor
            flat = tree_flatten(out)[0]
            outputs = [(i, t) for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.is_meta]
            if not outputs and getattr(func, "__name__", "") in _QUERIES:
                return out
            makes = tuple((i, rec.ref(t)) for i, t in outputs if rec.root_of(t) not in known)
            roots = frozenset(r.root for r in tree_flatten(template)[0] if isinstance(r, Ref)) | {
                rec.root_of(t) for _, t in outputs}
            rec.calls.append(_Call(func, template[0], template[1], makes, roots))
            return out
        finally:
            self._depth -= 1


def _to_template(rec: Recording) -> Callable[[Any], Any]:
    """A call's argument as recorded: meta tensors as Refs, the meta device as the CPU (the replay's)."""
    def convert(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_meta:
            return rec.ref(x)
        if isinstance(x, torch.device) and x.type == "meta":
            return torch.device("cpu")
        if isinstance(x, str) and x == "meta":
            return "cpu"
        return x
    return convert


# init functions that return at once on a meta tensor instead of calling tensor ops the recorder would
# see; inside a recording they are recorded as one call each (torch.nn.init's trunc_normal_ goes
# through _no_grad_trunc_normal_; transformers keeps its own references in TORCH_INIT_FUNCTIONS)
_SKIPPING_META = ("_no_grad_trunc_normal_", "dirac_", "orthogonal_", "sparse_")


def _recording_wrapper(original: Callable, recorder: "_Recorder") -> Callable:
    def wrapper(tensor, *args, **kwargs):
        if not (isinstance(tensor, torch.Tensor) and tensor.is_meta) or recorder._depth:
            return original(tensor, *args, **kwargs)
        rec = recorder.recording
        template = tree_map(_to_template(rec), ((tensor, *args), kwargs))
        roots = frozenset(r.root for r in tree_flatten(template)[0] if isinstance(r, Ref))
        rec.calls.append(_Call(original, template[0], template[1], (), roots))
        return tensor
    wrapper.__name__ = original.__name__
    return wrapper


@contextlib.contextmanager
def _init_functions_recorded(recorder: "_Recorder") -> Iterator[None]:
    tables = [vars(torch.nn.init)]
    hf_init = sys.modules.get("transformers.initialization")
    if hf_init is not None and isinstance(getattr(hf_init, "TORCH_INIT_FUNCTIONS", None), dict):
        tables.append(hf_init.TORCH_INIT_FUNCTIONS)
    saved = [(table, name, table[name]) for table in tables for name in _SKIPPING_META if name in table]
    try:
        for table, name, original in saved:
            table[name] = _recording_wrapper(original, recorder)
        yield
    finally:
        for table, name, original in saved:
            table[name] = original


# which Recording a meta parameter (or a module's meta buffer) was made in, and its view then
_recorded_params: "WeakIdKeyDictionary" = WeakIdKeyDictionary()  # nn.Parameter -> (Recording, Ref)
_recorded_buffers: "weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[Recording, Ref]]]" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def record_construction() -> Iterator[Recording]:
    """Modules built inside are on the meta device, their construction recorded (see [Note:
    recorded construction]); ``recorded_value_of`` then knows their parameters and buffers."""
    recording = Recording()
    registered: list[tuple[nn.Module, str, bool]] = []
    handles = [module_hooks.register_module_parameter_registration_hook(
                   lambda m, name, p: registered.append((m, name, True))),
               module_hooks.register_module_buffer_registration_hook(
                   lambda m, name, b: registered.append((m, name, False)))]
    try:
        recorder = _Recorder(recording)
        with recorder, _init_functions_recorded(recorder):
            yield recording
    finally:
        for h in handles:
            h.remove()
        recording.exact = torch.equal(torch.random.get_rng_state(), recording.rng_state)
        for m, name, is_param in registered:
            t = (m._parameters if is_param else m._buffers).get(name)
            if t is None or not t.is_meta:
                continue
            if is_param:
                _recorded_params[t] = (recording, recording.ref(t))
            else:
                _recorded_buffers.setdefault(m, {})[name] = (recording, recording.ref(t))


def recorded_param(p: nn.Parameter) -> Optional[tuple[Recording, Ref]]:
    return _recorded_params.get(p)


def recorded_buffer(m: nn.Module, name: str) -> Optional[tuple[Recording, Ref]]:
    entry = _recorded_buffers.get(m, {}).get(name)
    if entry is None or m._buffers.get(name) is None:
        return None
    return entry


def forget(p: Optional[nn.Parameter] = None, module: Optional[nn.Module] = None, name: str = "") -> None:
    if p is not None:
        _recorded_params.pop(p, None)
    if module is not None:
        _recorded_buffers.get(module, {}).pop(name, None)
