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

The record and its replay are ``Recording`` (engine/params/recording.py). What the script does to the
model after its construction, until setup, is recorded into the same Recording and replayed after
it (see [Note: changes before setup] in engine/params/edits.py).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from . import edits
from .recording import Recording, _recorded_buffers, _recorded_params, record_call

_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.randint,
              torch.randperm, torch.arange, torch.range, torch.linspace, torch.logspace, torch.eye,
              torch.empty_strided, torch.tril_indices, torch.triu_indices}  # not torch.tensor: see _Recorder


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
        if self._depth or any(isinstance(x, edits._Tracked) for x in tree_flatten((args, kwargs))[0]):
            return func(*args, **kwargs)  # a model built earlier: its own record takes the change
        run_kwargs = kwargs
        if func in _FACTORIES and kwargs.get("device") is None:
            run_kwargs = {**kwargs, "device": torch.device("meta")}
        self._depth += 1
        try:
            return record_call(self.recording, func, args, kwargs, lambda: func(*args, **run_kwargs),
                               factory=func in _FACTORIES)
        finally:
            self._depth -= 1


@contextlib.contextmanager
def record_construction() -> Iterator[Recording]:
    """Modules built inside are on the meta device, their construction recorded (see [Note:
    recorded construction]), and what is done to them afterwards until setup too (see [Note: changes
    before setup] in engine/params/edits.py); ``recorded_param`` then knows their parameters and buffers."""
    recording = Recording()
    registered: list[tuple[nn.Module, str, bool]] = []
    handles = [module_hooks.register_module_parameter_registration_hook(
                   lambda m, name, p: registered.append((m, name, True))),
               module_hooks.register_module_buffer_registration_hook(
                   lambda m, name, b: registered.append((m, name, False)))]
    recorder = _Recorder(recording)
    release = edits.hold_init_functions()  # those that skip meta tensors: recorded as one call each
    edits.constructions.append(recorder)
    try:
        with recorder:
            yield recording
    finally:
        edits.constructions.remove(recorder)
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
        edits.track_changes(recording, registered)
        release()
