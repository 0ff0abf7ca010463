"""What the engine attaches to a user's modules, left out of the modules' copies.

[Note: a module's copies hold what the user sees]
The engine puts things on the modules it runs: forward hooks (stage 3's units and root, activation
offload, the buffer broadcast) and instance attributes (stage 3's synced ``generate`` and guarded
``save_pretrained``, the offload hooks' handles). DDP puts nothing there (it wraps the
module), so under DDP a user's module pickles and deep-copies as the user wrote it, and users rely on
that: Lightning pickles the hyper-parameters into every checkpoint, and templates keep the network
passed to ``__init__`` there; EMA and teacher networks are deep copies. Here, hooks that are bound
methods of the engine do not pickle, and deep copies would keep calling the original's engine.

So every module the engine attaches anything to gets a record of it, ``Attached``, stored as the
instance's ``__getstate__``: pickle and ``copy`` ask the object itself for it (``object.__reduce_ex__``
looks the name up on the instance), and it returns the class's own state without what the engine
added: its hooks left out of the hook dicts, the attributes it set put back as they were. A copy is
the plain module the user built, holding the same values; the original keeps running on the engine.
When the engine takes its last attachment back (``remove_hooks``), the record goes too. (Activation
checkpointing's instance ``forward`` is no attachment: a plain object that a copy re-points at itself,
so the copy recomputes as the original does, with the same results.)

Parameters are copied as the user sees them. At stages 1-2 they are whole (views of the flat
buffers). At stage 3 a parameter outside its unit's use is an empty shard, and a copy of it would be
a module of empty tensors that fails at its first forward, far from the cause; so a copy of a module
with released parameters raises, naming ``gathered_parameters``: inside it the parameters are whole,
and so are the copy's (what the user sees there, and what DDP's copy would hold). A checkpoint whose
state holds such a module (a network in the hyper-parameters) is written inside that context
(``whole_modules_in`` in frontend/checkpoint.py), so its pickle holds the whole weights.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

from torch import nn
from torch.utils.hooks import RemovableHandle

_ABSENT = object()  # an attribute that was not in the instance's __dict__ before the engine set it
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks",
               "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_state_dict_pre_hooks", "_state_dict_hooks")
"""The module's hook dicts, keyed by the handles' ids (unique in the process)."""


class Attached:
    """What the engine attached to one module; called as the module's ``__getstate__`` (see [Note: a
    module's copies hold what the user sees])."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module  # a cycle through the module's own __dict__, which the collector frees
        self.hooks: set[int] = set()
        self.attributes: dict[str, Any] = {}  # name -> the value before the engine's (or _ABSENT)
        self.checks: dict[Any, Callable[[nn.Module], None]] = {}  # owner -> raises if a copy would be wrong

    def __call__(self) -> Any:
        module = self.module
        for check in self.checks.values():
            check(module)
        state = type(module).__getstate__(module)  # the class's own (a user's override included)
        if not isinstance(state, dict):
            return state
        state = dict(state)
        state.pop("__getstate__", None)
        for name, before in self.attributes.items():
            if before is _ABSENT:
                state.pop(name, None)
            else:
                state[name] = before
        for key in _HOOK_DICTS:
            hooks = state.get(key)
            if isinstance(hooks, dict) and self.hooks.intersection(hooks):
                state[key] = OrderedDict((k, v) for k, v in hooks.items() if k not in self.hooks)
        return state

    @property
    def empty(self) -> bool:
        return not (self.hooks or self.attributes or self.checks)


def record_of(module: nn.Module) -> Attached:
    """``module``'s record, made (and installed as its ``__getstate__``) on first use."""
    record = module.__dict__.get("__getstate__")
    if not isinstance(record, Attached):
        record = module.__dict__["__getstate__"] = Attached(module)
    return record


def _drop_if_empty(module: nn.Module) -> None:
    record = module.__dict__.get("__getstate__")
    if isinstance(record, Attached) and record.empty:
        del module.__dict__["__getstate__"]


def attach_hook(module: nn.Module, handle: RemovableHandle) -> RemovableHandle:
    """Record ``handle`` (of a hook just registered on ``module``) as the engine's; returns it."""
    record_of(module).hooks.add(handle.id)
    return handle


def detach_hook(module: nn.Module, handle: RemovableHandle) -> None:
    """Remove an attached hook."""
    handle.remove()
    record = module.__dict__.get("__getstate__")
    if isinstance(record, Attached):
        record.hooks.discard(handle.id)
        _drop_if_empty(module)


def attach_attribute(module: nn.Module, name: str, value: Any) -> None:
    """Set ``module.<name>`` on the instance, remembering what its ``__dict__`` held before."""
    record = record_of(module)
    if name not in record.attributes:
        record.attributes[name] = module.__dict__.get(name, _ABSENT)
    module.__dict__[name] = value


def detach_attribute(module: nn.Module, name: str) -> Any:
    """Put ``module.<name>`` back as it was before ``attach_attribute``; returns the engine's value."""
    record = module.__dict__.get("__getstate__")
    value = module.__dict__.pop(name, None)
    if isinstance(record, Attached) and name in record.attributes:
        before = record.attributes.pop(name)
        if before is not _ABSENT:
            module.__dict__[name] = before
        _drop_if_empty(module)
    return value


def attach_check(module: nn.Module, owner: Any, check: Callable[[nn.Module], None]) -> None:
    """``check(module)`` runs before each copy of ``module`` and raises where the copy would be wrong."""
    record_of(module).checks[owner] = check


def detach_check(module: nn.Module, owner: Any) -> None:
    record = module.__dict__.get("__getstate__")
    if isinstance(record, Attached):
        record.checks.pop(owner, None)
        _drop_if_empty(module)
