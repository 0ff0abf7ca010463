"""A DeepSpeed config's ``torch_autocast`` section: the forward under ``torch.autocast``, over fp32
weights, or over bf16 weights with ``bf16`` enabled.

[Note: torch_autocast]
DeepSpeed 0.19's meaning, read here: ``enabled`` (false by default) runs the engine's forward under
``torch.autocast(device, dtype)``, inputs as given. ``dtype`` is DeepSpeed's dtype names ("bfloat16",
"bf16", "torch.bfloat16", "fp16", "float16", "half", ...; absent: torch's default for the device,
bf16 on the CPU and fp16 on CUDA).
- Alone, the parameters, their gradients, the optimizer state and the update stay fp32 (the model's
  own dtype). fp16 scales the loss as DeepSpeed does there (torch's GradScaler: 2**16, halved at
  each overflow, doubled after 2000 clean steps; an overflowing step is skipped).
  ``lower_precision_safe_modules`` (class paths such as "torch.nn.modules.linear.Linear"; absent:
  DeepSpeed's default, Linear and Conv1d/2d/3d; ``[]``: none) names the classes (exactly: DeepSpeed
  compares ``module.__class__``) whose own parameters' gradients DeepSpeed reduces in the autocast
  dtype: here ``low_precision_reduce_modules`` with that dtype (see [Note: low-precision reductions]
  in engine/grads/reducer.py), which gives DeepSpeed's numbers on 2 ranks.
- With ``bf16.enabled`` (DeepSpeedExamples' training/bf16_master_weight ``bf16_full`` config, with
  ``bf16_master_weights_and_grads`` and ``bf16_optimizer_states``): DeepSpeed casts the weights to
  bf16 and runs the forward under autocast as well, so ops on autocast's fp32 list (losses, cdist,
  prod) compute in fp32 and fp32 inputs meet bf16 weights. Here the same: "bf16-mixed" weights, the
  masters and optimizer state as the bf16 section says (master_weights_dtype, optimizer_state_dtype;
  see keys.py), the forward under autocast to bfloat16. Every gradient is bf16 then (the weights'
  dtype), so ``lower_precision_safe_modules`` changes nothing. An fp16 forward over bf16 weights
  (``dtype`` fp16, or absent on CUDA) is refused: DeepSpeed adds torch's GradScaler to it.
- With ``fp16.enabled``: refused (fp16 weights under autocast; DeepSpeed's CPU accelerator refuses
  fp16 itself where the CPU lacks AVX512-FP16).
Only ``initialize`` reads the section: ZeroStrategy and ZeroFabricStrategy refuse it, since their
precision comes from Lightning's ``precision=``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .keys import DeepSpeedConfigError, Findings, read_flag, read_section

__all__ = ["AUTOCAST_DTYPES", "AutocastSettings", "read_torch_autocast"]

AUTOCAST_DTYPES = {name: torch.bfloat16 for name in ("bfloat16", "bf16", "torch.bfloat16")} | {
    name: torch.float16 for name in ("fp16", "float16", "half", "torch.float16")}


LOWER_PRECISION_SAFE_MODULES = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
"""DeepSpeed's default ``lower_precision_safe_modules`` (deepspeed/runtime/torch_autocast.py)."""


@dataclass(frozen=True)
class AutocastSettings:
    dtype: Optional[torch.dtype]  # None: torch's default for the device
    lower_precision_safe_modules: tuple[str, ...]  # as the config names them (class paths); () when absent
    reduce_modules: tuple[type, ...] = LOWER_PRECISION_SAFE_MODULES  # the classes: low_precision_reduce_modules


def read_torch_autocast(config: Mapping, findings: Findings, precision: Optional[str],
                        front_end: str) -> Optional[AutocastSettings]:
    """The ``torch_autocast`` section, when enabled (see [Note: torch_autocast]); problems go to ``findings``."""
    if config.get("torch_autocast") is None:
        return None
    section = read_section(config["torch_autocast"], "torch_autocast")
    if not read_flag(section.get("enabled", False), "torch_autocast.enabled"):
        findings.ignored["torch_autocast"] = "disabled"
        return None
    if front_end != "initialize":
        findings.problems.append(f"torch_autocast (enabled): {front_end} takes its precision from Lightning's "
                                 "precision=...; with this package that is ZeRO's own \"bf16-mixed\" (bf16 weights, "
                                 "fp32 masters). Use initialize() for torch.autocast, or enable \"bf16\" instead")
        return None
    if precision == "16-mixed":
        findings.problems.append("torch_autocast with fp16.enabled: fp16 weights under autocast are not supported "
                                 "here (DeepSpeed's CPU accelerator refuses fp16 too: \"Type fp16 is not supported "
                                 "on your device\", on CPUs without AVX512-FP16); use bf16.enabled with "
                                 "torch_autocast, as DeepSpeed's bf16 examples do, or remove one of the two")
    dtype_name = section.get("dtype")
    dtype = None
    if dtype_name is not None:
        dtype = AUTOCAST_DTYPES.get(str(dtype_name))
        if dtype is None:
            findings.problems.append(f"torch_autocast.dtype={dtype_name!r}: autocast runs in "
                                     f"{', '.join(repr(n) for n in AUTOCAST_DTYPES)}")
    if precision == "bf16-mixed":
        if dtype == torch.float16:
            findings.problems.append(f"torch_autocast.dtype={dtype_name!r} with bf16.enabled: an fp16 forward over "
                                     "bf16 weights (DeepSpeed would add torch's GradScaler and reduce some gradients "
                                     "in fp16) is not supported here; autocast to \"bfloat16\"")
        findings.notes.append("torch_autocast with bf16.enabled: bf16 weights and gradients (their masters and "
                              "optimizer state as the bf16 section says), the forward under torch.autocast to "
                              "bfloat16 (inputs as given), as DeepSpeed runs them; every gradient is bf16 already, so "
                              "lower_precision_safe_modules changes nothing")
    modules = section.get("lower_precision_safe_modules")
    names: tuple[str, ...] = ()
    classes: tuple[type, ...] = LOWER_PRECISION_SAFE_MODULES  # DeepSpeed's default when the key is absent
    if modules is not None:
        if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
            findings.problems.append(f"torch_autocast.lower_precision_safe_modules={modules!r}: give a list of class "
                                     "paths such as [\"torch.nn.modules.linear.Linear\"]")
        else:
            names, found = tuple(modules), []
            for name in names:
                cls, problem = _imported_class(name)
                if problem:
                    findings.problems.append(f"torch_autocast.lower_precision_safe_modules: {name!r} {problem}")
                found.append(cls)
            classes = tuple(c for c in found if c is not None)  # those that failed are problems already
    if precision != "bf16-mixed" and classes:
        findings.notes.append(f"torch_autocast: the gradients of {', '.join(c.__name__ for c in classes)} parameters "
                              "are reduced in the autocast dtype (lower_precision_safe_modules"
                              f"{'' if modules is not None else ', DeepSpeed default'}), the others in fp32")
    return AutocastSettings(dtype, names, classes)


def _imported_class(path: str) -> tuple[Any, str]:
    """The class at ``path`` (DeepSpeed imports each one: ``importlib.import_module`` of all but the last
    part, then the attribute), and what is wrong with it ("" when nothing is)."""
    package, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(package), name) if package else None
    except (ImportError, AttributeError) as err:
        return None, f"does not import ({type(err).__name__}: {err}); give the class's module path and name"
    if not isinstance(found, type):
        return None, "is not a class; give a module class's path, e.g. torch.nn.modules.linear.Linear"
    return found, ""


def autocast_kwargs(settings: Optional[AutocastSettings], device: torch.device,
                    precision: Optional[str] = None) -> dict[str, Any]:
    """WorkingPrecision's arguments for ``settings`` on ``device`` (none without autocast); ``precision``
    is the config's (bf16 weights autocast to bfloat16 only)."""
    if settings is None:
        return {}
    dtype = settings.dtype or torch.get_autocast_dtype(device.type)
    if precision == "bf16-mixed" and dtype != torch.bfloat16:
        raise DeepSpeedConfigError(f"torch_autocast gives no dtype, which on {device.type} is torch's default, "
                                   f"{dtype}: an fp16 forward over the bf16 weights of bf16.enabled is not supported "
                                   "here; set torch_autocast.dtype to \"bfloat16\".")
    return {"autocast_dtype": dtype}


