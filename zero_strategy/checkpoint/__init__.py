"""Sharded checkpoints: save per rank, load at any world size and stage, consolidate to one file.

``store`` is the on-disk format (see [Note: checkpoint layout]), ``sharded`` maps the engine's
flat groups and optimizer pieces onto it, ``consolidate`` puts a checkpoint back together offline.
"""

from .consolidate import consolidate_checkpoint
from .sharded import load_model, load_optimizers, save_sharded
from .store import CheckpointError, CheckpointReader, is_sharded_checkpoint

__all__ = ["CheckpointError", "CheckpointReader", "consolidate_checkpoint", "is_sharded_checkpoint", "load_model",
           "load_optimizers", "save_sharded"]
