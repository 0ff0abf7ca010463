"""Optimizer offload with the elementwise state in files (``offload_dir``: see [Note: optimizer state
on disk] in offload.py, and [Note: step backends])."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from ..config import ZeroConfig
from .offload import DiskState, DiskStepper
from .step_backend import Stepped
from .step_grads import StepGradients
from .step_host import GradOf, HostTilesStep
from .tiled_step import plan_tiles


class DiskStep(HostTilesStep):
    """Each tile's state read from its files, stepped by a scratch optimizer, and written back, with
    the reads and writes of the neighbouring tiles on an I/O thread. ``state_in_memory`` brings it
    all into ``stepped.state`` for state dicts, and a loaded state goes back to the files."""

    def __init__(self, stepped: Stepped, config: ZeroConfig, owner: Any) -> None:
        super().__init__(stepped, config, owner)
        assert config.offload_dir is not None
        self.disk = DiskState(config.offload_dir, stepped.rank, [g.layout.shard_numel for g in stepped.groups])
        self.stepper = DiskStepper(self.disk, plan_tiles(stepped.shard_ranges(), self.tile_numel, split_pieces=True),
                                   stepped.cls, stepped.kwargs)

    def step_tiles(self, grad_of: GradOf, grads: StepGradients) -> None:
        s = self.stepped
        self.stepper.step(s.tensors, s.offsets(), grad_of, s.state, s.settings_of(), self.written)

    @contextlib.contextmanager
    def state_in_memory(self, decoded: bool = True) -> Iterator[None]:
        s = self.stepped
        offsets = s.offsets()
        self.stepper.materialize(s.tensors, offsets, s.state)
        try:
            yield
        finally:
            self.stepper.spill(s.tensors, offsets, s.state)

    def state_loaded(self) -> None:
        super().state_loaded()
        self.stepper.spill(self.stepped.tensors, self.stepped.offsets(), self.stepped.state)

    def disk_bytes(self) -> int:
        return self.disk.nbytes()

    def close(self) -> None:
        self.disk.close()
