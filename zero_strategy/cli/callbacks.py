"""Callbacks zero-train adds to Lightning's: throughput, communication per step, and the per-rank
memory table."""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from ..memory import KEYS, count_parameters, estimate_memory, memory_stats, normalize_precision
from .report import print_memory_table

MEMORY_COLUMNS = (*KEYS, "device", "host", "disk", "total")  # where the bytes live, with offload


def _zero_stage(strategy: Any) -> int:
    """The ZeRO stage a strategy runs: 0 for anything that is not ZeroStrategy (plain DDP)."""
    config = getattr(strategy, "config", None)
    return int(getattr(config, "stage", 0))


class Throughput(Callback):
    """Items per second over all ranks, where an item is what the LightningModule says it counts
    (``throughput_unit`` and ``items_in_batch``: tokens for language models), else samples.

    Only the time inside training batches counts (forward, backward, communication, optimizer
    step): validation and checkpointing would otherwise make the number depend on their schedule.
    All ranks see batches of the same size (the DistributedSampler splits evenly), so the global
    rate is the local one times the world size.
    """

    def __init__(self, warmup_steps: int = 5) -> None:
        # warmup_steps 5: the first batches of a run pay for lazy initialisation and allocator growth
        super().__init__()
        self.warmup_steps = warmup_steps
        self.unit = "samples"
        self.items = 0
        self.seconds = 0.0
        self._started: Optional[float] = None
        self._batches = 0  # in this run: a resumed run starts at a high global_step but is cold again
        self._window_items = 0
        self._window_seconds = 0.0

    @property
    def per_second(self) -> Optional[float]:
        """Global items per second so far (None before the first measured batch)."""
        return self.items / self.seconds if self.seconds > 0 else None

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.unit = getattr(pl_module, "throughput_unit", "samples")
        self.items, self.seconds, self._batches = 0, 0.0, 0

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._batches += 1
        if self._started is None or self._batches <= self.warmup_steps:
            return
        seconds = time.perf_counter() - self._started
        count = pl_module.items_in_batch(batch) if hasattr(pl_module, "items_in_batch") else len(batch[0])
        items = count * trainer.world_size
        self.items += items
        self.seconds += seconds
        self._window_items += items
        self._window_seconds += seconds
        if trainer.global_step % trainer.log_every_n_steps == 0 and self._window_seconds > 0:
            pl_module.log(f"throughput/{self.unit}_per_sec", self._window_items / self._window_seconds,
                          rank_zero_only=True)
            self._window_items, self._window_seconds = 0, 0.0


class CommStats(Callback):
    """Logs the bytes rank 0 sent in its last training step (``ZeroStrategy.comm_stats()``), in MiB,
    as ``comm/<key>_MiB`` for ``keys``, every ``log_every_n_steps``; nothing under other strategies.

    Every rank of a data-parallel step sends the same bytes (see [Note: bytes sent] in
    engine/comm/volume.py), so rank 0's figures are every rank's.
    """

    def __init__(self, keys: Sequence[str] = ("total", "inter_node", "all_gather", "reduce_scatter")) -> None:
        super().__init__()
        from ..engine.comm.volume import empty_stats

        known = list(empty_stats())
        unknown = [key for key in keys if key not in known]
        if unknown:
            raise ValueError(f"callbacks.comm_stats.keys: {unknown} are not keys of comm_stats(); choose among {known}.")
        self.keys = tuple(keys)

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        stats = getattr(trainer.strategy, "comm_stats", None)
        if stats is None or trainer.global_step % trainer.log_every_n_steps:
            return
        last = stats()
        for key in self.keys:
            pl_module.log(f"comm/{key}_MiB", last[key] / 2**20, rank_zero_only=True)


class MemoryTable(Callback):
    """At the end of training, every rank measures its model-state bytes (``memory_stats``: live
    tensors, each storage once) and rank 0 prints them next to ``estimate_memory`` (the ZeRO
    paper's formula) for the run's stage, world size and precision.

    Measured at the end of training, after the last optimizer step: the optimizer state exists
    then, and gradients are whatever the strategy keeps between steps.
    """

    def __init__(self) -> None:
        super().__init__()
        self.measured: list[dict[str, int]] = []  # per rank, filled on every rank
        self.formula: dict[str, int] = {}
        self.num_params = 0
        self.stage = 0

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        strategy = trainer.strategy
        if hasattr(strategy, "memory_stats"):
            mine = strategy.memory_stats()
        else:  # DDP and other strategies: the same accounting, over the plain optimizers
            mine = memory_stats(pl_module, trainer.optimizers)
        local = torch.tensor([mine[k] for k in MEMORY_COLUMNS], dtype=torch.float64, device=pl_module.device)
        gathered = strategy.all_gather(local)  # (world, columns); all ranks call this together
        rows = gathered.reshape(-1, len(MEMORY_COLUMNS)).cpu().tolist()
        self.measured = [{k: int(v) for k, v in zip(MEMORY_COLUMNS, row)} for row in rows]
        self.num_params = count_parameters(pl_module)  # a tied weight once, a sharded one whole
        self.stage = _zero_stage(strategy)
        config = getattr(strategy, "config", None)  # ZeroStrategy's: the offload settings
        self.formula = estimate_memory(self.num_params, stage=self.stage, world_size=trainer.world_size,
                                       precision=normalize_precision(trainer.precision),
                                       optimizer_state_bytes=_state_bytes_per_param(trainer.optimizers),
                                       offload_optimizer=bool(getattr(config, "offload_optimizer", False)),
                                       offload_params=bool(getattr(config, "offload_params", False)),
                                       offload_disk=getattr(config, "offload_dir", None) is not None,
                                       local_accumulation=bool(getattr(config, "local_accumulation", False)),
                                       grad_accum_dtype=getattr(config, "grad_accum_dtype", "fp32"))
        if trainer.is_global_zero:
            print_memory_table(self.measured, self.formula, self.num_params, self.stage, trainer.world_size,
                               trainer.precision)


def _state_bytes_per_param(optimizers: list) -> Optional[float]:
    """Optimizer-state bytes per parameter for the formula when they are not Adam's 8 (its
    default): SGD keeps one fp32 momentum buffer, or nothing without momentum."""
    if len(optimizers) != 1:
        return None
    opt = getattr(optimizers[0], "inner", optimizers[0])  # a ZeroOptimizer wraps the user's class
    if type(opt).__name__ == "SGD":
        return 4.0 if any(g.get("momentum", 0) for g in opt.param_groups) else 0.0
    return None
