"""``deepspeed.utils.zero_to_fp32``: a ZeRO checkpoint's whole fp32 weights, offline.

Reads both kinds of folder ``engine.save_checkpoint`` writes: this package's (sharded, any stage)
and DeepSpeed's (stages 1-3, read without DeepSpeed by zero_strategy/checkpoint/deepspeed.py).
``checkpoint_dir`` is the folder given to ``save_checkpoint``: the tag is ``tag`` or what its
``latest`` file names, as DeepSpeed's script reads it. Weights come from the fp32 masters where the
run kept them (bf16/fp16), tied weights appear under each of their names, buffers are included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint"]


def _tag_folder(checkpoint_dir: Any, tag: Optional[str]) -> Path:
    from .engine_checkpoint import _folder

    folder = _folder(Path(checkpoint_dir), tag)
    if folder is None:
        raise FileNotFoundError(f"{checkpoint_dir} has no 'latest' file and is not a checkpoint itself; pass tag= the "
                                "folder of the save to read (e.g. tag='global_step100').")
    return folder


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: Any, tag: Optional[str] = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The model's state dict, whole and in fp32, from a ZeRO checkpoint (no process group needed).
    ``lazy_mode`` is accepted and reads everything at once; ``exclude_frozen_parameters=True`` is
    refused (the saved files do not mark frozen weights in this package's format)."""
    if exclude_frozen_parameters:
        raise ValueError("get_fp32_state_dict_from_zero_checkpoint(exclude_frozen_parameters=True) is not supported; "
                         "read the whole state dict and drop the frozen names yourself.")
    from ..checkpoint import is_sharded_checkpoint
    from ..checkpoint.consolidate import full_state_dict
    from ..checkpoint.deepspeed import read_deepspeed_checkpoint
    from ..checkpoint.store import CheckpointError, CheckpointReader

    folder = _tag_folder(checkpoint_dir, tag)
    if not is_sharded_checkpoint(folder):
        return read_deepspeed_checkpoint(folder)["state_dict"]
    reader = CheckpointReader(folder)
    saved = reader.trainer_state().get("zero_checkpoint")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{folder} has no zero_checkpoint entry in its trainer state; it was not written by "
                              "this package's engine.")
    return {k: v for k, v in full_state_dict(reader, saved).items() if isinstance(v, torch.Tensor)}


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: Any, tag: Optional[str] = None) -> nn.Module:
    """Load the checkpoint's fp32 weights into ``model`` (a plain module, not an engine's: after
    this it is on the CPU, as DeepSpeed leaves it) and return it."""
    if hasattr(model, "engine_model"):
        raise TypeError("load_state_dict_from_zero_checkpoint(model=engine): give the plain module (a new one); to go "
                        "on training an engine, use engine.load_checkpoint(dir).")
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: Any, output_dir: Any, max_shard_size: str = "5GB",
                                               safe_serialization: bool = False, tag: Optional[str] = None,
                                               exclude_frozen_parameters: bool = False) -> Path:
    """Write the fp32 state dict to ``output_dir/pytorch_model.bin`` (``model.safetensors`` with
    ``safe_serialization``) as one file; returns its path. ``max_shard_size`` is accepted; the file
    is not split."""
    from ..checkpoint.files import atomic_write

    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if safe_serialization:
        from safetensors.torch import save_file

        tensors, seen = {}, set()
        for key, value in state.items():  # safetensors keeps no shared tensors: tied ones are copied
            tensors[key] = value.clone() if id(value) in seen else value.contiguous()
            seen.add(id(value))
        path = out / "model.safetensors"
        atomic_write(path, lambda tmp: save_file(tensors, str(tmp)))
    else:
        path = out / "pytorch_model.bin"
        atomic_write(path, lambda tmp: torch.save(state, tmp))
    return path
