"""PyTorch-style backward on an engine's outputs: ``loss.backward()`` and ``out.backward(grad)`` do
what ``engine.backward(loss)`` does (DeepSpeed 0.18's "PyTorch-style backward").

[Note: one division per path]
``engine.backward(loss)`` divides the loss by ``gradient_accumulation_steps`` (and, for fp16,
multiplies it by the loss scale) before autograd runs. A direct ``loss.backward()`` must give the
same gradients, so each tensor the engine's forward returns passes through an identity autograd
node (``_EngineOutput``) whose backward divides the incoming gradient by the accumulation steps,
unless ``engine.backward`` is running (which divided the loss already). Every path from what the
user calls backward on down to the parameters crosses exactly one such node, whatever the user
computes from the outputs, so the division happens once, and gradients are linear in it. The node
hands out a copy of each output (one copy of the logits per forward): an alias would be a view,
which autograd forbids editing in place (``loss /= n`` in a script). (Hooks on the output tensors
would not do: a model that returns its loss and the logits the loss was computed
from would see the logits' hook fire on the loss's path too, dividing twice.)

fp16 needs the loss scale in the backward: a direct backward is refused in that node (before any
parameter gets a gradient) unless ``engine.scale(loss)`` made the loss it starts from; the flag
``scale`` sets is cleared when that backward ends. The outputs are found in tensors, tuples
(named ones too), lists, dicts (Hugging Face's ModelOutput is one) and dataclasses; a tensor that
needs gradients inside any other object cannot be reached, and a warning says that a direct
backward from it would not be divided (``engine.backward(loss)`` is right either way).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import Tensor


class ZeroEngine(Protocol):
    """What the routing reads of a ``ZeroEngine`` (engine.py, which calls this module: a Protocol
    instead of an import keeps the two modules out of an import circle)."""

    precision: Any  # its ``scaler`` is None unless fp16
    _engine_backward_depth: int
    _scaled_for_backward: bool
    _warned_unreachable: bool

    def gradient_accumulation_steps(self) -> int: ...

    def _backward_ended(self) -> None: ...

UNSCALED_FP16 = ("loss.backward() on the output of an fp16 engine (fp16, or torch_autocast to float16) without the loss scale: the gradients would underflow "
                 "and the overflow check would be wrong. Use engine.backward(loss), or engine.scale(loss).backward().")


class _EngineOutput(torch.autograd.Function):
    """Identity forward (a copy); backward divides by the accumulation steps outside ``engine.backward``."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, engine: "ZeroEngine") -> Tensor:  # type: ignore[override]
        ctx.engine = engine
        return tensor.clone()  # not a view: scripts may edit an output in place (loss /= n), which a view refuses

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        engine = ctx.engine
        if engine._engine_backward_depth:
            return grad, None
        if engine.precision.scaler is not None and not engine._scaled_for_backward:
            raise RuntimeError(UNSCALED_FP16)
        torch.autograd.Variable._execution_engine.queue_callback(engine._backward_ended)
        steps = engine.gradient_accumulation_steps()
        return (grad / steps if steps > 1 else grad), None


def route_outputs(outputs: Any, engine: "ZeroEngine") -> Any:
    """``outputs`` with every tensor that needs gradients passed through ``_EngineOutput`` (see
    [Note: one division per path]); the same structure otherwise."""
    if not torch.is_grad_enabled():
        return outputs
    seen: dict[int, Tensor] = {}  # a tensor returned twice gets one node, so a sum of both divides once
    unreachable: list[str] = []
    routed = _route(outputs, engine, seen, unreachable)
    if unreachable and not engine._warned_unreachable:
        engine._warned_unreachable = True
        warnings.warn(f"the model returned tensors that need gradients inside {', '.join(sorted(set(unreachable)))}, "
                      "which the engine cannot look into: a direct .backward() from them would not be divided by "
                      "gradient_accumulation_steps (nor refused without the fp16 loss scale). Use "
                      "engine.backward(loss) for those, or return tensors, tuples, lists, dicts or dataclasses.",
                      stacklevel=3)
    return routed


def _route(value: Any, engine: "ZeroEngine", seen: dict[int, Tensor], unreachable: list[str]) -> Any:
    if isinstance(value, Tensor):
        if not value.requires_grad:
            return value
        if id(value) not in seen:
            seen[id(value)] = _EngineOutput.apply(value, engine)
        return seen[id(value)]
    if isinstance(value, tuple):
        items = [_route(v, engine, seen, unreachable) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return [_route(v, engine, seen, unreachable) for v in value]
    if isinstance(value, Mapping):
        if hasattr(value, "to_tuple"):  # Hugging Face's ModelOutput: set in place, keeps its class and fields
            for key in list(value.keys()):
                value[key] = _route(value[key], engine, seen, unreachable)
            return value
        routed = {k: _route(v, engine, seen, unreachable) for k, v in value.items()}
        try:
            return type(value)(routed)
        except TypeError:  # a mapping class that cannot be built from a dict: a plain one
            return routed
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _route(getattr(value, f.name), engine, seen, unreachable)
                   for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)
    if value is not None and not isinstance(value, (int, float, str, bool, bytes)):
        if any(isinstance(v, Tensor) and v.requires_grad for v in vars(value).values()) if hasattr(value, "__dict__") \
                else False:
            unreachable.append(type(value).__name__)
    return value
