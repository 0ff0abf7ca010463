"""Optimizers this package adds to torch's: ``MuonWithAdamW``, Muon and AdamW as one optimizer.

torch's ``Muon`` takes 2-D parameters only, so its users step the rest (embeddings, norms, biases)
with AdamW: two optimizers, which Lightning steps only under manual optimization. ``MuonWithAdamW`` is
the single optimizer for automatic optimization (``configure_optimizers`` returns it, LR schedulers
included): the param groups with ``use_muon=True`` are stepped by torch's ``Muon``, the others by
torch's ``AdamW``, each with its own update and settings, so the results are those of the two
optimizers side by side. Under ZeRO it is stepped whole (``zero_whole_parameters``: see [Note:
whole-parameter step] in engine/optim/step/whole.py).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch

__all__ = ["MuonWithAdamW"]


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on the param groups with ``use_muon=True`` (2-D parameters), AdamW on the others.

    A group's settings are its optimizer's, under their torch names (``lr``, ``weight_decay``; Muon's
    ``momentum``, ``nesterov``, ``ns_steps``...; AdamW's ``betas``, ``eps``...); what a group leaves out
    comes from ``muon`` / ``adamw`` (the defaults for each kind), so one ``lr`` argument does not set
    both. Example::

        matrices = [p for p in model.blocks.parameters() if p.dim() == 2]
        rest = [p for p in model.parameters() if all(p is not m for m in matrices)]
        MuonWithAdamW([{"params": matrices, "use_muon": True}, {"params": rest, "use_muon": False}],
                      muon={"lr": 0.02}, adamw={"lr": 3e-4, "betas": (0.9, 0.95)})
    """

    zero_whole_parameters = True  # Muon reads each matrix whole

    def __init__(self, params: Iterable[Any], muon: Optional[dict[str, Any]] = None,
                 adamw: Optional[dict[str, Any]] = None) -> None:
        self._muon_defaults = _settings(torch.optim.Muon, muon or {}, "muon")
        self._adamw_defaults = _settings(torch.optim.AdamW, adamw or {}, "adamw")
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            raise ValueError("MuonWithAdamW takes param groups, each with use_muon=True (Muon: 2-D parameters) or "
                             "use_muon=False (AdamW): [{'params': matrices, 'use_muon': True}, {'params': rest, "
                             "'use_muon': False}].")
        super().__init__(groups, {"muon": dict(muon or {}), "adamw": dict(adamw or {})})  # add_param_group each
        # torch's own classes step the groups, over this optimizer's state; their groups and state are set at
        # each step, as load_state_dict replaces this optimizer's
        self._muon, self._adamw = torch.optim.Muon([{"params": []}]), torch.optim.AdamW([{"params": []}])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        use_muon, params = param_group.get("use_muon"), param_group["params"]
        if not isinstance(use_muon, bool):
            raise ValueError(f"param group {len(self.param_groups)} of MuonWithAdamW has use_muon={use_muon!r}; give "
                             "each group use_muon=True (stepped by Muon) or use_muon=False (stepped by AdamW).")
        param_group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
        flat = [p for p in param_group["params"] if use_muon and p.dim() != 2]
        if flat:
            raise ValueError(f"Muon takes 2-D parameters only; a use_muon=True group holds one of shape "
                             f"{tuple(flat[0].shape)}: put it in a use_muon=False group (AdamW).")
        for key, value in (self._muon_defaults if use_muon else self._adamw_defaults).items():
            param_group.setdefault(key, value)
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part, use_muon in ((self._muon, True), (self._adamw, False)):
            part.param_groups = [g for g in self.param_groups if g["use_muon"] is use_muon]
            part.state = self.state
            if part.param_groups:
                part.step()
        return loss


def _settings(cls: type, given: dict[str, Any], name: str) -> dict[str, Any]:
    """A param group's settings for ``cls``: its own defaults (what its ``step`` reads), ``given`` over them,
    checked by ``cls`` itself (a bad value or an unknown key raises there, named)."""
    try:
        return dict(cls([torch.zeros(2, 2, requires_grad=True)], **given).defaults)
    except TypeError as err:
        raise ValueError(f"MuonWithAdamW({name}={given!r}): {err}") from None
