"""Stage 3: every rank must gather the same unit at the same moment; say so when one does not.

[Note: order guard]
A stage-3 all-gather has a partner on every other rank only if every rank runs the same units in
the same order. When one rank skips a unit (a data-dependent branch) or runs one twice, its
all-gathers pair with other units' on the other ranks: with equal sizes the parameters are silently
wrong, with unequal ones the job hangs. So before each unit's all-gather every rank contributes a
tag, (pass, gather number in the pass, unit, phase, the unit it came from), to one small all-gather of its own, and
compares: any difference is an ``UnitOrderError`` on every rank, naming what each rank was
doing, before the unit's own collective is issued. On the host (gloo) the tags are compared at
once. On CUDA they are compared at the end of each pass (``flush``), which already waits for the
device, so the check never stalls the stream; a divergence that makes NCCL hang before that is
left to NCCL's own timeout.

The check costs one all-gather of 5 integers per unit gather: 3-6% of a step on 2 CPU ranks
(benchmarks/RESULTS.md), more than a check that is always on should cost. So it checks every pass
for the first ``FULL_CHECK_PASSES``, where a model's control flow shows itself, then one pass in
``every`` (``check_unit_order_every``, 10 by default: about a tenth of the cost), and always outside
passes (state dicts, gathered_parameters). Which passes are checked depends on the pass count alone,
the same on every rank. A divergence in an unchecked pass is caught at the next checked pass it
happens in; between, it makes the engine's collectives disagree, and the hang watchdog ends the job
naming the collective (see [Note: hang watchdog] in watchdog.py). The tags are those of the gathers
this rank issues: prefetches included, which follow the same history on every rank.

When the tags differ because the ranks are in different parts of the program (one entered
``generate()`` where the other ended validation), the error says so first, from the boundaries the
ranks posted (see [Note: the rank board] in rank_board.py). A rank that has joined (``Join``, see
join.py) replays a forward and backward of its own on the others' cue, so its tags are those of a
rank in step and the guard accepts it; the board notes it as joined, for messages.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import rank_board
from .collectives import Collectives

PHASES = ("forward", "backward", "prefetch for forward", "prefetch for backward", "recomputation in backward",
          "gathered_parameters or a state dict")
FORWARD, BACKWARD, PREFETCH_FORWARD, PREFETCH_BACKWARD, RECOMPUTE, OUTSIDE = range(len(PHASES))
_DOING = (  # what a rank was doing when it gathered ``unit``; ``context`` is the unit it came from
    "starting the forward of {unit} (the unit it ran before: {context})",
    "starting the backward of {unit}",
    "prefetching {unit} while starting the forward of {context}",
    "prefetching {unit} while starting the backward of {context}",
    "recomputing the forward of {unit} in backward",
    "gathering {unit} outside forward and backward (gathered_parameters, a state dict)",
)


class UnitOrderError(RuntimeError):
    """Ranks ran different stage-3 units at the same point."""


FULL_CHECK_PASSES = 10
"""Passes checked in full before the guard samples one in ``every`` (see [Note: order guard])."""


class OrderGuard:
    """Compares every gather's tag across ranks (see [Note: order guard])."""

    def __init__(self, comm: Collectives, unit_names: Sequence[str], device: torch.device, every: int = 1) -> None:
        self.comm = comm
        self.every = every
        self.active = True  # this pass is checked
        self.names = list(unit_names)
        self.device = device
        self.deferred = device.type == "cuda"
        self.enabled = comm.world_size > 1
        self.passes = 0  # passes begun: forward (and backward) of the whole module, or a step around it
        self.seq = 0  # gathers in the current pass
        self._unchecked: list[torch.Tensor] = []  # deferred: gathered tags, (world_size, 5) each

    def begin_pass(self) -> None:
        self.flush()
        self.passes += 1
        self.seq = 0
        self.active = self.passes <= FULL_CHECK_PASSES or self.passes % self.every == 0

    def check(self, unit: int, phase: int, context: int = -1) -> None:
        """Before ``unit``'s all-gather: agree with every rank on what is being gathered. ``context`` is
        the unit whose hook asks (see ``_DOING``), -1 for none."""
        if not self.enabled or not (self.active or phase == OUTSIDE):
            return
        self.seq += 1
        tag = torch.tensor([self.passes, self.seq, unit, phase, context], dtype=torch.int64, device=self.device)
        tags = self.comm.all_gather_shards(tag, lambda: f"order check before gathering unit {self.names[unit]!r}")
        if self.deferred:
            self._unchecked.append(tags)
        else:
            self._compare(tags)

    def flush(self) -> None:
        """Compare the deferred tags (one device sync for all of them)."""
        if self._unchecked:
            tags, self._unchecked = torch.stack(self._unchecked), []
            if bool((tags != tags[:, :1]).any()):
                for one in tags.cpu():
                    self._compare(one)

    def _compare(self, tags: torch.Tensor) -> None:
        if bool((tags == tags[0]).all()):
            return
        lines = []
        for rank, (passes, seq, unit, phase, context) in enumerate(tags.tolist()):
            doing = _DOING[phase].format(unit=self._name(unit), context=self._name(context))
            lines.append(f"  rank {rank}: {doing} (pass {passes}, gather {seq} in it)")
        board = rank_board.board()
        cause = board.divergence()
        if cause is not None:
            raise UnitOrderError(f"ZeRO stage 3: the ranks are not in step: {cause}\nThe gathers that differed:\n"
                                 + "\n".join(lines) + "\n" + board.describe())
        raise UnitOrderError(
            "ZeRO stage 3: the ranks gathered different units at the same point:\n" + "\n".join(lines) + "\n"
            "Every rank must run the same stage-3 units in the same order, whatever its data: a module skipped on one "
            "rank (a data-dependent branch), or called more often on one rank, leaves the others waiting for its "
            "parameters. Run every unit on every rank (compute the branch everywhere and multiply its result by 0 "
            "where it is not wanted), or keep such a module out of the units: with shard_modules naming other "
            "classes, its parameters stay in the root unit, gathered for the whole step.")

    def _name(self, unit: int) -> str:
        return repr(self.names[unit]) if 0 <= unit < len(self.names) else "none"
