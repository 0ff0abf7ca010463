"""What a ZeroOptimizer checks before it shards an optimizer: its class, its parameters, its config."""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import torch

from ...config import ZeroConfig

ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.Adagrad,
    torch.optim.RMSprop, torch.optim.Adadelta, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD,
    torch.optim.Rprop,
)
"""Verified to update each element from that element's own gradient and state only."""

WHOLE_PARAMETER_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in ("Muon", "Adafactor") if hasattr(torch.optim, name))
"""Read a whole parameter in their update: stepped whole, each parameter on one rank (see [Note:
whole-parameter step] in engine/optim/step/whole.py)."""

_NOT_SHARDABLE: dict[str, str] = {
    "LBFGS": ("keeps a curvature history over all parameters as one vector and re-evaluates the loss through a "
              "closure several times per step, which no sharding of the parameters keeps exact; train it with DDP"),
    "SparseAdam": ("expects sparse gradients (nn.Embedding(sparse=True)), which the reductions of ZeRO do not carry; "
                   "use dense embeddings with Adam or AdamW, or train it with DDP"),
}

_NOT_WITH_WHOLE = ("offload_optimizer", "offload_dir", "offload_overlap")  # the host and disk steps are elementwise


def needs_whole_parameters(cls: type, config: ZeroConfig) -> bool:
    """Whether ``cls``'s update is stepped whole, each parameter on one rank."""
    return (config.whole_parameter_step or issubclass(cls, WHOLE_PARAMETER_OPTIMIZERS)
            or bool(getattr(cls, "zero_whole_parameters", False)))


def check_optimizer_supported(optimizer: torch.optim.Optimizer, config: ZeroConfig) -> None:
    """Raise, naming the optimizer, why and what to use, if ``optimizer``'s update can run neither on a
    flat shard of its parameters nor on whole parameters (see [Note: whole-parameter step])."""
    cls = type(optimizer)
    allowed = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS + WHOLE_PARAMETER_OPTIMIZERS)
    for klass in cls.__mro__:
        if klass.__name__ in _NOT_SHARDABLE:
            raise ValueError(f"{cls.__name__} cannot be trained under ZeRO: it {_NOT_SHARDABLE[klass.__name__]}.")
    if needs_whole_parameters(cls, config):
        on = [name for name in _NOT_WITH_WHOLE if getattr(config, name) not in (False, None)]
        if config.low_precision_step:
            on.append(f"optimizer_state_dtype={config.optimizer_state_dtype!r}, "
                      f"master_weights_dtype={config.master_weights_dtype!r}")
        if on:
            raise ValueError(f"{cls.__name__} is stepped whole, each parameter on one rank, which does not combine with "
                             f"{', '.join(on)} (their steps update flat shards); turn those off for {cls.__name__}.")
        return
    if not issubclass(cls, ELEMENTWISE_OPTIMIZERS) and not config.allow_untested_optimizer:
        raise ValueError(
            f"{cls.__name__} has not been verified to be elementwise, which the sharded step needs (each rank updates "
            f"a flat shard). Known: {allowed}. If its update reads nothing beyond each element's own gradient and "
            "state, pass allow_untested_optimizer=True; if it reads a whole parameter (its rows, columns or matrix), "
            f"pass whole_parameter_step=True, or set zero_whole_parameters = True on {cls.__name__}."
        )


def constructor_kwargs(cls: type, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The defaults that ``cls.__init__`` accepts (AdamW stores a default it does not take)."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


def check_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Each parameter in one param group once, and only floating-point ones trainable."""
    seen: set[int] = set()
    for gi, user_group in enumerate(optimizer.param_groups):
        for p in user_group["params"]:
            if id(p) in seen:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} appears twice in the optimizer's param groups "
                    f"(again in group {gi}); list each parameter once."
                )
            seen.add(id(p))
            if p.requires_grad and not p.dtype.is_floating_point:
                raise ValueError(f"trainable parameters of dtype {p.dtype} in param group {gi}: only floating-point "
                                 "parameters can be trained; set requires_grad=False on them.")


def check_same_config(mine: ZeroConfig, sharders: ZeroConfig) -> None:
    """The optimizer steps the sharder's groups: they must agree on what those hold."""
    fields = ("stage", "bucket_cap_mb", "master_weights", "offload_optimizer", "offload_params",
              "optimizer_state_dtype", "master_weights_dtype", "optimizer_state_block_size")
    differ = [f"{f}={getattr(mine, f)!r} here, {getattr(sharders, f)!r} in the sharder's"
              for f in fields if getattr(mine, f) != getattr(sharders, f)]
    if differ:
        raise ValueError(f"the ZeroOptimizer's config and the sharder's disagree: {'; '.join(differ)}. Build both with "
                         "the same ZeroConfig (shard_module(model, config), ZeroOptimizer(opt, config, sharder=...)).")
