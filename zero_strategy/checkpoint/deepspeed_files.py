"""The files of a DeepSpeed ZeRO checkpoint: finding them, checking them, unpickling them safely; and
writing the consolidated file atomically.

[Note: DeepSpeed checkpoint layout]
``engine.save_checkpoint(save_dir, tag)`` (DeepSpeed 0.x, data parallel only) writes::

    save_dir/latest                              the tag of the newest save, one line
    save_dir/<tag>/mp_rank_00_model_states.pt    stages 1-2: the module's state dict in the working
                                                 dtype, param_shapes (the trainable parameters of
                                                 each param group, in flat order), shared_params
                                                 (tied names), frozen weights (stage 2), counters,
                                                 the config, and the caller's client state
    save_dir/<tag>/zero_pp_rank_R_mp_rank_00_model_states.pt
                                                 stage 3: the same for each rank R, with empty
                                                 weights and rank R's partition of each frozen one
    save_dir/<tag>/[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt
                                                 rank R's fp32 master partition and the state of
                                                 the torch optimizer that steps it

The tag is ``global_step<N>`` unless the caller named one; Lightning's DeepSpeedStrategy saves into a
``<name>.ckpt`` directory with the tag ``checkpoint`` and its trainer state as the client state.
Files ``mp_rank_01...`` (tensor parallel), ``layer_*`` (pipeline parallel) and ``expp_rank_*``
(mixture of experts) are layouts this reader does not handle, and it says so.

[Note: safe unpickling of DeepSpeed files]
The files are pickles. They are loaded with ``torch.load(weights_only=True)``, which builds only
tensors, containers and numbers, plus the few DeepSpeed types the files hold, named in
``DEEPSPEED_TYPES``. For those, stand-ins defined here receive what the pickle would have given the
real class (its constructor arguments and attribute dict), so no DeepSpeed code runs and DeepSpeed
need not be installed; they are then turned into plain dicts. Any other type is an error naming it.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional

import torch

from . import files
from .store import CheckpointError

LATEST = "latest"
MODEL_STATES = "mp_rank_00_model_states.pt"  # stages 1-2


def zero3_model_states(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


_OPTIM_STATES = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MP_RANK = re.compile(r"mp_rank_(\d+)")


# ---- safe unpickling -----------------------------------------------------------------------


class _StandIn:
    """Takes the place of an allowlisted DeepSpeed object while unpickling: it keeps the arguments
    and attribute dict the pickle gives it, runs nothing, and becomes a plain dict afterwards."""

    type_name = ""

    def __new__(cls, *args: Any) -> "_StandIn":
        obj = super().__new__(cls)
        obj.args, obj.state = args, {}
        return obj

    def __setstate__(self, state: Any) -> None:
        self.state = dict(state) if isinstance(state, dict) else {"state": state}


def _stand_in(full_name: str) -> type:
    return type(full_name.rsplit(".", 1)[1], (_StandIn,), {"type_name": full_name})


def _enum_value(value: Any) -> Any:
    """An Enum pickles as ``EnumClass(value)``: keep the value (ZeroStageEnum is an int enum)."""
    return value


# Every non-torch type found in DeepSpeed 0.19 checkpoints; a type found later is named by the error
DEEPSPEED_TYPES: dict[str, Any] = {
    "deepspeed.runtime.zero.config.ZeroStageEnum": _enum_value,  # the stage
    "deepspeed.utils.tensor_fragment.fragment_address": _stand_in("deepspeed.utils.tensor_fragment.fragment_address"),
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": _stand_in("deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": _stand_in(
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
}
_SAFE_GLOBALS = [(obj, name) for name, obj in DEEPSPEED_TYPES.items()]


def _plain(obj: Any) -> Any:
    """Stand-ins as dicts (with their type under ``"type"``), OrderedDicts as dicts, all the way down."""
    if isinstance(obj, _StandIn):
        return {"type": obj.type_name, **{k: _plain(v) for k, v in obj.state.items()}}
    if isinstance(obj, (dict, OrderedDict)):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        return tuple(_plain(v) for v in obj)
    return obj


def _check_archive(path: Path) -> None:
    """A zip-format torch file (what torch.save writes by default) carries a CRC-32 of every record:
    check them all, so a damaged byte anywhere is found before anything is loaded."""
    if not zipfile.is_zipfile(path):
        return  # torch's legacy format has no checksums: torch.load finds what damage it can
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
        raise CheckpointError(f"{path} is damaged: {err}. Copy the file again from where it was saved.") from err
    if bad is not None:
        raise CheckpointError(f"{path} is damaged: its record {bad!r} fails its CRC-32 check. Copy the file again "
                              "from where it was saved.")


def load_safely(path: Path) -> dict[str, Any]:
    """One DeepSpeed file as plain data: see [Note: safe unpickling of DeepSpeed files]."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the DeepSpeed checkpoint is incomplete. Copy the whole "
                              f"{path.parent.name} folder from where it was saved.")
    _check_archive(path)
    try:
        with torch.serialization.safe_globals(_SAFE_GLOBALS):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(_unpickling_message(path, err)) from err
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as err:
        raise CheckpointError(f"{path} cannot be read ({err}): the file is truncated or damaged. Copy it again "
                              "from where it was saved.") from err
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not the dict DeepSpeed saves: it is not a "
                              "DeepSpeed checkpoint file.")
    return _plain(obj)


def _unpickling_message(path: Path, err: Exception) -> str:
    try:
        unknown = [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(path) if g not in DEEPSPEED_TYPES]
    except Exception:  # noqa: BLE001 - the listing is only for the message; the load failed anyway
        unknown = []
    if unknown:
        return (f"{path} holds objects of types this reader does not load: {', '.join(sorted(unknown))}. Only "
                f"tensors, containers, numbers and the DeepSpeed types {sorted(DEEPSPEED_TYPES)} are unpickled "
                "(never arbitrary code). If a type is yours (client state, hyper-parameters) and you trust the "
                "file, allow it first with torch.serialization.add_safe_globals([YourClass]).")
    return f"{path} cannot be unpickled safely ({err}): the file is damaged or not a DeepSpeed checkpoint file."


# ---- finding the files ---------------------------------------------------------------------


def _is_tag_folder(path: Path) -> bool:
    return path.is_dir() and ((path / MODEL_STATES).is_file() or (path / zero3_model_states(0)).is_file())


def _tag_folders(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if _is_tag_folder(p)) if path.is_dir() else []


def is_deepspeed_checkpoint(path: Any) -> bool:
    """True for a DeepSpeed checkpoint directory (a ``latest`` file, or a tag folder holding
    ``mp_rank_00_model_states.pt`` or ``zero_pp_rank_0_mp_rank_00_model_states.pt``) or for
    such a tag folder itself."""
    path = Path(path)
    return path.is_dir() and ((path / LATEST).is_file() or _is_tag_folder(path) or bool(_tag_folders(path)))


def tag_folder(path: Path, tag: Optional[str]) -> Path:
    """The folder of one save: ``path/tag``, else the one ``path/latest`` names, else ``path``
    itself when it is one, else the only one there is."""
    if not path.exists():
        raise FileNotFoundError(f"DeepSpeed checkpoint {path} does not exist.")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file; a DeepSpeed checkpoint is the directory given to "
                              "engine.save_checkpoint (or one of its tag folders, such as global_step100).")
    if tag is not None:
        folder = path / str(tag)
        if not folder.is_dir():
            found = [p.name for p in _tag_folders(path)]
            raise CheckpointError(f"tag {tag!r} is not in {path}: it has no folder {folder.name}. Tags there: "
                                  f"{found or 'none'}.")
        return folder
    if _is_tag_folder(path) or _has_optimizer_files(path):
        return path
    if (path / LATEST).is_file():
        named = (path / LATEST).read_text().strip()
        if not named or not (path / named).is_dir():
            raise CheckpointError(f"{path / LATEST} names the tag {named!r}, but {path} has no folder of that name: "
                                  f"the save did not finish or the folder was removed. Pass tag= one of "
                                  f"{[p.name for p in _tag_folders(path)]}.")
        return path / named
    folders = _tag_folders(path)
    if len(folders) == 1:
        return folders[0]
    if not folders:
        raise CheckpointError(f"{path} is not a DeepSpeed checkpoint: it has no {LATEST} file and no folder holding "
                              f"{MODEL_STATES} or {zero3_model_states(0)}.")
    raise CheckpointError(f"{path} has no {LATEST} file and several saves, {[p.name for p in folders]}: pass tag= "
                          "the one to read.")


def _has_optimizer_files(folder: Path) -> bool:
    return any(_OPTIM_STATES.match(p.name) for p in folder.iterdir())


@dataclass(frozen=True)
class DeepSpeedFiles:
    """The files of one save, each rank's in rank order."""

    folder: Path
    optimizer_files: list[Path]
    prefix: str  # "bf16_" or ""

    def model_files(self, stage: int) -> list[Path]:
        if stage <= 2:
            return [self.folder / MODEL_STATES]
        return [self.folder / zero3_model_states(r) for r in range(len(self.optimizer_files))]


def find_files(folder: Path) -> DeepSpeedFiles:
    """The optimizer files of a tag folder, by rank, after refusing layouts this reader does not handle."""
    names = sorted(p.name for p in folder.iterdir())
    for name in names:
        mp = _MP_RANK.search(name)
        if name.startswith("layer_") or (mp is not None and mp.group(1) != "00"):
            raise CheckpointError(f"{folder / name} belongs to a pipeline- or tensor-parallel DeepSpeed checkpoint, "
                                  "which this reader does not convert (it reads data-parallel ZeRO checkpoints). "
                                  "Convert it with DeepSpeed's ds_to_universal.py and load the result with DeepSpeed, "
                                  "or save the model from a data-parallel run.")
        if "expp_rank" in name or name.startswith("expert_"):
            raise CheckpointError(f"{folder / name} belongs to a mixture-of-experts DeepSpeed checkpoint, which this "
                                  "reader does not convert; export the weights with DeepSpeed's zero_to_fp32.py.")
    ranks: dict[int, Path] = {}
    prefixes = set()
    for name in names:
        match = _OPTIM_STATES.match(name)
        if match:
            ranks[int(match.group(2))] = folder / name
            prefixes.add(match.group(1) or "")
    if not ranks:
        raise CheckpointError(f"{folder} has no *zero_pp_rank_R_mp_rank_00_optim_states.pt files: it is not a ZeRO "
                              "checkpoint (stage 0 saves the optimizer inside the model file), or the optimizer files "
                              "were not copied. Only ZeRO stages 1-3 are read.")
    if len(prefixes) > 1:
        raise CheckpointError(f"{folder} mixes bf16_ and plain optimizer files: two saves wrote into one folder. Save "
                              "again into an empty folder.")
    prefix = prefixes.pop()
    expected = [folder / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(max(ranks) + 1)]
    missing = [p.name for r, p in enumerate(expected) if r not in ranks]
    if missing:
        raise CheckpointError(f"{folder} lacks the optimizer files {missing}: the checkpoint is incomplete (a rank "
                              "did not save, or not every file was copied). Copy them from where it was saved.")
    return DeepSpeedFiles(folder, expected, prefix)


def check_world_size(files: DeepSpeedFiles, world_size: int) -> None:
    """The save's world size (from rank 0's file) must match the number of optimizer files."""
    found = len(files.optimizer_files)
    if found < world_size:
        missing = [f"{files.prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(found, world_size)]
        raise CheckpointError(f"{files.folder} was saved by {world_size} ranks but lacks the optimizer files "
                              f"{missing}: the checkpoint is incomplete. Copy them from where it was saved.")
    if found > world_size:
        raise CheckpointError(f"{files.folder} holds {found} optimizer files, but it was saved by {world_size} ranks: "
                              "files of another save are mixed in. Keep only the ranks' files of one save.")


# ---- writing -------------------------------------------------------------------------------


def atomic_write(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """``write(f)`` into a file object, atomically (see ``files.atomic_write``)."""

    def to_file(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            write(f)

    files.atomic_write(path, to_file)
