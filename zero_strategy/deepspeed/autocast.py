"""A DeepSpeed config's ``torch_autocast`` section: fp32 weights, gradients and optimizer, the
forward under ``torch.autocast``.

[Note: torch_autocast]
DeepSpeed 0.19's meaning, read here: ``enabled`` (false by default) runs the engine's forward under
``torch.autocast(device, dtype)``; the parameters, their gradients, the optimizer state and the
update stay fp32 (the model's own dtype). ``dtype`` is DeepSpeed's dtype names ("bfloat16", "bf16",
"torch.bfloat16", "fp16", "float16", "half", ...; absent: torch's default for the device, bf16 on
the CPU and fp16 on CUDA). fp16 scales the loss as DeepSpeed does there (torch's GradScaler:
2**16, halved at each overflow, doubled after 2000 clean steps; an overflowing step is skipped).
``lower_precision_safe_modules`` (class paths such as "torch.nn.modules.linear.Linear") names the
modules whose gradients DeepSpeed reduces in the autocast dtype; each path is checked to import,
but this engine reduces every gradient in fp32 (it has one communication dtype per parameter group,
that of the weights), so with the section's default module list (Linear and Conv layers) the result
is a little more exact than DeepSpeed's and not bit-equal to it; ``[]`` (no module) matches
DeepSpeed's numbers. The section cannot be combined with ``fp16`` or ``bf16`` enabled (those are
low-precision weights with fp32 masters: pick one), and only ``initialize`` reads it: ZeroStrategy
and ZeroFabricStrategy refuse it, since their precision comes from Lightning's ``precision=``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .keys import Findings, read_flag, read_section

__all__ = ["AUTOCAST_DTYPES", "AutocastSettings", "read_torch_autocast"]

AUTOCAST_DTYPES = {name: torch.bfloat16 for name in ("bfloat16", "bf16", "torch.bfloat16")} | {
    name: torch.float16 for name in ("fp16", "float16", "half", "torch.float16")}


@dataclass(frozen=True)
class AutocastSettings:
    dtype: Optional[torch.dtype]  # None: torch's default for the device
    lower_precision_safe_modules: tuple[str, ...]


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
    if precision in ("16-mixed", "bf16-mixed"):
        findings.problems.append(f"torch_autocast with {'fp16' if precision == '16-mixed' else 'bf16'}.enabled: "
                                 "autocast keeps fp32 weights, fp16/bf16 makes them low precision; enable one")
    dtype_name = section.get("dtype")
    dtype = None
    if dtype_name is not None:
        dtype = AUTOCAST_DTYPES.get(str(dtype_name))
        if dtype is None:
            findings.problems.append(f"torch_autocast.dtype={dtype_name!r}: autocast runs in "
                                     f"{', '.join(repr(n) for n in AUTOCAST_DTYPES)}")
    modules = section.get("lower_precision_safe_modules")
    names: tuple[str, ...] = ()
    if modules is not None:
        if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
            findings.problems.append(f"torch_autocast.lower_precision_safe_modules={modules!r}: give a list of class "
                                     "paths such as [\"torch.nn.modules.linear.Linear\"]")
        else:
            names = tuple(modules)
            for name in names:
                problem = _import_problem(name)
                if problem:
                    findings.problems.append(f"torch_autocast.lower_precision_safe_modules: {name!r} {problem}")
    if modules is None or names:
        findings.notes.append("torch_autocast: every gradient is reduced in fp32 here, also those of the "
                              "lower_precision_safe_modules DeepSpeed reduces in the autocast dtype")
    return AutocastSettings(dtype, names)


def _import_problem(path: str) -> str:
    package, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(package), name) if package else None
    except (ImportError, AttributeError) as err:
        return f"does not import ({type(err).__name__}: {err}); give the class's module path and name"
    if not isinstance(found, type):
        return "is not a class; give a module class's path, e.g. torch.nn.modules.linear.Linear"
    return ""


def autocast_kwargs(settings: Optional[AutocastSettings], device: torch.device) -> dict[str, Any]:
    """WorkingPrecision's arguments for ``settings`` on ``device`` (none without autocast)."""
    if settings is None:
        return {}
    return {"autocast_dtype": settings.dtype or torch.get_autocast_dtype(device.type)}


