"""Offline conversion of a sharded checkpoint into one regular Lightning checkpoint file.

No process group and no model are needed: the index says where every range of every tensor is,
so the whole tensors are put together straight from the rank files.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import save_file

from .sharded import _best_source, optim_name, torch_layout
from .store import CheckpointReader


def full_state_dict(reader: CheckpointReader, saved: dict[str, Any]) -> dict[str, Any]:
    """The model's state dict, whole: half-precision tensors in fp32 (from the master weights where
    the run kept them), tied parameters as one tensor under each of their names."""
    out: dict[str, Any] = {}
    loaded: dict[str, torch.Tensor] = {}
    for key, stored in saved["model_keys"].items():
        if stored not in loaded:
            value = reader.full(_best_source(reader, stored))
            loaded[stored] = value.float() if value.dtype in (torch.float16, torch.bfloat16) else value
        out[key] = loaded[stored]
    out.update(saved.get("model_extra_state", {}))
    return out


def full_optimizer_states(reader: CheckpointReader, saved: dict[str, Any]) -> Optional[list[dict[str, Any]]]:
    """Each optimizer's state dict in torch's own (unsharded) layout, or None for a weights-only checkpoint."""
    if saved.get("optimizers") is None:
        return None
    return [torch_layout(rec, lambda key, name, i=i: reader.full(optim_name(i, key, name)))
            for i, rec in enumerate(saved["optimizers"])]


def consolidate_checkpoint(ckpt_dir: Any, out_path: Any, safetensors_path: Any = None,
                           weights_only: bool = False) -> Path:
    """Write the sharded checkpoint ``ckpt_dir`` as one Lightning checkpoint file at ``out_path``.

    The file holds the full fp32 ``state_dict`` (tied and frozen weights included), the optimizer
    states in torch's layout (unless ``weights_only``) and Lightning's loop, callback and
    scheduler state, so ``LitModule.load_from_checkpoint(out_path)``, ``torch.load(out_path,
    weights_only=True)`` and ``Trainer.fit(ckpt_path=out_path)`` (DDP or ZeRO) all read it.
    ``safetensors_path`` also writes the weights alone as safetensors. Both writes are atomic.
    """
    reader = CheckpointReader(ckpt_dir)
    state = reader.trainer_state()
    saved = state.pop("zero_checkpoint")
    state_dict = full_state_dict(reader, saved)
    checkpoint = {**state, "state_dict": state_dict}
    optimizer_states = None if weights_only else full_optimizer_states(reader, saved)
    if optimizer_states is not None:
        checkpoint["optimizer_states"] = optimizer_states
    else:
        for key in ("optimizer_states", "lr_schedulers", "callbacks"):
            checkpoint.pop(key, None)
    out_path = Path(out_path)
    _atomic_write(out_path, lambda tmp: torch.save(checkpoint, tmp))
    if safetensors_path is not None:
        tensors, seen = {}, set()
        for key, value in state_dict.items():
            if isinstance(value, torch.Tensor):  # safetensors stores no shared tensors: tied ones are copied
                tensors[key] = value.clone() if id(value) in seen else value.contiguous()
                seen.add(id(value))
        _atomic_write(Path(safetensors_path), lambda tmp: save_file(tensors, tmp))
    return out_path


def _atomic_write(path: Path, write) -> None:
    """``write(tmp)`` into a temporary file beside ``path``, then rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
