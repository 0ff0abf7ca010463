"""Optimizers this package adds to torch's: ``MuonWithAdamW``, Muon and AdamW as one optimizer, and
``DeepSpeedMuon``, the update DeepSpeed 0.19's ``"optimizer": {"type": "Muon"}`` runs.

torch's ``Muon`` takes 2-D parameters only, so its users step the rest (embeddings, norms, biases)
with AdamW: two optimizers, which Lightning steps only under manual optimization. ``MuonWithAdamW`` is
the single optimizer for automatic optimization (``configure_optimizers`` returns it, LR schedulers
included): the param groups with ``use_muon=True`` are stepped by torch's ``Muon``, the others by
torch's ``AdamW``, each with its own update and settings, so the results are those of the two
optimizers side by side. Under ZeRO it is stepped whole (``zero_whole_parameters``: see [Note:
whole-parameter step] in engine/optim/step/whole.py).

``DeepSpeedMuon`` is what a DeepSpeed config's Muon section builds (see [Note: DeepSpeed's Muon]
below); it differs from torch's Muon in its Newton-Schulz iteration (DeepSpeed's "gram" variant by
default, in fp16 where the device computes it), its scale (sqrt(max(1, rows / cols)), where torch's
scales by 0.2 * sqrt(max(rows, cols))) and its Adam half's defaults.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional

import torch

__all__ = ["DeepSpeedMuon", "MuonWithAdamW"]


def _tagged_group(optimizer: torch.optim.Optimizer, param_group: dict[str, Any], other: str, rule: str,
                  shape_of: Callable[[torch.Tensor], tuple], takes: Callable[[tuple], bool]) -> bool:
    """A param group of an optimizer that steps ``use_muon=True`` groups by Muon and the others by
    ``other``: checks its flag and, for Muon, each parameter's shape (``takes``, else ``rule`` says
    why not); lists its params; returns the flag."""
    use_muon, params = param_group.get("use_muon"), param_group["params"]
    if not isinstance(use_muon, bool):
        raise ValueError(f"param group {len(optimizer.param_groups)} of {type(optimizer).__name__} has use_muon="
                         f"{use_muon!r}; give each group use_muon=True (Muon) or use_muon=False ({other}).")
    param_group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
    refused = [shape_of(p) for p in param_group["params"] if use_muon and not takes(shape_of(p))]
    if refused:
        raise ValueError(f"{rule}; a use_muon=True group holds a parameter of shape {refused[0]}: put it in a "
                         f"use_muon=False group ({other}).")
    return use_muon


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
        use_muon = _tagged_group(self, param_group, "AdamW", "Muon takes 2-D parameters only",
                                 lambda p: tuple(p.shape), lambda shape: len(shape) == 2)
        for key, value in (self._muon_defaults if use_muon else self._adamw_defaults).items():
            param_group.setdefault(key, value)
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = _closure_loss(closure)
        for part, use_muon in ((self._muon, True), (self._adamw, False)):
            part.param_groups = [g for g in self.param_groups if g["use_muon"] is use_muon]
            part.state = self.state
            if part.param_groups:
                part.step()
        return loss


def _closure_loss(closure: Optional[Callable[[], Any]]) -> Any:
    """What torch's optimizers do with a closure before their step: call it with grad enabled, its loss
    returned (None without one)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _settings(cls: type, given: dict[str, Any], name: str) -> dict[str, Any]:
    """A param group's settings for ``cls``: its own defaults (what its ``step`` reads), ``given`` over them,
    checked by ``cls`` itself (a bad value or an unknown key raises there, named)."""
    try:
        return dict(cls([torch.zeros(2, 2, requires_grad=True)], **given).defaults)
    except TypeError as err:
        raise ValueError(f"MuonWithAdamW({name}={given!r}): {err}") from None


# [Note: DeepSpeed's Muon]
# DeepSpeed 0.19 (runtime/zero/muon/) steps a parameter with use_muon=True as follows, with nesterov
# momentum and 5 Newton-Schulz steps always (neither is a setting):
#   momentum <- momentum + (1 - beta) (grad - momentum)              (lerp)
#   direction <- grad + beta (momentum - grad)                       (lerp: nesterov)
#   4-D (convolutions): direction viewed as (out, rest)
#   update <- orthogonalised(direction) * sqrt(rows / cols) if rows > cols else 1, rows and cols the
#             parameter's last two sizes; 3-D parameters (experts) are orthogonalised per matrix
#   p <- p (1 - lr weight_decay) - lr update
# Orthogonalisation is the quintic iteration X <- aX + (bA + cA^2) X, A = X X^T, (a, b, c) = (3.4445,
# -4.7750, 2.0315), on the matrix (transposed to be wide) divided by its Frobenius norm + 1e-7:
# - "standard": cast to bf16 first (fp32 where the device has no bf16), then normalised and iterated;
# - "gram" (the default): normalised in the input's dtype (fp32 for fp16 input), then cast to fp16
#   where the device computes it (CUDA of compute capability 7 or more; a CPU whose oneDNN has fp16)
#   and to fp32 elsewhere. A square matrix iterates as "standard" in that dtype; a wide one (n x m,
#   n < m) iterates on its n x n Gram matrix R = X X^T instead: each step's polynomial P = aI + bR + cR^2
#   multiplies an accumulated Q (Q <- P Q) and R becomes P R P, restarting after 2 steps (X <- Q X,
#   R <- X X^T, Q <- I) to keep fp16 stable; the result is Q X.
# The use_muon=False parameters take Adam, decoupled weight decay unless adam_w_mode is false (then
# weight_decay adds to the gradient), with its own defaults: lr 3e-4, betas (0.9, 0.95), eps 1e-10,
# weight_decay 0. A parameter without a gradient is stepped with a zero one (its momentum decays and
# it is decayed), as DeepSpeed does. DeepSpeed compiles its update with torch.compile; this one runs
# eagerly, which may round differently in the last bits.

_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_NS_STEPS = 5
_GRAM_RESTART = 2  # the iteration at which the Gram form starts again from the product so far
NS_METHODS = ("gram", "standard")


def ns_compute_dtype(method: str, device: torch.device) -> torch.dtype:
    """The dtype DeepSpeed's Newton-Schulz ``method`` iterates in on ``device`` (see [Note: DeepSpeed's Muon])."""
    if device.type == "cuda":
        half = torch.cuda.get_device_capability(device)[0] >= 7
        brain = torch.cuda.is_bf16_supported()
    else:
        half, brain = device.type == "cpu" and _cpu_computes_fp16(), True
    if method == "gram":
        return torch.float16 if half else torch.float32
    return torch.bfloat16 if brain else torch.float32


def _cpu_computes_fp16() -> bool:
    try:  # DeepSpeed's CPU accelerator asks oneDNN, and takes an error for no
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:  # noqa: BLE001 - any failure of the query means no
        return False


def _quintic(x: torch.Tensor, steps: int) -> torch.Tensor:
    a, b, c = _NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def orthogonalise(matrix: torch.Tensor, method: str = "gram", steps: int = _NS_STEPS) -> torch.Tensor:
    """DeepSpeed's Newton-Schulz orthogonalisation of ``matrix`` (batched over leading dimensions), in
    the compute dtype of ``method`` on its device (see [Note: DeepSpeed's Muon])."""
    dtype = ns_compute_dtype(method, matrix.device)
    tall = matrix.size(-2) > matrix.size(-1)
    if method == "standard":
        x = matrix.to(dtype)
        x = x.mT if tall else x
        x = _quintic(x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7), steps)
        return x.mT if tall else x
    x = matrix.to(torch.float32 if matrix.dtype == torch.float16 else matrix.dtype)
    x = x.mT if tall else x  # (n, m), n <= m
    x = (x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)).to(dtype)
    if x.size(-1) <= x.size(-2):  # square: no smaller Gram matrix to iterate on
        x = _quintic(x, steps)
        return x.mT if tall else x
    a, b, c = _NS_COEFFICIENTS
    gram, product = x @ x.mT, None  # R (n, n), and Q, the polynomials applied so far
    for i in range(steps):
        if i == _GRAM_RESTART:
            x, product = product @ x, None
            gram = x @ x.mT
        poly = b * gram + c * gram @ gram  # P - aI
        if product is None:
            product = poly.clone()
            product.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            product = a * product + poly @ product
        if i < steps - 1 and i + 1 != _GRAM_RESTART:  # R <- P R P, as (P (P R)), P commuting with R
            half = a * gram + poly @ gram
            gram = a * half + poly @ half
    return x.mT @ product.mT if tall else product @ x


def deepspeed_muon_update(grad: torch.Tensor, momentum: torch.Tensor, beta: float, ns_method: str) -> torch.Tensor:
    """Momentum (updated in place) and the orthogonalised nesterov direction, scaled, in ``grad``'s dtype."""
    momentum.lerp_(grad, 1 - beta)
    direction = grad.lerp(momentum, beta)
    rows, cols = grad.size(-2), grad.size(-1)  # the parameter's own last two sizes, as DeepSpeed reads them
    if direction.dim() == 4:
        direction = direction.view(len(direction), -1)
    update = orthogonalise(direction, ns_method)
    update *= math.sqrt(rows / cols) if rows > cols else 1.0
    return update.to(grad.dtype).view(grad.shape)


MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram"}
ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}


class DeepSpeedMuon(torch.optim.Optimizer):
    """DeepSpeed 0.19's Muon with its auxiliary Adam, as one optimizer: what a DeepSpeed config's
    ``"optimizer": {"type": "Muon"}`` builds here (see [Note: DeepSpeed's Muon] for the update).

    Param groups carry ``use_muon``: True (Muon: parameters of 2 or more dimensions; settings ``lr``,
    ``momentum``, ``weight_decay``, ``ns_method`` "gram" or "standard") or False (Adam: ``lr``,
    ``betas``, ``eps``, ``weight_decay``). What a group leaves out comes from ``muon`` / ``adam``,
    over DeepSpeed's defaults (Muon: lr 0.02, momentum 0.95, weight_decay 0, ns_method "gram"; Adam:
    lr 3e-4, betas (0.9, 0.95), eps 1e-10, weight_decay 0). ``adam_w_mode`` False gives the Adam
    groups L2 weight decay (added to the gradient) instead of decoupled.

    ``gradient_clipping`` (0: none) clips as DeepSpeed's ZeRO stages 1-3 do with Muon: the norm is
    taken over the Muon parameters' updates (after orthogonalisation; their momentum has taken the
    unclipped gradient) and the Adam parameters' gradients, and both are scaled by
    ``gradient_clipping / (norm + 1e-6)`` when that is below 1. Clip nothing before ``step`` then: the
    gradients' own norm is not what is clipped. Stepped whole under ZeRO (``zero_whole_parameters``),
    the norm summed over the ranks (see [Note: a norm over all ranks' updates] in
    engine/optim/step/whole.py)::

        DeepSpeedMuon([{"params": matrices, "use_muon": True}, {"params": rest, "use_muon": False}],
                      muon={"lr": 0.02}, adam={"lr": 3e-4})
    """

    zero_whole_parameters = True  # Newton-Schulz reads each matrix whole

    def __init__(self, params: Iterable[Any], muon: Optional[dict[str, Any]] = None,
                 adam: Optional[dict[str, Any]] = None, adam_w_mode: bool = True,
                 gradient_clipping: float = 0.0) -> None:
        for name, given, known in (("muon", muon, MUON_DEFAULTS), ("adam", adam, ADAM_DEFAULTS)):
            unknown = sorted(set(given or {}) - set(known))
            if unknown:
                raise ValueError(f"DeepSpeedMuon({name}=...) has {unknown}; its settings are {sorted(known)}.")
        if not isinstance(adam_w_mode, bool):
            raise ValueError(f"DeepSpeedMuon(adam_w_mode={adam_w_mode!r}) must be True (decoupled weight decay) or "
                             "False (L2: added to the gradient).")
        if isinstance(gradient_clipping, bool) or not isinstance(gradient_clipping, (int, float)) \
                or not gradient_clipping >= 0:
            raise ValueError(f"DeepSpeedMuon(gradient_clipping={gradient_clipping!r}) must be a number >= 0 (0: no "
                             "clipping).")
        self._kinds = {True: {**MUON_DEFAULTS, **(muon or {})}, False: {**ADAM_DEFAULTS, **(adam or {})}}
        groups = list(params)
        if not groups or not isinstance(groups[0], dict):
            raise ValueError("DeepSpeedMuon takes param groups, each with use_muon=True (Muon: matrices) or "
                             "use_muon=False (Adam): [{'params': matrices, 'use_muon': True}, {'params': rest, "
                             "'use_muon': False}].")
        self.gradient_clipping = float(gradient_clipping)
        self._pending: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]] = []
        super().__init__(groups, {"muon": dict(muon or {}), "adam": dict(adam or {}), "adam_w_mode": adam_w_mode,
                                  "gradient_clipping": self.gradient_clipping})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        use_muon = _tagged_group(self, param_group, "Adam", "Muon orthogonalises matrices", layer_shape,
                                 lambda shape: len(shape) >= 2)
        for key, value in self._kinds[use_muon].items():
            param_group.setdefault(key, value)
        if use_muon and param_group["ns_method"] not in NS_METHODS:
            raise ValueError(f"DeepSpeedMuon: ns_method={param_group['ns_method']!r}; use one of {list(NS_METHODS)}.")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = _closure_loss(closure)
        self.finish_step(self.prepare_step())
        return loss

    @torch.no_grad()
    def prepare_step(self) -> Optional[torch.Tensor]:
        """The first half of ``step``: the Muon updates (momentum advanced), applied at once without
        clipping; with clipping, kept for ``finish_step`` and the squared norm of these updates and of
        the Adam gradients returned (float64), for the caller to sum over the ranks that hold the rest."""
        clipping = self.gradient_clipping > 0
        total = None
        for group in self.param_groups:
            for p in group["params"]:
                grad = p.grad if p.grad is not None else torch.zeros_like(p)  # DeepSpeed steps it with zeros
                if group["use_muon"]:
                    state = self.state[p]
                    if not state:
                        state["momentum_buffer"] = torch.zeros_like(p)
                    grad = deepspeed_muon_update(grad, state["momentum_buffer"], group["momentum"],
                                                 group["ns_method"])
                if not clipping:
                    self._apply(p, grad, group)
                    continue
                self._pending.append((p, grad, group))
                squares = grad.double().square().sum()
                total = squares if total is None else total + squares
        if clipping and total is None:  # nothing here: the other ranks' norm still counts
            device = next((p.device for g in self.param_groups for p in g["params"]), torch.device("cpu"))
            total = torch.zeros((), dtype=torch.float64, device=device)
        return total

    @torch.no_grad()
    def finish_step(self, norm_squared: Optional[torch.Tensor]) -> None:
        """The second half of ``step``: the kept updates and gradients, scaled when the norm (the root of
        ``norm_squared``, over every rank's) exceeds ``gradient_clipping``, applied."""
        pending, self._pending = self._pending, []
        if norm_squared is None:
            return
        scale = self.gradient_clipping / (math.sqrt(float(norm_squared)) + 1e-6)
        for p, grad, group in pending:
            if scale < 1:
                grad = grad * scale
            self._apply(p, grad, group)

    def _apply(self, p: torch.Tensor, update: torch.Tensor, group: dict[str, Any]) -> None:
        """A Muon update, or an Adam step from a gradient."""
        lr, decay = group["lr"], group["weight_decay"]
        if group["use_muon"]:
            p.mul_(1 - lr * decay)
            p.add_(update, alpha=-lr)
            return
        (beta1, beta2), state = group["betas"], self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
        state["step"] += 1
        t = state["step"].item()
        if group["adam_w_mode"]:
            p.mul_(1 - lr * decay)
        else:
            update = update.add(p, alpha=decay)
        state["exp_avg"].lerp_(update, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(update, update, value=1 - beta2)
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** t)).add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1 ** t))


def layer_shape(p: torch.Tensor) -> tuple[int, ...]:
    """A parameter's shape as its layer has it, also while ZeRO stage 3 holds it sharded (its own shape
    is then its shard's, or (0,)): DeepSpeed's bug #8438 was reading the shard's."""
    from .engine.params.flat_parameters import owner_of

    owner = owner_of(p) if isinstance(p, torch.nn.Parameter) else None
    if owner is not None:
        for group in owner.groups:
            for param, shape in zip(group.params, group.shapes):
                if param is p:
                    return tuple(shape)
    return tuple(p.shape)
