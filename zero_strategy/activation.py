"""Activation checkpointing, activation offload, and an exact count of the bytes kept for backward.

[Note: checkpointing by instance forward]
``apply_activation_checkpointing`` replaces the ``forward`` of each chosen module *instance* (an
attribute in the instance's ``__dict__``, which ``nn.Module.__call__`` finds before the class's
method) by a callable that runs the original forward under ``torch.utils.checkpoint`` with
``use_reentrant=False``. Nothing else about the module changes: its class, its children and so
its ``state_dict`` keys stay the same (a wrapper module would add a prefix to every key and hide
the class from stage 3's ``shard_modules`` matching), and hooks registered on the module, such as
stage 3's gather and release, still run around the whole checkpointed call, once.

[Note: recomputation at stage 3]
Non-reentrant recomputation calls the module's original forward directly, not ``module(...)``, so
the module's own hooks do not run again: when the module is a stage-3 unit (``shard_modules``
names the same class), the unit's parameters were gathered again by the hook on its outputs as
backward reached them, before any saved tensor of the module is unpacked (that is what triggers
recomputation). Gradients flow through the graph of the original forward only, so each
parameter's gradient is accumulated, and handed to the reducer, exactly once. Units *inside* a
checkpointed module run their hooks during recomputation (gather, then release) and are gathered
again when backward reaches their outputs; every rank recomputes the same modules in the same
order, so the collectives still agree.

Early stopping of recomputation (torch's default: stop once the last needed tensor is recomputed)
is turned off here: it ends recomputation by raising inside the forward, which would skip the
forward hooks of a unit nested in the checkpointed module and leave that unit counted as in use.

[Note: what counts as an activation]
Autograd saves for backward both activations and parameters (a linear layer saves its weight, or
a transposed view of it). Parameters are held by the model anyway (at stage 3 they are gathered
again for backward), so neither ``offload_activations`` nor ``SavedActivationMeter`` treats a
saved parameter, or a view of one, as an activation: offload would copy whole gathered weights to
the host, and the meter would count weights as activations.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from .engine.params.attached import attach_attribute, attach_hook, detach_attribute, detach_hook
from .engine.params.plan import ModuleTarget as Target
from .engine.params.plan import module_matches, target_name

__all__ = [
    "SavedActivationMeter",
    "apply_activation_checkpointing",
    "checkpointed_modules",
    "offload_activations",
    "remove_activation_checkpointing",
    "saved_activation_bytes",
]



# ---- which tensors are activations ------------------------------------------------------------


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (``weight.t()`` is what a linear layer saves)."""
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


# ---- activation offload -----------------------------------------------------------------------


class offload_activations(torch.autograd.graph.saved_tensors_hooks):
    """Inside this context, tensors autograd saves for backward wait in host memory.

    Each activation saved on an accelerator is copied to host memory (pinned when CUDA is
    available, so the copies back can overlap compute) and returns to its device when backward
    needs it. Tensors already on the CPU and parameters (see [Note: what counts as an activation])
    are kept as they are: on a CPU-only machine this changes no placement, only the bookkeeping.
    Only the innermost saved-tensor hooks apply, so inside a checkpointed module (whose own hooks
    drop the saved tensors) nothing is copied; the module's inputs, kept for its recomputation,
    are saved outside those hooks and are offloaded.

    ``enabled=False`` makes it a no-op, so call sites need no branch::

        with offload_activations(enabled=config.offload_activations):
            loss = model(batch)
    """

    def __init__(self, enabled: bool = True, pin_memory: Optional[bool] = None) -> None:
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.enabled = enabled

        def pack(t: torch.Tensor) -> tuple[Optional[torch.device], torch.Tensor]:
            if not enabled or t.device.type == "cpu" or _is_parameter(t):
                return None, t
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin)
            host.copy_(t, non_blocking=pin)  # read back on the same stream, after this copy
            return t.device, host

        def unpack(packed: tuple[Optional[torch.device], torch.Tensor]) -> torch.Tensor:
            device, t = packed
            return t if device is None else t.to(device, non_blocking=pin)

        super().__init__(pack, unpack)

    def __enter__(self) -> "offload_activations":
        if self.enabled:
            super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            super().__exit__(*exc)


_OFFLOAD_HANDLES = "_zero_activation_offload"  # on a module whose forward offloads: its hook handles


def offload_activations_in_forward(module: nn.Module) -> None:
    """Enter ``offload_activations`` around every call of ``module`` (its forward and the hooks in it).

    [Note: activation offload in every front end]
    ``offload_activations=True`` must not depend on the front end's own step wrapper (the Trainer's
    ``training_step``, ``initialize``'s ``forward``): Fabric has none, and the setting was accepted
    there and never entered. So the engine's setup puts these hooks on the module itself. The
    pre-hook goes first and the post-hook (which runs even when the forward raised) is added after
    the stage-3 sharder's: saved-tensor hooks are a stack, and the units' own (see [Note: saved weights] in
    engine/params/saved_weights.py) must be pushed inside ours and popped before. A front end's
    wrapper around a larger region stays outside and takes what is saved beyond the forward (a loss).
    Applying again changes nothing; ``remove_activation_offload`` undoes it.
    """
    if _OFFLOAD_HANDLES in module.__dict__:
        return
    entered: list[offload_activations] = []  # a stack: the module may be called inside its own forward

    def enter(mod: nn.Module, args: Any) -> None:
        entered.append(offload_activations())
        entered[-1].__enter__()

    def leave(mod: nn.Module, args: Any, output: Any) -> None:
        if entered:
            entered.pop().__exit__(None, None, None)

    # attached, so that copies of the module leave them out (see [Note: a module's copies hold what the
    # user sees] in engine/params/attached.py)
    attach_attribute(module, _OFFLOAD_HANDLES, (
        attach_hook(module, module.register_forward_pre_hook(torch._dynamo.disable(enter), prepend=True)),
        attach_hook(module, module.register_forward_hook(torch._dynamo.disable(leave), always_call=True))))


def remove_activation_offload(module: nn.Module) -> None:
    """Undo ``offload_activations_in_forward``."""
    for handle in detach_attribute(module, _OFFLOAD_HANDLES) or ():
        detach_hook(module, handle)


# ---- measuring what is saved ------------------------------------------------------------------


class SavedActivationMeter(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes autograd keeps for backward while the context is open, exactly.

    Each storage is counted once, whole (a saved view keeps its whole storage alive; three views
    of one ``qkv`` output are one storage), and parameters are left out (see [Note: what counts as
    an activation]). Saved tensors are kept as they are, so training is unchanged::

        with SavedActivationMeter() as meter:
            loss = model(x).sum()
        print(meter.bytes, meter.tensors)

    Only the innermost saved-tensor hooks see a tensor: what a checkpointed module drops, or an
    inner ``offload_activations`` moves, is not counted. While open, the meter holds a reference
    to every storage it counted, so a freed storage's address cannot be reused and miscounted.
    """

    def __init__(self) -> None:
        self._storages: dict[tuple[torch.device, int], torch.UntypedStorage] = {}
        self.tensors = 0  # saved tensors counted (not storages)
        self.bytes = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not _is_parameter(t):
                storage = t.untyped_storage()
                key = (t.device, storage.data_ptr())
                if key not in self._storages or storage.data_ptr() == 0:
                    self._storages[key] = storage
                    self.bytes += storage.nbytes()
                self.tensors += 1
            return t

        super().__init__(pack, lambda t: t)

    def __enter__(self) -> "SavedActivationMeter":
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._storages.clear()


def saved_activation_bytes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Bytes of activations ``fn(*args, **kwargs)`` leaves saved for backward (see ``SavedActivationMeter``).

    Measure a forward with its loss, e.g. ``saved_activation_bytes(lambda: loss_fn(model(x), y))``;
    the graph is dropped afterwards.
    """
    with SavedActivationMeter() as meter:
        fn(*args, **kwargs)
    return meter.bytes


# ---- checkpointing ----------------------------------------------------------------------------


class _CheckpointedForward:
    """A module instance's ``forward`` that recomputes in backward (see [Note: checkpointing by
    instance forward]). Holds the module (a reference cycle the garbage collector handles; plain
    attributes, so ``copy.deepcopy`` and pickling re-point it at the copy)."""

    def __init__(self, module: nn.Module, own_forward: Optional[Callable[..., Any]], offload: bool) -> None:
        self.module = module
        self.own_forward = own_forward  # an instance-level forward set before ours; None: the class's
        self.offload = offload

    def original(self) -> Callable[..., Any]:
        if self.own_forward is not None:
            return self.own_forward
        return functools.partial(type(self.module).forward, self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        run = self.original()
        if not torch.is_grad_enabled():  # evaluation: nothing is saved, so nothing to recompute
            return run(*args, **kwargs)
        # keyword arguments travel positionally: checkpoint() then keeps their tensors like the
        # positional ones, and a forward's own `debug=` or `context_fn=` cannot collide with
        # checkpoint()'s parameters
        names = tuple(kwargs)
        n_args = len(args)

        def call(*flat: Any) -> Any:
            return run(*flat[:n_args], **dict(zip(names, flat[n_args:])))

        with offload_activations(enabled=self.offload), set_checkpoint_early_stop(False):
            return checkpoint(call, *args, *kwargs.values(), use_reentrant=False)


def checkpointed_modules(module: nn.Module) -> list[str]:
    """Names of ``module``'s submodules (``""`` for itself) whose forward is checkpointed."""
    return [name for name, m in module.named_modules() if isinstance(m.__dict__.get("forward"), _CheckpointedForward)]


def apply_activation_checkpointing(module: nn.Module, targets: Sequence[Target], interval: int = 1,
                                   offload: bool = False) -> list[str]:
    """Recompute the forward of modules of the ``targets`` classes in backward instead of keeping
    their activations; returns the names of the checkpointed modules.

    ``targets`` are classes or class names (``["Block"]``, ``[GPT2Block]``; a name matches the
    class's ``__name__`` exactly, a class matches its subclasses too). Matching modules are taken
    in ``named_modules()`` order, outermost only (a match inside another match would be recomputed
    twice); ``interval=n`` checkpoints the first and every n-th after it (n=2: modules 0, 2, 4...).
    ``offload=True`` also keeps the checkpointed modules' inputs in host memory (see
    ``offload_activations``). The module's class, children and ``state_dict`` keys are unchanged.
    Applying again does not wrap twice: modules already checkpointed keep their wrapper (with
    ``offload`` updated) and count toward the interval.
    """
    if isinstance(targets, (str, type)):
        targets = (targets,)
    targets = tuple(targets)
    if not targets or not all(isinstance(t, (str, type)) for t in targets):
        raise ValueError(f"activation checkpointing targets={targets!r} must be a non-empty sequence of module "
                         "classes or class names, e.g. ['Block'].")
    if type(interval) is not int or interval < 1:
        raise ValueError(f"activation checkpointing interval={interval!r} must be a positive integer (1 checkpoints "
                         "every matching module, 2 every second one).")
    everything = list(module.named_modules())
    unmatched = [t for t in targets if not any(module_matches(m, (t,)) for _, m in everything)]
    if unmatched:
        classes = sorted({type(m).__name__ for _, m in everything})
        raise ValueError(
            f"activation checkpointing: no module of class {', '.join(repr(target_name(t)) for t in unmatched)} "
            f"in {type(module).__name__}; its modules' classes are {classes}. Name one of these (the class's "
            "exact __name__), or drop the entry.")

    matching: list[tuple[str, nn.Module]] = []
    for name, m in everything:
        inside = any(name.startswith(outer + ".") or not outer for outer, _ in matching)
        if not inside and module_matches(m, targets):
            matching.append((name, m))
    chosen = []
    for index, (name, m) in enumerate(matching):
        if index % interval:
            continue
        current = m.__dict__.get("forward")
        if isinstance(current, _CheckpointedForward):
            current.offload = offload
        else:
            m.forward = _CheckpointedForward(m, current, offload)
        chosen.append(name)
    return chosen


def remove_activation_checkpointing(module: nn.Module) -> list[str]:
    """Undo ``apply_activation_checkpointing`` on ``module`` and its submodules; returns the names
    of the modules that were checkpointed."""
    names = checkpointed_modules(module)
    for name in names:
        m = module.get_submodule(name)
        wrapper = m.__dict__.pop("forward")
        if wrapper.own_forward is not None:
            m.forward = wrapper.own_forward
    return names

