"""``save_pretrained`` for every front end: a module on the engine written in the Hugging Face layout.

The export itself is checkpoint/hf_export.py's ``export_module`` (one tensor gathered at a time,
written by rank 0); this is the front ends' door to it, and the guard that makes transformers' and
peft's own ``save_pretrained`` on a stage-3 model write the full weights or refuse, never empty
tensors (see [Note: save_pretrained at stage 3] in checkpoint/hf_export.py).
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from ..checkpoint.hf_export import DEFAULT_ADAPTER_DIR, Exported, export_module, guard_save_pretrained
from ..checkpoint.hf_layout import DEFAULT_MAX_SHARD_SIZE
from ..checkpoint.sharded import writes_shards
from .engine_model import EngineModel


def save_pretrained(model: EngineModel, save_directory: Any, dtype: Union[str, torch.dtype, None] = None,
                    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE, config: Any = None,
                    prefix: Optional[str] = None, adapter_dir: Optional[str] = DEFAULT_ADAPTER_DIR,
                    adapter_only: bool = False) -> Exported:
    """Write ``model.module`` as a Hugging Face model directory (config.json, safetensors shards and
    their index, the model's own key names; a peft model merged, its adapter alone in
    ``adapter_dir``) from rank 0, gathering one tensor at a time. A collective: call it on every rank.

    ``dtype`` ("bf16", "fp16", "fp32"; default: the masters' where they are more precise than the
    working weights, else the weights'), ``max_shard_size`` (bytes or "5GB"), ``config`` (a config.json
    or a model directory, for a module that holds no transformers model), ``prefix`` (the attribute
    path of the model to export, "model."; default: the one transformers or peft model inside).
    """
    return export_module(model.module, model.groups, model.comm, save_directory, dtype, max_shard_size, config,
                         prefix, adapter_dir, adapter_only, writes_shards(model.optimizers, model.sharder))


def guard_hf_save_pretrained(model: EngineModel) -> None:
    """At stage 3, the transformers and peft models inside ``model.module`` save through the export."""
    guard_save_pretrained(model.module, lambda save_directory, **options: save_pretrained(model, save_directory,
                                                                                          **options))
