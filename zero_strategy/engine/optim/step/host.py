"""Optimizer offload's step on host tensors, tile by tile (see [Note: stepping in tiles] in
engine/optim/tiles.py, and [Note: step backends] in engine/optim/step/backend.py).

[Note: offloaded step]
With ``offload_optimizer`` the master pieces, their gradients and the inner optimizer's state are
host tensors (see engine/buffers/host.py), and the inner optimizer is re-created fused (or foreach) for the
host. The step runs tile by tile, each tile's updated pieces starting their copy to the device as
the next tile steps; then the device waits for those copies and the all-gathers run as usual. With
``offload_dir`` the state of each tile comes from disk and goes back to it; ``state_dict()`` reads
it all into memory for the consolidation and ``load_state_dict()`` writes it all out again, so the
unsharded state dict is the same as without offload.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Collection, Sequence

import torch

from ....config import ZeroConfig
from ...buffers.host import wait_for_copies
from ...diagnose import breakdown
from ...diagnose.ranges import span
from ..tiles import PieceKey, TilePart, hooked_step, plan_tiles, unhooked_step
from .backend import StepBackend, Stepped
from .grads import StepGradients

GradOf = dict[PieceKey, torch.Tensor]  # each stepped piece's host gradient


FUSED_ON_CPU: tuple[type, ...] = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
"""Optimizers with a fused CPU kernel in torch (one pass over memory per tensor); the other elementwise
ones get ``foreach`` (a few vectorised passes per list of tensors)."""


def keep_state_on_host(state: dict[torch.Tensor, dict[str, Any]], tensors: Sequence[Sequence[torch.Tensor]]) -> None:
    """Put each stepped host tensor's optimizer state back beside it: Lightning's checkpoint restore
    moves optimizer state to the root device."""
    for group in tensors:
        for t in group:
            entry = state.get(t)
            if entry and any(isinstance(v, torch.Tensor) and v.device != t.device for v in entry.values()):
                state[t] = {k: v.to(t.device) if isinstance(v, torch.Tensor) else v for k, v in entry.items()}


def host_optimizer_kwargs(cls: type, kwargs: dict[str, Any], dtypes: Sequence[torch.dtype] = ()) -> dict[str, Any]:
    """``kwargs`` for ``cls`` stepping host tensors of ``dtypes``: fused (or foreach) unless the user chose.

    An explicit ``fused`` or ``foreach`` in the user's optimizer is kept; ``capturable`` (a CUDA
    graph option) is dropped, since the host step is never captured. SGD over bf16/fp16 host tensors
    (``master_weights=False``) gets foreach: torch 2.13's fused CPU SGD with momentum gives different
    results from run to run there (a momentum buffer given, several tensors, one thread too).
    """
    params = inspect.signature(cls.__init__).parameters
    out = dict(kwargs)
    if out.get("capturable"):
        out["capturable"] = False
    if out.get("fused") or out.get("foreach") is not None:
        return out
    unrepeatable = issubclass(cls, torch.optim.SGD) and any(d.itemsize < 4 for d in dtypes)
    if "fused" in params and issubclass(cls, FUSED_ON_CPU) and not unrepeatable:
        out["fused"] = True
    elif "foreach" in params:
        out["foreach"] = True
    return out


class HostTilesStep(StepBackend):
    """The inner optimizer (re-created fused, or foreach, for the host) steps the pieces of one tile
    at a time; each tile's updated masters start their copy to the device while the next steps."""

    on_host = True
    own_settings = ("fused", "foreach", "capturable")

    def __init__(self, stepped: Stepped, config: ZeroConfig, owner: Any) -> None:
        super().__init__(stepped, config, owner)
        self.tile_numel = max(1, int(config.offload_tile_mb * 2**20) // 4)  # MiB of fp32 master weights
        self.tiles = plan_tiles(stepped.shard_ranges(), self.tile_numel, split_pieces=False)
        self.dtypes = stepped.master_dtypes()

    @classmethod
    def options(cls, optimizer_cls: type, kwargs: dict[str, Any], dtypes: Sequence[torch.dtype]) -> dict[str, Any]:
        return host_optimizer_kwargs(optimizer_cls, kwargs, dtypes)

    @classmethod
    def group_options(cls, optimizer_cls: type, group: dict[str, Any],
                      dtypes: Sequence[torch.dtype]) -> dict[str, Any]:
        own = {k: group[k] for k in cls.own_settings if k in group}
        return {**group, **host_optimizer_kwargs(optimizer_cls, own, dtypes)}

    def gradients_reduced(self) -> None:
        wait_for_copies(self.stepped.device)  # the gradients' copies to the host

    def update(self, grads: StepGradients) -> None:
        assert grads.pairs is not None
        grad_of = {where: grad for where, (_, grad) in zip(grads.where, grads.pairs)}
        self.keep_state_on_host()
        hooked_step(self.stepped.inner, lambda: self.step_tiles(grad_of, grads))
        wait_for_copies(self.stepped.device)

    def step_tiles(self, grad_of: GradOf, grads: StepGradients) -> None:
        """One step of the inner optimizer, a tile at a time (inside its hooked step: see unhooked_step)."""
        taken, committed = self.computed_ahead(grad_of, grads)
        tensors = self.stepped.tensors
        for tile in self.tiles:
            live = [p for p in tile if (p.group, p.piece) in grad_of]
            if not live:
                continue
            stepping = []
            for p in live:
                key = (p.group, p.piece)
                if key in committed:
                    continue
                if key in taken:
                    self.commit(key, taken[key])
                else:
                    stepping.append(p)
                    tensors[p.group][p.piece].grad = grad_of[key]
            if stepping:
                try:
                    unhooked_step(self.stepped.inner)
                finally:
                    for p in stepping:
                        tensors[p.group][p.piece].grad = None
            self.written(live)

    def computed_ahead(self, grad_of: GradOf, grads: StepGradients) -> tuple[dict[PieceKey, Any], Collection[PieceKey]]:
        """Updates made before the step that it takes: to commit, and committed already (none here)."""
        return {}, ()

    def commit(self, key: PieceKey, result: Any) -> None:
        raise NotImplementedError

    def written(self, parts: Sequence[TilePart]) -> None:
        """Start the copies of a stepped tile's masters to the device (the step's offload time: see
        [Note: the step breakdown] in engine/diagnose/breakdown.py)."""
        timer = breakdown.active()
        with span(lambda: "zero/offload masters to device"), \
                timer.waiting(breakdown.OFFLOAD, "copy") if timer is not None else contextlib.nullcontext():
            for part in parts:
                g = self.stepped.groups[part.group]
                piece = g.pieces[part.piece]
                g.write_back_piece(piece, part.start - piece.shard_offset, part.end - piece.shard_offset)

    def keep_state_on_host(self) -> None:
        keep_state_on_host(self.stepped.state, self.stepped.tensors)

    def state_loaded(self) -> None:
        inner = self.stepped.inner
        inner.param_groups[:] = [self.group_options(self.stepped.cls, g, self.dtypes) for g in inner.param_groups]
        self.keep_state_on_host()
