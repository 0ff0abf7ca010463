"""A DeepSpeed config's ``"optimizer": {"type": "Muon"}``: which parameters Muon steps, in which
groups and with which settings, as DeepSpeed 0.19 decides them; the update is ``DeepSpeedMuon``'s
(see [Note: DeepSpeed's Muon] in zero_strategy/optimizers.py).

[Note: DeepSpeed's Muon configuration]
- ``initialize`` tags every parameter of the model: ``p.use_muon`` is True when the parameter's
  layer has 2 or more dimensions and its name, lowercased, holds neither "embed" nor "lm_head";
  DeepSpeed overwrites a tag set before (here a tag that changes is logged). The shape read is the
  whole parameter's, also for a model built inside ``zero.Init`` (DeepSpeed's bug #8438 read the
  1-D partitions there, and every parameter took the Adam half).
- each param group of ``model_parameters`` (loose parameters make one more group, after the dicts)
  is split into its Muon half and its Adam half, in that order, empty halves dropped and frozen
  parameters left out. A half's settings: the config's (``lr`` and ``weight_decay`` for both;
  ``momentum`` and ``ns_method`` for Muon; ``betas`` and ``eps`` for Adam), ``muon_lr`` /
  ``adam_lr`` over ``lr``, then what the group itself sets of the half's keys (a group's
  ``weight_decay: 0`` reaches both of its halves). Names: "muon-params" / "adam-params", or
  "<the group's name or group<i>>-muon-params" when there are several groups.
- ``adam_w_mode`` (default true: decoupled weight decay) is the Adam half's; ``torch_adam`` only
  chooses which class DeepSpeed steps that half with (torch's AdamW, its FusedAdam or its CPU Adam),
  all with one update. ``gradient_clipping`` (DeepSpeed's default 1.0) clips, at ZeRO stages 1-3,
  the norm over the Muon updates and the Adam gradients, which the optimizer does here; at stage 0
  DeepSpeed clips the gradients before the step, as torch does, which the engine does here
  (``muon_clipping`` in engine_parts.py).
- DeepSpeed ignores keys it does not know in this section; here they are refused, named.
"""

from __future__ import annotations

import difflib
import logging
import types
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from ..optimizers import ADAM_DEFAULTS, MUON_DEFAULTS, NS_METHODS, DeepSpeedMuon, layer_shape
from .factory import OptimizerFactory
from .keys import DeepSpeedConfigError, Findings, read_flag, read_number

__all__ = ["MuonFactory", "muon_factory", "muon_param_groups", "tag_parameters"]

log = logging.getLogger(__name__)

MUON_KEYS = tuple(MUON_DEFAULTS)  # lr, momentum, weight_decay, ns_method
ADAM_KEYS = tuple(ADAM_DEFAULTS)  # lr, betas, eps, weight_decay
CONFIG_KEYS = sorted({*MUON_KEYS, *ADAM_KEYS, "muon_lr", "adam_lr", "adam_w_mode", "torch_adam",
                      "fp32_optimizer_states", "per_head_muon"})
NOT_MUON_NAMES = ("embed", "lm_head")


@dataclass(frozen=True)
class MuonFactory(OptimizerFactory):
    """Builds ``DeepSpeedMuon`` over a model's parameters, grouped as DeepSpeed groups them."""

    def __call__(self, params: Any, module: Optional[nn.Module] = None,
                 gradient_clipping: float = 0.0) -> torch.optim.Optimizer:
        """``params``: ``model_parameters`` (parameters or param groups) of ``module``, whose parameters
        are tagged; ``gradient_clipping``: the config's, clipped as DeepSpeed clips it with Muon."""
        if module is None:
            raise ValueError("the Muon optimizer of a DeepSpeed config needs the model, to tag its parameters "
                             "(use_muon by shape and name): build it with factory(params, module=model).")
        groups = muon_param_groups(module, params)
        return self.optimizer_class(groups, **self.kwargs, gradient_clipping=gradient_clipping)


def muon_factory(findings: Findings, params: dict) -> Optional[MuonFactory]:
    """The section's ``params`` (``max_grad_norm`` and 'auto' values already dealt with) read as DeepSpeed
    reads them for Muon: the config-level settings of each half, and the refusals."""
    unknown = sorted(set(params) - set(CONFIG_KEYS))
    for key in unknown:
        close = difflib.get_close_matches(key, CONFIG_KEYS, n=1)
        findings.problems.append(f"optimizer.params.{key}: DeepSpeed's Muon reads no such key (it would ignore it)"
                                 + (f"; did you mean {close[0]!r}?" if close else f"; its keys are {CONFIG_KEYS}"))
    if read_flag(params.get("per_head_muon", False), "optimizer.params.per_head_muon"):
        findings.problems.append("optimizer.params.per_head_muon=true: orthogonalising each attention head on its "
                                 "own (DeepSpeed finds the heads from a Hugging Face model's config and its "
                                 "projections' names) is not supported; each matrix is orthogonalised whole, "
                                 "DeepSpeed's default: remove the key or set it false")
    if "torch_adam" in params:
        read_flag(params["torch_adam"], "optimizer.params.torch_adam")
        findings.ignored["optimizer.params.torch_adam"] = ("it picks the class DeepSpeed steps Muon's Adam half with "
                                                          "(torch's AdamW, FusedAdam, CPU Adam), whose update is one")
    if not read_flag(params.get("fp32_optimizer_states", True), "optimizer.params.fp32_optimizer_states"):
        findings.problems.append("optimizer.params.fp32_optimizer_states=false: Muon's state is kept in the masters' "
                                 "dtype here; remove the key")
    ns_method = params.get("ns_method", MUON_DEFAULTS["ns_method"])
    if ns_method not in NS_METHODS:
        findings.problems.append(f"optimizer.params.ns_method={ns_method!r}: use one of {list(NS_METHODS)}")
    halves = {}
    for half, keys, lr_key in (("muon", MUON_KEYS, "muon_lr"), ("adam", ADAM_KEYS, "adam_lr")):
        settings = {key: params[key] for key in keys if key in params}
        if lr_key in params:
            settings["lr"] = params[lr_key]
        halves[half] = _checked(settings, half)
    adam_w_mode = read_flag(params.get("adam_w_mode", True), "optimizer.params.adam_w_mode")
    if unknown or findings.problems:
        return None
    return MuonFactory(DeepSpeedMuon, types.MappingProxyType({**halves, "adam_w_mode": adam_w_mode}))


def _checked(settings: dict, half: str) -> dict:
    """A half's numbers as numbers (betas as a pair), named in DeepSpeed's terms when they are not."""
    out = dict(settings)
    for key in ("lr", "momentum", "weight_decay", "eps"):
        if key in out:
            name = {"lr": f"{half}_lr or lr"}.get(key, key)
            out[key] = read_number(out[key], f"optimizer.params.{name}")
    if "betas" in out:
        betas = out["betas"]
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise DeepSpeedConfigError(f"optimizer.params.betas={betas!r} must be two numbers, e.g. [0.9, 0.95].")
        out["betas"] = tuple(read_number(b, "optimizer.params.betas") for b in betas)
    return out


def tag_parameters(module: nn.Module) -> None:
    """``p.use_muon`` on every parameter of ``module``, as DeepSpeed's ``initialize`` sets it (see [Note:
    DeepSpeed's Muon configuration]), from the whole parameter's shape."""
    changed = []
    for name, p in module.named_parameters():
        use_muon = len(layer_shape(p)) >= 2 and not any(word in name.lower() for word in NOT_MUON_NAMES)
        if hasattr(p, "use_muon") and bool(p.use_muon) != use_muon:
            changed.append(f"{name}: {bool(p.use_muon)} -> {use_muon}")
        p.use_muon = use_muon
    if changed:
        log.warning("the Muon config tags parameters as DeepSpeed's initialize does (2 or more dimensions, no 'embed' "
                    "or 'lm_head' in the name), replacing tags set before: %s. To choose yourself, pass "
                    "zero_strategy.DeepSpeedMuon with your own use_muon groups as initialize(optimizer=...).",
                    "; ".join(changed))


def muon_param_groups(module: nn.Module, model_parameters: Iterable[Any]) -> list[dict[str, Any]]:
    """``model_parameters`` (parameters or param groups of ``module``) split into Muon and Adam halves, as
    DeepSpeed splits them (see [Note: DeepSpeed's Muon configuration]); the config's settings are
    ``DeepSpeedMuon``'s ``muon`` / ``adam``, so a half carries only what its group sets."""
    tag_parameters(module)
    groups, loose = [], []
    for item in model_parameters:
        if isinstance(item, dict):
            params = item["params"]
            groups.append({**item, "params": [params] if isinstance(params, torch.Tensor) else list(params)})
        else:
            loose.append(item)
    if loose or not groups:
        groups.append({"params": loose})
    own = {id(p) for p in module.parameters()}
    foreign = [tuple(p.shape) for g in groups for p in g["params"] if id(p) not in own]
    if foreign:
        raise ValueError(f"initialize(model_parameters=...) holds {len(foreign)} tensors that are not parameters of "
                         f"{type(module).__name__} (shapes {foreign[:3]}); the Muon config tags the model's own "
                         "parameters, so pass model.parameters() or param groups of them.")
    out = []
    for index, group in enumerate(groups):
        overrides = {key: value for key, value in group.items() if key != "params"}
        trainable = [p for p in group["params"] if p.requires_grad]
        for use_muon, label, keys in ((True, "muon", MUON_KEYS), (False, "adam", ADAM_KEYS)):
            half = [p for p in trainable if p.use_muon is use_muon]
            if not half:
                continue
            settings = {key: overrides[key] for key in keys if key in overrides}
            if isinstance(settings.get("betas"), list):
                settings["betas"] = tuple(settings["betas"])
            prefix = overrides.get("name") or (f"group{index}" if len(groups) > 1 else None)
            name = f"{prefix}-{label}-params" if prefix else f"{label}-params"
            out.append({"params": half, "use_muon": use_muon, "name": name, **settings})
    return out
