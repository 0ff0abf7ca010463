"""Offline conversion of a sharded checkpoint into one regular Lightning checkpoint file.

No process group and no model are needed: the index says where every range of every tensor is,
so the whole tensors are put together straight from the rank files. Every part is checked against
its checksum before anything is written (see [Note: checksums]), and the outputs are created as a
plain ``open()`` creates files, with the mode the umask gives.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import save_file

from .files import atomic_write
from .format import PICKLED_OBJECTS, PickledObjectsWarning
from .pickled import dotted
from .sharded import StoredTensor, _best_source, optim_name, state_source, torch_layout
from .store import CheckpointError, CheckpointReader


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
    return [torch_layout(rec, lambda key, name, i=i, rec=rec: _whole(reader, rec, i, key, name))
            for i, rec in enumerate(saved["optimizers"])]


def _whole(reader: CheckpointReader, rec: dict[str, Any], i: int, key: str, name: str) -> torch.Tensor:
    """A whole state tensor; bf16 and int8 state decoded to fp32 (see [Note: stored optimizer state] in
    checkpoint/sharded.py)."""
    source = state_source(reader, rec, i, key, name)
    if isinstance(source, StoredTensor):
        value = reader.full(optim_name(i, key, name))
        return value.float() if key in rec.get("stored_form", {}).get(name, {}) else value
    return source.read_range(0, source.numel()).reshape(source.shape)


def consolidate_checkpoint(ckpt_dir: Any, out_path: Any, safetensors_path: Any = None,
                           weights_only: bool = False, verify: bool = True) -> Path:
    """Write the sharded checkpoint ``ckpt_dir`` as one Lightning checkpoint file at ``out_path``.

    The file holds the full fp32 ``state_dict`` (tied and frozen weights included), the optimizer
    states in torch's layout (unless ``weights_only``) and Lightning's loop, callback and
    scheduler state, so ``LitModule.load_from_checkpoint(out_path)``, ``torch.load(out_path,
    weights_only=True)`` and ``Trainer.fit(ckpt_path=out_path)`` (DDP or ZeRO) all read it.
    ``safetensors_path`` also writes the weights alone as safetensors. Both writes are atomic.
    ``verify=False`` skips the checksums (a damaged checkpoint is then written out as it is).
    """
    for target in (out_path, safetensors_path):
        if target is not None and Path(target).is_dir():
            raise IsADirectoryError(f"the output {target} is a directory; give the path of a file to write (for "
                                    f"example {Path(target) / 'model.ckpt'}).")
    reader = CheckpointReader(ckpt_dir, verify=verify)
    state = reader.trainer_state()
    saved = state.pop("zero_checkpoint", None)
    if not isinstance(saved, dict):
        raise CheckpointError(f"{reader.path} has no zero_checkpoint entry in its trainer state: it was not written "
                              "by ZeroStrategy.")
    left_out = saved.get("pickled_objects")
    if left_out:  # see [Note: pickled objects] in checkpoint/pickled.py
        warnings.warn(f"{reader.path} holds objects that only full unpickling loads ({', '.join(map(dotted, left_out))}"
                      f", in its {PICKLED_OBJECTS}); they are left out of {out_path}, which loads with "
                      "torch.load(weights_only=True).", PickledObjectsWarning, stacklevel=2)
    state_dict = full_state_dict(reader, saved)
    checkpoint = {**state, "state_dict": state_dict}
    optimizer_states = None if weights_only else full_optimizer_states(reader, saved)
    if optimizer_states is not None:
        checkpoint["optimizer_states"] = optimizer_states
    else:
        for key in ("optimizer_states", "lr_schedulers", "callbacks"):
            checkpoint.pop(key, None)
    reader.verify_all()  # what this conversion did not read is checked too: a damaged checkpoint is reported
    out_path = Path(out_path)
    atomic_write(out_path, lambda tmp: torch.save(checkpoint, tmp))
    if safetensors_path is not None:
        tensors, seen = {}, set()
        for key, value in state_dict.items():
            if isinstance(value, torch.Tensor):  # safetensors stores no shared tensors: tied ones are copied
                tensors[key] = value.clone() if id(value) in seen else value.contiguous()
                seen.add(id(value))
        atomic_write(Path(safetensors_path), lambda tmp: save_file(tensors, str(tmp)))
    return out_path
