"""Sharded checkpoints: save per rank, load at any world size and stage, consolidate to one file.

``store`` is the on-disk format (see [Note: checkpoint layout]; ``format``, ``index`` and ``files``
are its names, its index's validation and its file writes), ``sharded`` maps the engine's flat groups
and optimizer pieces onto it, ``consolidate`` puts a checkpoint back together offline, ``hf_export``
(with ``hf_plan`` and ``hf_layout``) writes it, or a running job's model, in the Hugging Face
layout, ``deepspeed`` reads DeepSpeed's ZeRO checkpoints as regular ones, and ``pickled`` keeps what a
safe load refuses beside the rest (see [Note: pickled objects]).
"""

from .consolidate import consolidate_checkpoint
from .deepspeed import (align_optimizer_state, consolidate_deepspeed_checkpoint, is_deepspeed_checkpoint,
                        read_deepspeed_checkpoint)
from .hf_export import export_hf_checkpoint
from .format import PickledObjectsWarning
from .sharded import load_model, load_optimizers, save_sharded
from .store import CheckpointError, CheckpointReader, UnverifiedCheckpointWarning, is_sharded_checkpoint

__all__ = ["CheckpointError", "CheckpointReader", "PickledObjectsWarning", "UnverifiedCheckpointWarning",
           "align_optimizer_state", "consolidate_checkpoint", "consolidate_deepspeed_checkpoint",
           "export_hf_checkpoint", "is_deepspeed_checkpoint", "is_sharded_checkpoint", "load_model", "load_optimizers",
           "read_deepspeed_checkpoint", "save_sharded"]
