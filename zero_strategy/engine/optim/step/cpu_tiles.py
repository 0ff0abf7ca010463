"""The inner optimizer's update on CPU, tile by tile (see [Note: the CPU step in tiles] in
engine/optim/tiles.py, and [Note: step backends])."""

from __future__ import annotations

from typing import Any

import torch

from ....config import ZeroConfig
from ..tiles import CPU_TILE_NUMEL, TiledStep, hooked_step, plan_tiles
from .backend import Stepped
from .grads import StepGradients
from .torch_step import TorchStep


class CpuTilesStep(TorchStep):
    """torch's own classes on CPU: tiles of ``CPU_TILE_NUMEL`` elements, each with a scratch
    optimizer, as one hooked step of the inner optimizer. Under ``torch.compile`` the step runs
    whole (dynamo takes it as one graph)."""

    def __init__(self, stepped: Stepped, config: ZeroConfig, owner: Any) -> None:
        super().__init__(stepped, config, owner)
        self.tiled = TiledStep(plan_tiles(stepped.shard_ranges(), CPU_TILE_NUMEL, split_pieces=True),
                               stepped.cls, stepped.kwargs, stepped.tensors, stepped.offsets())

    def torch_update(self, grads: StepGradients) -> None:
        if torch.compiler.is_compiling():
            super().torch_update(grads)
            return
        assert grads.pairs is not None
        by_piece = {where: grad.reshape(-1) for where, (_, grad) in zip(grads.where, grads.pairs)}
        inner, settings = self.stepped.inner, self.stepped.settings_of()
        hooked_step(inner, lambda: self.tiled.step(by_piece, self.stepped.state, settings))
