"""Objects a safe load cannot hold: saved beside a sharded checkpoint, loaded only when asked.

[Note: pickled objects]
trainer_state.pt is loaded with ``torch.load(weights_only=True)``, which never runs arbitrary
unpickling (see [Note: checkpoint layout] in checkpoint/store.py). The state a front end saves may
hold objects that such a load refuses: a ``DataLoader`` in ``fabric.save``'s state, hyper-parameters
holding an ``argparse.Namespace`` or an OmegaConf config, a callback's own objects. DDP pickles them
into its one file, and torch (2.6 and later) then refuses to load that file unless the caller passes
``weights_only=False``. Refusing them at the save came after all the training (the save is the last
thing a script does), so the save splits them off instead:

- rank 0 tests the state (one ``torch.save`` and a safe load of it); where that fails, each entry is
  tested, recursing into plain dicts, and every entry a safe load refuses moves, under its key path,
  to ``pickled_objects.pt`` (``torch.save``, pickle), beside trainer_state.pt, which keeps the rest
  and stays safe. The engine's record lists the key paths; the index records the file's size and
  checksum as it does trainer_state.pt's, so a damaged file is found, not loaded.
- a load restores them only when the caller passes ``weights_only=False``: the argument Fabric and
  the Trainer already take, meaning what it means for DDP's file ("I trust this checkpoint: unpickle
  it"), so the same call resumes either: ``fabric.load(path, state, weights_only=False)``,
  ``trainer.fit(model, ckpt_path=path, weights_only=False)``. Without it the rest loads (weights,
  optimizer state, everything safe) and a ``PickledObjectsWarning`` names the entries left out and
  that argument; an entry ``fabric.load``'s state asks for then keeps the value it has.
- an entry that pickle cannot write either (a lambda, an open file) fails the save, naming it: DDP's
  save fails on it too.
- ``zero-consolidate`` leaves them out (its file loads with ``weights_only=True``) and says so.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from typing import Any, Iterable

import torch

from .format import CheckpointError

PickledEntries = dict[tuple, Any]  # key path -> the object at it


_SAFE_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.Tensor, torch.nn.Parameter, torch.dtype,
                torch.device, torch.Size)
_CONTAINERS = (dict, OrderedDict, list, tuple)


def _loads_safely(value: Any) -> bool:
    """Whether a safe load takes ``value``. The containers and leaves it always takes are walked, so that
    the tensors of a large state (an EMA callback's weights) are not serialized twice; anything else is
    tried: ``torch.save``, then ``torch.load(weights_only=True)``."""
    if type(value) in _SAFE_LEAVES:
        return True
    if type(value) in _CONTAINERS:
        items = value.items() if isinstance(value, dict) else ((None, v) for v in value)
        return all((k is None or type(k) in _SAFE_LEAVES) and _loads_safely(v) for k, v in items)
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception:  # noqa: BLE001 - pickle and torch raise many kinds here; any of them means "not safe"
        return False
    return True


def _descend(value: Any) -> bool:
    """Whether to look inside ``value`` for the entries a safe load refuses: a plain dict whose keys are
    themselves safe to record in a key path (a dict subclass, such as Lightning's AttributeDict, is one
    object whose class a safe load refuses, so it moves whole)."""
    return type(value) is dict and all(isinstance(k, (str, int)) for k in value)


def _split(entries: dict, prefix: tuple, pickled: PickledEntries) -> dict:
    kept = {}
    for key, value in entries.items():
        path = prefix + (key,)
        if _loads_safely(value):
            kept[key] = value
        elif _descend(value):
            kept[key] = _split(value, path, pickled)
        else:
            pickled[path] = value
    return kept


def split_pickled(state: dict[str, Any]) -> tuple[dict[str, Any], PickledEntries]:
    """``state`` without the entries a safe load refuses, and those entries by key path (see [Note:
    pickled objects]). Raises a CheckpointError naming an entry that pickle cannot write either."""
    if _loads_safely(state):
        return state, {}
    pickled: PickledEntries = {}
    kept = _split(state, (), pickled)
    for path, value in pickled.items():
        if not all(isinstance(k, (str, int)) for k in path):  # the path itself goes into trainer_state.pt
            raise CheckpointError(f"the state's key {path[-1]!r} ({type(path[-1]).__name__}) holds an object a safe "
                                  "load refuses, and the key cannot name it in a safe file either; use string keys.")
        try:
            torch.save(value, io.BytesIO())
        except Exception as err:  # noqa: BLE001 - what pickle raises for the object
            raise CheckpointError(
                f"the state's entry {dotted(path)} (a {type(value).__name__}) can be saved neither in a form that "
                f"loads safely (torch.load(weights_only=True)) nor by pickle ({type(err).__name__}: {err}). Save its "
                "state instead (an object with state_dict() and load_state_dict() is saved as its state dict), or "
                "leave it out of the saved state.") from None
    return kept, pickled


def pickled_bytes(pickled: PickledEntries) -> bytes:
    """What ``pickled_objects.pt`` holds: ``torch.save`` of the entries by key path."""
    buffer = io.BytesIO()
    torch.save(pickled, buffer)
    return buffer.getvalue()


def load_pickled(data: bytes) -> PickledEntries:
    """The entries of ``pickled_objects.pt`` (full unpickling: only on the caller's word that the checkpoint
    is trusted, ``weights_only=False``)."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def merge_pickled(state: dict[str, Any], pickled: PickledEntries) -> None:
    """Put each entry back at its key path in ``state``."""
    for path, value in pickled.items():
        target = state
        for key in path[:-1]:
            target = target.setdefault(key, {})
        target[path[-1]] = value


def dotted(path: Iterable) -> str:
    """A key path as the warnings and errors show it: ``'loader'``, ``'hyper_parameters.args'``."""
    return repr(".".join(str(k) for k in path))
