"""A model built on the meta device gets real tensors here, one unit at a time.

[Note: init-time sharding]
A model built on the meta device (ZeroStrategy's ``model_sharded_context``, around Lightning's
``configure_model``) never exists whole: units are materialised one at a time, in unit order, by
the modules' own ``reset_parameters()``, broadcast from rank 0, sharded, and released before the
next unit is built. Every rank draws the same random numbers in the same order whatever the world
size, so the same seed gives the same model on 1 or 2 ranks. Modules that hold buffers but no
parameters get theirs before sharding starts (``materialize_buffers``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn


def materialize_meta(params: Sequence[nn.Parameter], owners_of: Mapping[nn.Parameter, Sequence[nn.Module]],
                     device: torch.device) -> None:
    """Give the meta parameters among ``params`` storage on ``device`` and their modules' own
    initialisation; ``owners_of`` names the modules that hold each parameter directly."""
    on_meta = [p for p in params if p.is_meta]
    if on_meta:
        _materialize(list(dict.fromkeys(m for p in on_meta for m in owners_of[p])), device)


def _materialize(owners: Sequence[nn.Module], device: torch.device) -> None:
    for m in owners:
        if not hasattr(m, "reset_parameters"):
            raise ValueError(
                f"{type(m).__name__} was built on the meta device (in configure_model at stage 3, or under "
                "fabric.init_module(empty_init=True)) but has no reset_parameters() to initialise it; add one, or "
                "build this module with real tensors (in __init__, or outside init_module).")
        # not Module.to_empty: it replaces meta Parameters by new objects, and the sharder, the
        # optimizer and tied modules all hold these ones; swap_tensors keeps each object
        for p in m.parameters(recurse=False):
            if p.is_meta:
                torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device=device), p.requires_grad))
        for name, b in m.named_buffers(recurse=False):
            if b.is_meta:
                m._buffers[name] = torch.empty_like(b, device=device)
        m.reset_parameters()


def materialize_buffers(module: nn.Module, device: torch.device) -> None:
    """Stage 3, a model built on meta: modules that hold buffers but no parameters (a rotary cache, a
    mask) get their buffers on ``device`` from their own ``reset_parameters()``; the sharder
    materialises the modules with parameters, unit by unit (see [Note: init-time sharding])."""
    for path, m in module.named_modules():
        meta = [name for name, b in m.named_buffers(recurse=False) if b.is_meta]
        if not meta or any(True for _ in m.parameters(recurse=False)):
            continue
        if not callable(getattr(m, "reset_parameters", None)):
            raise ValueError(f"{path or 'the model'} ({type(m).__name__}) holds buffers on the meta device ({meta}) "
                             "and no parameters, and has no reset_parameters() to fill them; give it one, or build "
                             "that module with real tensors (outside the meta-device context).")
        for name in meta:
            m._buffers[name] = torch.empty_like(m._buffers[name], device=device)
        m.reset_parameters()
