"""A DeepSpeed config's ``"optimizer"`` section as a torch optimizer with DeepSpeed's meaning.

DeepSpeed's names (``"Adam"``, ``"AdamW"`` with ``adam_w_mode``, ``torch_adam``...) become the
torch class DeepSpeed itself would run, with DeepSpeed's defaults where they differ from torch's
(its own Adam decays weights by 0, torch's AdamW by 0.01); ``"Muon"`` becomes ``DeepSpeedMuon``
over DeepSpeed's split of the parameters (deepspeed/muon.py). Other names are torch.optim classes:
elementwise ones, and Adafactor (stepped whole, each parameter by one rank); LBFGS and SparseAdam are
refused.
"""

from __future__ import annotations

import difflib
import inspect
import types
from typing import Optional

import torch

from ..engine.optim.checks import WHOLE_PARAMETER_OPTIMIZERS
from ..engine.optim.optimizer import ELEMENTWISE_OPTIMIZERS
from .factory import OptimizerFactory
from .keys import AUTO_HINT, DeepSpeedConfigError, Findings, is_auto, read_flag, read_section
from .muon import muon_factory

__all__ = ["OptimizerFactory", "optimizer_factory"]


TORCH_OPTIMIZERS = {name.lower(): cls for name, cls in vars(torch.optim).items() if inspect.isclass(cls)
                    and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer}
# not elementwise, and not stepped whole either, whatever allow_untested says (see engine/optim/checks.py);
# torch's Adafactor is stepped whole (WHOLE_PARAMETER_OPTIMIZERS), and "Muon" is DeepSpeed's (muon.py)
NOT_ELEMENTWISE = ("LBFGS", "SparseAdam")
REFUSED_OPTIMIZERS = {
    "lamb": "LAMB scales each tensor's update by a norm over the whole tensor, which a flat shard cannot compute; "
            "use AdamW",
    "lion": "torch has no Lion; return your own from configure_optimizers with zero_allow_untested_optimizer true",
    **{name: "compresses gradients in communication, which is not supported; use Adam or AdamW"
       for name in ("onebitadam", "zerooneadam", "onebitlamb")},
    **{name: "comes from the mup package: build it in configure_optimizers, with zero_allow_untested_optimizer true"
       for name in ("muadam", "muadamw", "musgd")},
}


def optimizer_factory(findings: Findings, section: dict, allow_untested: bool) -> Optional[OptimizerFactory]:
    """The torch optimizer a config's "optimizer" section names, with its arguments in torch's terms."""
    name, params = section.get("type"), dict(read_section(section.get("params") or {}, "optimizer.params"))
    if name is None:
        if params:
            findings.problems.append("optimizer.params without optimizer.type: name the optimizer, e.g. \"AdamW\"")
        return None
    if not isinstance(name, str):
        raise DeepSpeedConfigError(f"optimizer.type={name!r} must be an optimizer's name, e.g. \"AdamW\".")
    findings.problems += [f"optimizer.params.{key}='auto': {AUTO_HINT}" for key, v in params.items() if is_auto(v)]
    if "max_grad_norm" in params:
        params.pop("max_grad_norm")
        findings.problems.append("optimizer.params.max_grad_norm: use the top-level gradient_clipping (DeepSpeed "
                               "refuses it too)")
    lower = name.lower()
    if lower in REFUSED_OPTIMIZERS:
        findings.problems.append(f"optimizer.type={name!r}: {REFUSED_OPTIMIZERS[lower]}")
        return None
    if lower == "muon":  # DeepSpeed's own Muon, not torch.optim.Muon
        return muon_factory(findings, params)
    if lower in ("adam", "adamw"):
        cls = _adam_class(findings, lower, params)
    else:
        cls = TORCH_OPTIMIZERS.get(lower)
        if cls is None:
            close = difflib.get_close_matches(lower, sorted(TORCH_OPTIMIZERS), n=1)
            hint = f" (did you mean {TORCH_OPTIMIZERS[close[0]].__name__!r}?)" if close else ""
            findings.problems.append(f"optimizer.type={name!r}: no such optimizer in DeepSpeed or torch.optim{hint}")
            return None
        allowed = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        if cls.__name__ in NOT_ELEMENTWISE:
            findings.problems.append(f"optimizer.type={name!r}: its update is not elementwise, so ZeRO cannot shard "
                                   f"it; use one of {allowed}")
        elif cls not in ELEMENTWISE_OPTIMIZERS + WHOLE_PARAMETER_OPTIMIZERS and not allow_untested:
            findings.problems.append(f"optimizer.type={name!r} is not verified to be elementwise ({allowed} are); "
                                   "if it is, set zero_allow_untested_optimizer true")
    if isinstance(params.get("betas"), list):  # JSON has no tuples; torch wants (beta1, beta2)
        params["betas"] = tuple(params["betas"])
    accepted = [p for p in inspect.signature(cls).parameters if p != "params"]
    deepspeed_only = ["torch_adam", "adam_w_mode", "bias_correction", "fp32_optimizer_states"]
    for key in sorted(set(params) - set(accepted)):
        close = difflib.get_close_matches(key, accepted + deepspeed_only, n=1)
        findings.problems.append(f"optimizer.params.{key}: {cls.__name__} takes no such argument"
                               + (f" (did you mean {close[0]!r}?)" if close else ""))
    return OptimizerFactory(cls, types.MappingProxyType(params))


def _adam_class(findings: Findings, lower: str, params: dict) -> type:
    """DeepSpeed's "Adam"/"AdamW": which torch class, and its arguments in torch's terms."""
    torch_adam = read_flag(params.pop("torch_adam", False), "optimizer.params.torch_adam")
    decoupled = read_flag(params.pop("adam_w_mode", True), "optimizer.params.adam_w_mode")
    cls = torch.optim.AdamW if lower == "adamw" or decoupled else torch.optim.Adam
    if lower == "adam" and decoupled:
        findings.notes.append("optimizer Adam runs as torch.optim.AdamW (decoupled weight decay): DeepSpeed's "
                            "adam_w_mode defaults to true; set it false for torch.optim.Adam")
    if not read_flag(params.pop("bias_correction", True), "optimizer.params.bias_correction"):
        findings.problems.append("optimizer.params.bias_correction=false: torch's Adam always corrects the bias; "
                               "remove the key")
    if not read_flag(params.pop("fp32_optimizer_states", True), "optimizer.params.fp32_optimizer_states"):
        findings.problems.append("optimizer.params.fp32_optimizer_states=false: mixed precision keeps fp32 optimizer "
                               "state here; for bf16 state use Trainer(precision=\"bf16-true\")")
    for key in ("foreach", "set_grad_none"):
        if key in params:
            params.pop(key)
            findings.ignored[f"optimizer.params.{key}"] = "the engine picks torch's fused or foreach step itself"
    if not torch_adam and "weight_decay" not in params:
        params["weight_decay"] = 0.0  # DeepSpeed's FusedAdam and CPUAdam default; torch's AdamW says 0.01
        if cls is torch.optim.AdamW:
            findings.notes.append("AdamW weight_decay=0.0, the default of DeepSpeed's own Adam (torch's is 0.01)")
    return cls
