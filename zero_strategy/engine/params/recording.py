"""The record of a model's meta tensors: the calls that made and changed them, and their replay on CPU.

``Recording`` holds the calls; ``record_call`` adds one, for the construction's recorder (see [Note:
recorded construction] in engine/params/deferred_init.py) and for the changes made to the model after
it (see [Note: changes before setup] in engine/params/edits.py); ``Recording.replay`` runs them again.
Which Recording each meta parameter and buffer belongs to is kept here too.
"""

from __future__ import annotations

import math
import weakref
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

QUERIES = {"dim", "size", "numel", "stride", "storage_offset", "is_contiguous", "element_size", "nelement",
           "ndimension", "__len__", "untyped_storage", "_typed_storage", "data_ptr", "__get__", "__set__",
           "is_floating_point", "is_complex", "__format__", "__repr__", "__hash__", "get_device", "type"}
# calls that write every element of their first tensor without reading it: its old value is dead before
_OVERWRITES = {"normal_", "uniform_", "zero_", "fill_", "copy_", "random_", "bernoulli_", "exponential_",
               "geometric_", "log_normal_", "cauchy_", "zeros_", "ones_", "constant_", "trunc_normal_",
               "_no_grad_trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
               "orthogonal_", "eye_", "dirac_", "sparse_"}
# words in the names of the torch calls that draw random numbers (torch.*, Tensor.*, F.*, nn.init.*); a
# name that matches and does not draw only makes the check of [Note: changes before setup] stricter
_DRAWS = ("rand", "normal", "uniform", "bernoulli", "multinomial", "poisson", "exponential", "geometric", "cauchy",
          "dropout", "rrelu", "orthogonal", "sparse_")


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

    @property
    def draws(self) -> bool:
        return any(word in self.name for word in _DRAWS)


class Recording:
    """The calls of one construction, then those of the changes made to its tensors until setup."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self.rng_state = torch.random.get_rng_state()  # the construction's start: the replay's
        self.exact = True
        self.nbytes: dict[int, int] = {}  # storage -> its size
        self._storages: list = []  # the meta storages, alive so that their ids stay theirs
        # after the construction (see [Note: changes before setup] in engine/params/edits.py)
        self.built: Optional[int] = None  # the number of the construction's calls, once it ended
        self.post_rng: Optional[tuple[int, torch.Tensor]] = None  # (call, random state) at the first draw after
        self.rng_moved: Optional[str] = None  # the call before which that random state had changed
        self.writes: dict[int, frozenset[int]] = {}  # call -> the storages it wrote in place (after the construction)
        self.sourced: dict[Any, tuple[int, int]] = {}  # a tensor's key -> (calls, its storage) when a file became
        # its source (see materialize.set_param_source)
        self.seen_version: dict[int, int] = {}  # id(parameter or buffer) -> its version counter as last seen
        self.resets: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()  # its own
        # reset_parameters attribute when the construction ended
        self.sealed = False  # setup has begun: no more changes
        self.release: Callable[[], None] = lambda: None  # ends what recording the changes holds

    def root_of(self, t: torch.Tensor) -> int:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.nbytes:
            self.nbytes[key] = storage.nbytes()
            self._storages.append(storage)
        return key

    def ref(self, t: torch.Tensor) -> Ref:
        return Ref(self.root_of(t), t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def changed_after(self, first: int) -> set[int]:
        """The storages that the calls from ``first`` on wrote in place or made."""
        return {r for i, roots in self.writes.items() if i >= first for r in roots} | {
            ref.root for call in self.calls[first:] for _, ref in call.makes}

    def made_by(self, root: int, first: int) -> Optional[_Call]:
        """The call from ``first`` on that made storage ``root``."""
        return next((c for c in self.calls[first:] if any(ref.root == root for _, ref in c.makes)), None)

    def digest(self) -> int:
        """The calls' names and shapes, as one number: ranks that recorded different calls differ."""
        text = "|".join(f"{c.name}:{[r.shape for r in tree_flatten((c.args, c.kwargs))[0] if isinstance(r, Ref)]}"
                        for c in self.calls)
        return zlib.crc32(f"{len(self.calls)}:{self.built}:{text}".encode())

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
        """Run the calls again on CPU from the construction's random state (the changes after it from
        theirs); ``sink(key, value)`` gets the value of each ``(key, ref)`` in ``wanted[root]`` after that
        storage's last use. ``only_needed`` skips the calls whose results reach no wanted storage (their
        random draws too: the values of the rest then differ from an eager build's)."""
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
        post_rng = self.post_rng

        def view(ref: Ref) -> torch.Tensor:
            if ref.root not in real:
                raise RuntimeError(f"a recorded call uses a meta tensor of shape {ref.shape} that no recorded call "
                                   "made (it was built outside the recording): it cannot be computed.")
            return torch.empty(0, dtype=ref.dtype).set_(real[ref.root], ref.offset, ref.shape, ref.stride)

        with torch.no_grad():
            for i, call in calls:
                if post_rng is not None and i >= post_rng[0]:  # the changes draw from the state they were made at
                    torch.random.set_rng_state(post_rng[1])
                    post_rng = None
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


def record_call(rec: Recording, func: Callable, args: tuple, kwargs: dict, run: Callable[[], Any],
                factory: bool = False) -> Any:
    """``run()`` (``func`` on ``args``), added to ``rec`` when it takes or makes a meta tensor and is no
    mere query of one; ``factory``: ``func`` makes tensors from nothing (``torch.empty``)."""
    inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.is_meta]
    if not inputs and not factory:
        return run()
    template = tree_map(_to_template(rec), (args, kwargs))
    out = run()
    flat = tree_flatten(out)[0]
    outputs = [(i, t) for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.is_meta]
    if not outputs and (not inputs or getattr(func, "__name__", "") in QUERIES):
        return out  # a factory told to make a real tensor, or a query
    new = {t.untyped_storage()._cdata for _, t in outputs} - rec.nbytes.keys()
    makes = tuple((i, rec.ref(t)) for i, t in outputs if t.untyped_storage()._cdata in new)
    roots = frozenset(r.root for r in tree_flatten(template)[0] if isinstance(r, Ref)) | {
        rec.root_of(t) for _, t in outputs}
    rec.calls.append(_Call(func, template[0], template[1], makes, roots))
    return out


# which Recording a meta parameter (or a module's meta buffer) was made in, and its view then
_recorded_params: "WeakIdKeyDictionary" = WeakIdKeyDictionary()  # nn.Parameter -> (Recording, Ref)
_recorded_buffers: "weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[Recording, Ref]]]" = weakref.WeakKeyDictionary()


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
