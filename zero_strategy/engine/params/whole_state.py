"""Whole tensors into a module on the engine, each rank keeping its slices: torch's ``load_state_dict`` on
the module (and on any of its submodules), and ``FlatParameters.load_full_state_dict``.

[Note: loading a full state dict]
After setup a stage-3 parameter is an empty tensor between gathers, so torch's ``load_state_dict``
would refuse a full state dict ("size mismatch for lm_head.weight: ... the shape in current model is
torch.Size([0])"); at stages 1-2 it would load the working weights and leave the fp32 masters as
they were, for the next step to write back over the load. So the owner of the flat groups takes over
the loading of the parameters in them through ``load_state_dict``'s own hooks, registered on every
module that holds some: the pre-hook of the module the call loads takes their entries out of
(torch's copy of) the state dict and writes each into this rank's pieces of its group and their
masters (``write_parameter``, the one writer that pretrained files use too: this rank's slices of the
tensor, read from it, no collective, nothing gathered), and torch loads the rest as usual (buffers,
parameters outside the groups); the post-hook takes the entries it loaded out of torch's missing keys.
So ``strict`` reports missing and unexpected keys as torch does, a wrong shape is refused in torch's
words with the parameter's real shape (and that parameter not loaded), ``assign=True`` leaves the
groups' parameters in place with the loaded values, and the call is no collective: every rank loads
its own slices, whatever the others do. Tied parameters (one object, several keys) load from the key
torch would load last. A unit gathered while it loads (inside ``gathered_parameters``) gathers again
before its next use. A state dict read from a file by the front ends is memory-mapped (see
``fabric.load_raw``), so that each rank reads its slices of the file and no tensor whole.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..buffers.flat import FlatGroup
from .materialize import group_places, write_parameter

Place = Optional[tuple[FlatGroup, int]]


def true_shape(p: nn.Parameter, place: Place) -> tuple[int, ...]:
    """A parameter's shape, also when stage 3 has released it (its own shape is then (0,))."""
    if place is None:
        return tuple(p.shape)
    group, index = place
    return tuple(group.shapes[index])


def load_whole(p: nn.Parameter, value: torch.Tensor, place: Place) -> None:
    """``value``, the whole tensor, into ``p``: this rank's slices of its flat group and their masters
    (or ``p`` itself where it is whole on this rank)."""
    flat = value.detach().reshape(-1)
    write_parameter(p, lambda start, end: flat[start:end], place)
    if place is not None:
        place[0].shard_written()  # a gathered copy is stale now


def _keys_of(module: nn.Module, prefix: str, places: Mapping[nn.Parameter, Place]) -> dict[nn.Parameter, list[str]]:
    """The state-dict keys of ``module``'s parameters in flat groups, under ``prefix``, per parameter."""
    keys: dict[nn.Parameter, list[str]] = {}
    for name, p in module.named_parameters(prefix=prefix[:-1] if prefix.endswith(".") else prefix,
                                           remove_duplicate=False):
        if p in places:
            keys.setdefault(p, []).append(name)
    return keys


def take_over_loading(module: nn.Module, groups: Sequence[FlatGroup]) -> list[tuple[nn.Module, RemovableHandle]]:
    """Register the hooks of [Note: loading a full state dict] on ``module`` and each of its submodules
    that holds parameters of ``groups``; returns each module with its handle."""
    places = group_places(groups)
    loaded: dict[int, set[str]] = {}  # id(the module whose load took them) -> the keys taken

    def pre_hook(m: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                 missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        taken: set[str] = set()
        with torch.no_grad():
            for p, keys in _keys_of(m, prefix, places).items():
                present = [k for k in keys if k in state_dict]
                if not present:
                    continue  # torch reports it missing
                key, value = present[-1], state_dict[present[-1]]
                for k in present:
                    del state_dict[k]
                taken.update(present)
                if not torch.overrides.is_tensor_like(value):
                    error_msgs.append(f'While copying the parameter named "{key}", expected torch.Tensor or '
                                      f"Tensor-like object from checkpoint but received {type(value)}")
                elif tuple(value.shape) != true_shape(p, places[p]):
                    error_msgs.append(f"size mismatch for {key}: copying a param with shape {value.shape} from "
                                      f"checkpoint, the shape in current model is "
                                      f"{torch.Size(true_shape(p, places[p]))}.")
                else:
                    load_whole(p, value, places[p])
        loaded[id(m)] = taken

    def post_hook(m: nn.Module, incompatible: Any) -> None:
        taken = loaded.pop(id(m), set())
        if taken:
            incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in taken]

    handles = []
    for m in module.modules():
        if any(p in places for p in m.parameters()):
            handles.append((m, m.register_load_state_dict_pre_hook(pre_hook)))
            handles.append((m, m.register_load_state_dict_post_hook(post_hook)))
    return handles


def load_full_state_dict(module: nn.Module, groups: Sequence[FlatGroup], state_dict: Mapping[str, torch.Tensor],
                         strict: bool = True) -> None:
    """Whole tensors into ``module``'s parameters (each rank keeping its slices of the flat groups) and
    buffers; nothing is written when a key is missing or unexpected (``strict``) or a shape differs.
    No collective."""
    entries = module.state_dict(keep_vars=True)
    missing = [k for k in entries if k not in state_dict]
    unexpected = [k for k in state_dict if k not in entries]
    if strict and (missing or unexpected):
        raise KeyError(f"the checkpoint does not match the model: missing keys {missing[:10]}, unexpected keys "
                       f"{unexpected[:10]}; pass strict=False to load what matches.")
    places = group_places(groups)
    keys: dict[int, list[str]] = {}
    for key, value in entries.items():
        keys.setdefault(id(value), []).append(key)
    loads = []
    for key, target in entries.items():
        last = [k for k in keys[id(target)] if k in state_dict]
        if not last or key != last[-1]:
            continue  # tied: loaded from the last of its keys, as torch does
        want = true_shape(target, places.get(target)) if isinstance(target, nn.Parameter) else tuple(target.shape)
        if tuple(state_dict[key].shape) != want:
            raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(state_dict[key].shape)}, the model's has "
                             f"{want}: the checkpoint is for a different model.")
        loads.append((target, state_dict[key]))
    with torch.no_grad():
        for target, value in loads:
            if isinstance(target, nn.Parameter):
                load_whole(target, value, places.get(target))
            else:
                target.copy_(value)
