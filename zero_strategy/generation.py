"""Generation at stage 3: ranks that decode different lengths stay in step.

[Note: synced generation]
At stage 3 every forward gathers each unit's parameters from every rank, so every rank must run
the same number of forwards (see [Note: order guard] in engine/comm/order_guard.py). ``generate()``
does not: a rank whose sequences end (EOS, a shorter ``max_new_tokens``) leaves the loop, and the
others wait in a gather it never joins. Hugging Face's ``GenerationMixin.generate`` has the remedy,
``synced_gpus=True``: a rank that is done keeps running forwards (and throws their results away)
until an all-reduce each step says every rank is done. transformers turns it on by itself only for
DeepSpeed ZeRO-3 and FSDP-managed modules; making it believe DeepSpeed runs would also send
``from_pretrained`` down DeepSpeed's path. So ``sync_generation`` (called by the ordered setup of
every front end, see [Note: the order of setup] in frontend/setup.py) replaces ``generate`` on each
Hugging Face generation module inside a model sharded at stage 3 over more than one rank, on that
instance only, by one that passes ``synced_gpus=True`` unless the caller passed ``synced_gpus``
itself. peft's ``PeftModel.generate`` calls its base model's ``generate``, so it goes through the
same instance. Each call also posts its start and end on the rank board (see [Note: the rank board] in
engine/diagnose/rank_board.py), so that ``generate()`` on one rank only is an error that says so.

Decoding loops of one's own (not ``generate()``) stay in step the same way: loop while
``any_rank_busy(not done)``, running the step on a dummy input on ranks that are done.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from .engine.diagnose import rank_board
from .engine.comm.collectives import Collectives
from .engine.diagnose.watchdog import CollectiveError
from .engine.params.attached import attach_attribute

__all__ = ["any_rank_busy", "sync_generation"]


def sync_generation(module: nn.Module, stage: int, comm: Collectives) -> int:
    """Make ``generate`` of every Hugging Face generation module in ``module`` keep the ranks in step
    (see [Note: synced generation]); a no-op below stage 3, on one rank, or when transformers is not
    imported. Returns how many modules it changed."""
    if stage != 3 or comm.world_size <= 1:
        return 0
    transformers = sys.modules.get("transformers")  # a model of transformers' has imported it; never import it here
    mixin = getattr(transformers, "GenerationMixin", None) if transformers is not None else None
    if mixin is None:
        return 0
    changed = 0
    for sub in module.modules():
        current = sub.__dict__.get("generate")
        if isinstance(sub, mixin) and not getattr(current, "_zero_synced", False):
            # a method of this instance only (Fabric's mark_forward_method wants a method): the class stays as it is
            # and not in its copies (see [Note: a module's copies hold what the user sees] in engine/params/attached.py)
            attach_attribute(sub, "generate", types.MethodType(_synced(sub.generate, comm), sub))
            changed += 1
    return changed


def _synced(generate: Callable[..., Any], comm: Collectives) -> Callable[..., Any]:
    names = list(inspect.signature(generate).parameters)
    position = names.index("synced_gpus") if "synced_gpus" in names else None
    device = torch.device("cuda", torch.cuda.current_device()) if comm.backend == "nccl" else torch.device("cpu")

    @functools.wraps(generate)
    def synced_generate(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if "synced_gpus" not in kwargs and (position is None or len(args) <= position):
            kwargs["synced_gpus"] = True  # see [Note: synced generation]
        rank_board.mark("entered generate()")
        try:
            # every rank starts together, in a collective the watchdog waits for: a rank that never calls
            # generate() is named by the board (transformers' own all-reduces are waited for by nobody)
            comm.all_reduce(torch.ones(1, device=device), what=lambda: "all-reduce that starts generate() on every rank")
            return generate(*args, **kwargs)
        except Exception as err:
            cause = rank_board.board().divergence()
            if cause is None or cause in str(err):
                raise
            raise CollectiveError(f"rank {comm.rank}: generate() failed: {err}\nThe cause: {cause}") from err
        finally:
            rank_board.mark("ended generate()")

    synced_generate._zero_synced = True  # type: ignore[attr-defined]
    return synced_generate


def any_rank_busy(busy: bool, device: Optional[torch.device] = None) -> bool:
    """Whether any rank is still ``busy``: a collective every rank calls once per step of a loop of its
    own (a decoding loop), so that ranks done early keep running the step, on a dummy input, until all
    are done (see [Note: synced generation])::

        done = False
        while zero_strategy.any_rank_busy(not done):
            logits = model(tokens if not done else dummy)   # every rank runs every unit
            if not done:
                tokens, done = extend(tokens, logits)

    ``device``: where the flag goes (the current CUDA device under NCCL, else the CPU)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return bool(busy)
    if device is None:
        cuda = dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    flag = torch.tensor([1 if busy else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
