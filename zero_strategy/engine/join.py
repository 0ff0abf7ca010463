"""Uneven inputs: a rank that runs out of batches keeps answering the others' collectives.

[Note: joining]
``Join`` is this engine's equivalent of torch's ``torch.distributed.algorithms.Join`` (which DDP
and ZeroRedundancyOptimizer take part in), written for it because a ZeRO rank must shadow more
than DDP's gradient all-reduce: stage 3's gathers in forward and backward, the gradient
reductions, the order guard, clipping's norm, the loss scaler's overflow check and the step's
all-gathers, in the order the others issue them. Inside the context a rank still working
announces each of its calls that issue collectives before issuing them, in one small all-reduce
(MAX) of a header (working, which call, how many numbers follow) and, when there are any, one of
the numbers (the call's arguments; for a ``step``, the param groups' hyperparameters, which an LR
scheduler on the working ranks has changed). The calls announced are a forward of the module
(its root forward, not recomputations), and the optimizers' ``reduce_gradients``,
``clip_grad_norm_``, ``clip_grad_value_``, ``step`` and ``zero_grad`` (and ``initialize``'s
engine's ``step`` and ``zero_grad``), each when called from outside the others (a ``step`` that
reduces and clips itself is one call).

A rank whose loop has ended waits at the context's exit in the same all-reduce, answering "joined",
and does what each announcement says, on its own state:
- a forward: its last batch again (the inputs of its last forward under the context), and, when
  grad is enabled, a backward from the output's first tensor that requires grad (the loss, or the
  logits) with a gradient of zeros. So it contributes zero gradients, as DDP's joined rank does,
  and the mean over ranks divides by the whole world size, as DDP's does by default; the units it
  gathers, and the order guard's tags, are those of a rank in step. Its buffers are put back after
  the replay (the repeated batch must not move BatchNorm's statistics: a joined DDP rank runs no
  forward). With ``broadcast_buffers`` (see [Note: buffers kept in step] in
  engine/params/buffer_sync.py) a forward's announcement also says whether the working ranks
  broadcast their buffers before it, from which rank (the highest working one, as DDP's Join
  chooses: rank 0 may have joined with stale ones), and whether the next forward will: the joined
  rank takes the broadcast with them, and keeps its flag as theirs. When all have joined, every rank
  takes the buffers of the last to join (the highest of them), as DDP's Join ends;
- a call of an optimizer: the same call with the same arguments, after setting the param groups'
  hyperparameters to the working ranks' for a ``step``: its shard of every parameter steps with the
  same gradient and learning rate as on the others, so every rank ends with the same weights.
When the all-reduce says no rank is working, every rank leaves the context together.

What a loop inside the context must do: one backward per forward (as DDP's Join assumes), no
``step(closure)``, and collectives of its own (logging's all-reduces) are its own to keep in step.
Gradients a rank accumulated before it joined are kept until the step the others take next, as in
DDP. An LR scheduler on a joined rank does not step (its optimizer takes the working ranks' values).
The announcements cost two all-reduces of a few numbers per call, only inside the context.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from .comm.collectives import Collectives
from .diagnose import rank_board
from .optim.optimizer import ZeroOptimizer
from .params.buffer_sync import broadcast_of

__all__ = ["Join"]

OPTIMIZER_CALLS = ("reduce_gradients", "clip_grad_norm_", "clip_grad_value_", "step", "zero_grad")
ENGINE_CALLS = ("step", "zero_grad")  # initialize's engine: its step reduces, clips and steps the optimizer
FORWARD = 0  # event 0; the calls are 1, 2, ...
_NONE, _BOOL, _INT, _FLOAT = range(4)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _steppers(optimizer: Any) -> list[tuple[Any, tuple[str, ...]]]:
    """The objects whose calls are announced for one optimizer the user passed: a ZeroOptimizer, Fabric's
    wrapper of one (whose own methods run the ZeroOptimizer's code on itself), or initialize's engine."""
    if isinstance(optimizer, ZeroOptimizer) and type(optimizer) is not ZeroOptimizer and hasattr(optimizer, "_optimizer"):
        return [(optimizer, OPTIMIZER_CALLS), (optimizer._optimizer, OPTIMIZER_CALLS)]  # Fabric's wrapper
    if isinstance(optimizer, ZeroOptimizer):
        return [(optimizer, OPTIMIZER_CALLS)]
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(optimizer, nn.Module) and isinstance(inner, ZeroOptimizer):  # initialize's ZeroEngine
        return [(optimizer, ENGINE_CALLS), (inner, OPTIMIZER_CALLS)]
    raise TypeError(f"Join takes the optimizers this package set up (ZeroOptimizer, Fabric's optimizer from "
                    f"fabric.setup, initialize's engine); got {type(optimizer).__name__}. Pass those.")


def _zero_optimizer(obj: Any) -> ZeroOptimizer:
    return obj.optimizer if isinstance(obj, nn.Module) else (getattr(obj, "_optimizer", None) or obj)


def _encode(value: Any, what: str) -> list[float]:
    if value is None:
        return [_NONE, 0.0]
    if isinstance(value, bool):
        return [_BOOL, float(value)]
    if isinstance(value, int):
        return [_INT, float(value)]
    if isinstance(value, float):
        return [_FLOAT, value]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return [_FLOAT, float(value)]
    raise TypeError(f"Join: {what}={value!r} cannot be announced to the ranks that have joined (numbers and None "
                    "only); call it without that argument inside the Join context.")


def _decode(kind: float, value: float) -> Any:
    return (None, bool(value), int(value), value)[int(kind)]


def _hyperparameters(groups: list[dict]) -> list[tuple[int, str, Any]]:
    """(group index, key, value) of every number or tuple of numbers in ``groups`` but the parameters."""
    out = []
    for i, group in enumerate(groups):
        for key in sorted(k for k in group if k != "params"):
            value = group[key]
            numbers = value if isinstance(value, (tuple, list)) else (value,)
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers) and numbers:
                out.append((i, key, value))
    return out


def _flat_hyperparameters(groups: list[dict]) -> list[float]:
    return [float(v) for _, _, value in _hyperparameters(groups)
            for v in (value if isinstance(value, (tuple, list)) else (value,))]


def _set_hyperparameters(groups: list[dict], numbers: list[float]) -> None:
    it = iter(numbers)
    for i, key, value in _hyperparameters(groups):
        if isinstance(value, (tuple, list)):
            groups[i][key] = type(value)(type(v)(next(it)) for v in value)
        else:
            groups[i][key] = type(value)(next(it))


class Join:
    """Ranks with different numbers of batches train together: see [Note: joining]::

        with zero_strategy.Join(model, optimizer):
            for x, y in loader:                     # rank 0 has 5 batches, rank 1 has 3
                loss = F.mse_loss(model(x), y)
                loss.backward()                     # fabric.backward(loss), engine.backward(loss)
                optimizer.step(); optimizer.zero_grad()

    ``module``: the model the optimizers step (Fabric's ``fabric.setup`` result, or ``initialize``'s
    engine, also do). ``optimizers``: one or a sequence of this package's optimizers (a ZeroOptimizer,
    Fabric's, or ``initialize``'s engine; ``Join(engine)`` alone takes the engine for both).
    ``enable=False`` makes the context do nothing.
    """

    def __init__(self, module: nn.Module, optimizers: Any = None, enable: bool = True) -> None:
        self.enable = enable
        if optimizers is None:
            if getattr(module, "engine_model", None) is None:
                raise TypeError(f"Join({type(module).__name__}) needs the optimizers too: Join(model, optimizer); only "
                                "initialize's engine stands for both (Join(engine)).")
            optimizers = module
        if isinstance(optimizers, (ZeroOptimizer, nn.Module)) or not isinstance(optimizers, Sequence):
            optimizers = [optimizers]
        self.module = self._module_of(module)
        self.steppers = [s for opt in optimizers for s in _steppers(opt)]
        self.calls: list[tuple[Any, str]] = [(obj, name) for obj, names in self.steppers for name in names]
        zero = _zero_optimizer(self.steppers[0][0])
        if enable and any(getattr(_zero_optimizer(obj).reducer, "local", None) is not None for obj, _ in self.steppers):
            raise ValueError("Join with local_accumulation=True: a joined rank replays the others' backward passes "
                             "but cannot know which of them deferred their reduction (see [Note: local accumulation] "
                             "in engine/grads/accumulation.py), so the ranks' reduce-scatters would "
                             "not pair up. Use local_accumulation=False inside Join, or give every rank the same "
                             "number of batches.")
        if enable and any(_zero_optimizer(obj).sharder.hybrid is not None for obj, _ in self.steppers):
            raise ValueError(f"Join with shard_group_size={zero.config.shard_group_size!r}: a joined rank replays "
                             "the others' collectives over one process group, and hybrid sharding runs them over "
                             "two (the shard group and the replicas), which Join does not replay. Give every rank "
                             "the same number of batches (drop uneven inputs), or shard over all ranks "
                             "(shard_group_size=None) inside Join.")
        self.comm: Collectives = zero.comm
        self.device = (torch.device("cuda", torch.cuda.current_device()) if self.comm.backend == "nccl"
                       else torch.device("cpu"))
        self.joined = False
        self._depth = 0  # wrapped calls in progress: only the outermost is announced
        self._last: Optional[tuple[tuple, dict]] = None  # this rank's last forward's inputs
        self._saved: list[tuple[Any, str, bool, Any]] = []
        self._handle = None

    @staticmethod
    def _module_of(module: nn.Module) -> nn.Module:
        inner = getattr(module, "_forward_module", None)  # Fabric's wrapper
        if isinstance(inner, nn.Module):
            return inner
        engine_module = getattr(module, "module", None)  # initialize's engine
        if getattr(module, "engine_model", None) is not None and isinstance(engine_module, nn.Module):
            return engine_module
        return module

    # ---- the context -----------------------------------------------------------------------

    def __enter__(self) -> "Join":
        if not self.enable or self.comm.world_size == 1:
            return self
        self._handle = self.module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
        for index, (obj, name) in enumerate(self.calls):
            had = name in vars(obj)
            self._saved.append((obj, name, had, vars(obj).get(name)))
            setattr(obj, name, self._announcing(index, getattr(obj, name)))
        return self

    def __exit__(self, kind, value, tb) -> None:
        if self._handle is None:
            return
        try:
            if kind is None:
                self._shadow()
        finally:
            self._handle.remove()
            self._handle = None
            sync = broadcast_of(self.module)
            if sync is not None:
                sync.source = 0  # the highest working rank was Join's choice only
            for obj, name, had, previous in reversed(self._saved):
                if had:
                    setattr(obj, name, previous)
                else:
                    delattr(obj, name)
            self._saved.clear()

    # ---- a working rank announces -----------------------------------------------------------

    def _announce(self, event: int, numbers: list[float]) -> list[float]:
        """Tell the joined ranks the next call; returns ``numbers`` reduced (MAX) over the working ranks."""
        header = torch.tensor([1.0, float(event), float(len(numbers))], dtype=torch.float64, device=self.device)
        self.comm.all_reduce(header, op=dist.ReduceOp.MAX, what=lambda: "all-reduce of Join's next call")
        if not numbers:
            return []
        extra = torch.tensor(numbers, dtype=torch.float64, device=self.device)
        self.comm.all_reduce(extra, op=dist.ReduceOp.MAX, what=lambda: "all-reduce of Join's call arguments")
        return extra.tolist()

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.joined or _in_backward() or self._depth:
            return
        self._last = (args, kwargs)
        sync = broadcast_of(self.module)  # the broadcast of buffers before this forward: see [Note: joining]
        broadcasts = sync is not None and sync.due
        got = self._announce(FORWARD, [float(torch.is_grad_enabled()), float(self.comm.rank) if broadcasts else -1.0,
                                       float(sync is not None and sync.due_after)])
        if broadcasts:
            sync.source = int(got[1])  # the highest working rank

    def _announcing(self, index: int, method: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(method)
        obj, name = self.calls[index]

        @functools.wraps(method)
        def announced(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0 and not self.joined:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                numbers = [x for key, v in bound.arguments.items() for x in _encode(v, f"{name}({key})")]
                if name == "step":
                    numbers += _flat_hyperparameters(_zero_optimizer(obj).param_groups)
                self._announce(index + 1, numbers)
            self._depth += 1
            try:
                return method(*args, **kwargs)
            finally:
                self._depth -= 1

        return announced

    # ---- a joined rank shadows --------------------------------------------------------------

    def _shadow(self) -> None:
        self.joined = True
        board = rank_board.board()
        board.note("joined (Join): its batches ran out; it answers the others' collectives")
        last_joiner = True  # no rank worked on after this one
        try:
            while True:
                header = torch.tensor([0.0, -1.0, 0.0], dtype=torch.float64, device=self.device)
                self.comm.all_reduce(header, op=dist.ReduceOp.MAX, what=lambda: "all-reduce of Join's next call")
                working, event, count = header.tolist()
                if working == 0:
                    self._last_joiners_buffers(last_joiner)
                    return
                last_joiner = False
                numbers = []
                if count:
                    extra = torch.full((int(count),), -math.inf, dtype=torch.float64, device=self.device)
                    self.comm.all_reduce(extra, op=dist.ReduceOp.MAX,
                                         what=lambda: "all-reduce of Join's call arguments")
                    numbers = extra.tolist()
                if int(event) == FORWARD:
                    self._replay_forward(bool(numbers[0]), int(numbers[1]), bool(numbers[2]))
                else:
                    self._replay_call(int(event) - 1, numbers)
        finally:
            self.joined = False
            board.note("in step")

    def _last_joiners_buffers(self, last_joiner: bool) -> None:
        """With ``broadcast_buffers``: every rank leaves with the buffers of the last rank to join (the
        highest of them), as DDP's Join leaves it (see [Note: joining])."""
        sync = broadcast_of(self.module)
        if sync is None:
            return
        source = torch.tensor([float(self.comm.rank) if last_joiner else -1.0], dtype=torch.float64,
                              device=self.device)
        self.comm.all_reduce(source, op=dist.ReduceOp.MAX, what=lambda: "all-reduce of Join's last joiner")
        sync.broadcast(int(source.item()))

    def _replay_forward(self, grad: bool, source: int, due_after: bool) -> None:
        """The working ranks' forward, on this rank's last batch: their buffer broadcast (from ``source``;
        none when negative), this rank's buffers kept, and zero gradients (see [Note: joining])."""
        if self._last is None:
            raise RuntimeError(f"Join: rank {self.comm.rank} ran out of batches before its first forward inside the "
                               "context, so it has no batch to repeat for the others' forwards; give every rank at "
                               "least one batch (or enter Join before the loop on every rank).")
        args, kwargs = self._last
        sync = broadcast_of(self.module)
        if sync is not None:
            if source >= 0:
                sync.broadcast(source)
            sync.due, sync.paused = due_after, True  # its hooks stay out of the replay
        buffers = list(self.module.buffers())
        kept = [b.detach().clone() for b in buffers]
        try:
            with torch.set_grad_enabled(grad):
                output = self.module(*args, **kwargs)
                if grad:
                    first = next((t for t in tree_flatten(output)[0]
                                  if isinstance(t, torch.Tensor) and t.requires_grad), None)
                    if first is not None:  # a gradient of zeros: this rank contributes nothing (see [Note: joining])
                        torch.autograd.backward(first, torch.zeros_like(first))
        finally:
            if sync is not None:
                sync.paused = False
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
                for b, value in zip(buffers, kept):
                    b.copy_(value)

    def _replay_call(self, index: int, numbers: list[float]) -> None:
        obj, name = self.calls[index]
        method = getattr(obj, name)
        parameters = list(inspect.signature(method).parameters)
        values = [_decode(numbers[2 * i], numbers[2 * i + 1]) for i in range(len(parameters))]
        if name == "step":
            _set_hyperparameters(_zero_optimizer(obj).param_groups, numbers[2 * len(parameters):])
        method(**dict(zip(parameters, values)))
