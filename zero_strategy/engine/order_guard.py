"""Stage 3: every rank must gather the same unit at the same moment; say so when one does not.

[Note: order guard]
A stage-3 all-gather has a partner on every other rank only if every rank runs the same units in
the same order. When one rank skips a unit (a data-dependent branch) or runs one twice, its
all-gathers pair with other units' on the other ranks: with equal sizes the parameters are silently
wrong, with unequal ones the job hangs. So every unit's all-gathers carry a tag, (pass, gather
number in the pass, unit, phase, the unit it came from), in a header inside the collective itself
(see [Note: the collective header] in collective_header.py), and when a gather is waited for,
before anything reads the gathered weights, every rank compares every rank's tag: any difference
is an ``UnitOrderError`` on every rank (all of them received the same tags), naming what each rank
was doing. The header costs no collective of its own, so every pass is checked, and outside passes
too (state dicts, gathered_parameters). (The guard used to issue an all-gather of its own per unit
gather, 3-6% of a step, and so checked only one pass in ``check_unit_order_every`` after the first
ten; that setting is now accepted and ignored, with a warning.) On the host (gloo) the tags are
compared at once. On CUDA they are compared at the end of each pass (``flush``), which already
waits for the device, so the check never stalls the stream; there a divergence is named at the end
of its pass, before the optimizer step, and one that makes NCCL hang before that is left to
NCCL's own timeout. The tags are those of the gathers this rank issues: prefetches included, which
follow the same history on every rank.

When the tags differ because the ranks are in different parts of the program (one entered
``generate()`` where the other ended validation), the error says so first, from the boundaries the
ranks posted (see [Note: the rank board] in rank_board.py). A rank that has joined (``Join``, see
join.py) replays a forward and backward of its own on the others' cue, so its tags are those of a
rank in step and the guard accepts it; the board notes it as joined, for messages.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import rank_board
from .collective_header import Header, decode, encode
from .collectives import Collectives
from .watchdog import out_of_step

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


class OrderGuard:
    """Tags every gather and compares the tags every rank sent (see [Note: order guard])."""

    def __init__(self, comm: Collectives, unit_names: Sequence[str], device: torch.device,
                 wait_s: float = 5.0) -> None:
        self.comm = comm
        self.wait_s = wait_s  # ``unit_order_wait``: see _waiting_long
        self.names = list(unit_names)
        self.device = device
        self.deferred = device.type == "cuda"
        self.enabled = comm.world_size > 1
        self.passes = 0  # passes begun: forward (and backward) of the whole module, or a step around it
        self.seq = 0  # gathers in the current pass
        self._unchecked: list[tuple[torch.Tensor, torch.Tensor]] = []  # deferred: (any difference, tags)
        OrderGuard.made += 1  # every rank makes its guards in the same order; the group's first rank and size
        self._key = f"gather/{OrderGuard.made}/{comm.global_rank(0)}+{comm.world_size}"  # tell subgroups apart
        self._members = {comm.global_rank(r) for r in range(comm.world_size)}

    made = 0  # guards made in this process: the store's posts of one guard are not another's

    def begin_pass(self) -> None:
        self.flush()
        self.passes += 1
        self.seq = 0

    def header(self, unit: int, phase: int, context: int = -1) -> Optional[Header]:
        """The header of ``unit``'s all-gathers (None when the guard is off). ``context`` is the unit
        whose hook asks (see ``_DOING``), -1 for none."""
        if not self.enabled:
            return None
        self.seq += 1
        words = encode(self.passes, self.seq, unit, phase, context)
        return Header(words, self._received, lambda waited: waited >= self.wait_s and self._waiting_long(words))

    def _waiting_long(self, words: torch.Tensor) -> None:
        """A wait for a gather has lasted ``wait_s`` (``unit_order_wait``): the ranks' collectives may differ in size
        or kind, so that no header arrives. Post this gather's tag on the store and compare it with
        the ones the others posted for the same gather number: a difference is an UnitOrderError, a
        match or nothing yet goes on waiting (see [Note: order guard])."""
        board = rank_board.board()
        if not board.enabled:
            return
        mine = words.tolist()
        try:
            board.post(self._key, ",".join(map(str, mine)))
            posted = {r: [int(v) for v in text.split(",")] for r, text in board.posted(self._key).items()}
        except Exception:  # the store is gone or slow: the watchdog goes on
            return
        same_point = {r: t for r, t in posted.items() if r in self._members and t[:2] == mine[:2]}
        if any(t != mine for t in same_point.values()):
            rows = {board.rank: mine, **same_point}
            ranks = sorted(rows)
            self._compare(torch.tensor([rows[r] for r in ranks], dtype=torch.int32), ranks)

    def _received(self, tags: torch.Tensor) -> None:
        """Every rank's tag of one all-gather, (ranks, 4) int32, once it completed."""
        if self.deferred:
            self._unchecked.append(((tags != tags[:1]).any(), tags))
        else:
            self._compare(tags)

    def flush(self) -> None:
        """Compare the deferred tags (one device sync for all of them)."""
        if self._unchecked:
            unchecked, self._unchecked = self._unchecked, []
            if bool(torch.stack([differ for differ, _ in unchecked]).any()):
                for _, tags in unchecked:
                    self._compare(tags.cpu())

    def _compare(self, tags: torch.Tensor, ranks: Optional[Sequence[int]] = None) -> None:
        if bool((tags == tags[0]).all()):
            return
        lines = []
        ranks = ranks or [self.comm.global_rank(r) for r in range(len(tags))]  # global ranks, as the store's
        for rank, (passes, seq, unit, phase, context) in zip(ranks, decode(tags)):
            doing = _DOING[phase].format(unit=self._name(unit), context=self._name(context)) \
                if 0 <= phase < len(_DOING) else f"phase {phase} of {self._name(unit)}"
            lines.append(f"  rank {rank}: {doing} (pass {passes}, gather {seq} in it)")
        board = rank_board.board()
        cause = board.divergence()
        if cause is not None:
            raise out_of_step(f"ZeRO stage 3: the ranks are not in step: {cause}\nThe gathers that differed:\n"
                              + "\n".join(lines) + "\n" + board.describe(), self.comm.scope)
        raise out_of_step(
            f"ZeRO stage 3: the ranks gathered different units at the same point (this rank's pass {self.passes}):\n"
            + "\n".join(lines) + "\n"
            "Every rank must run the same stage-3 units in the same order, whatever its data: a module skipped on one "
            "rank (a data-dependent branch), or called more often on one rank, leaves the others waiting for its "
            "parameters. Run every unit on every rank (compute the branch everywhere and multiply its result by 0 "
            "where it is not wanted), or keep such a module out of the units: with shard_modules naming other "
            "classes, its parameters stay in the root unit, gathered for the whole step.", self.comm.scope)

    def _name(self, unit: int) -> str:
        return repr(self.names[unit]) if 0 <= unit < len(self.names) else "none"
