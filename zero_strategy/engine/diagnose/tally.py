"""Every rank steps after the same backward passes: checked inside the step's first all-reduce.

[Note: the step's tally]
Ranks that part by whole passes issue the same collectives in the same order: at stage 1 a rank
that ran one micro-batch more before a step, or skipped a step and accumulated into the next, sends
nothing until the step, and the step's collectives are the same on every rank (so neither the
gather headers of stage 3 nor the comparison of kinds in [Note: collectives that differ] can see
it); the step then averages gradients of different micro-batches, silently. So each step's
all-reduce of which parameters got a gradient (one per step, over every rank, before any update)
carries a *tally*: the steps this rank's optimizer began and the backward passes its gradient hooks
saw, both since the engine was made, and at stage 3 a digest of the gathers whose headers were left
out since the last check (see [Note: headers left out on gloo] in engine/comm/order_guard.py; 0 for
none). Ranks in step agree on all three (a joined rank, see engine/join.py, replays the others' passes and
steps, so it agrees too).

That all-reduce takes the largest value, elementwise, of bytes. A tally word goes as its eight bytes
b and their complements 255 - b: the largest b over the ranks is the rank's own, and the largest
255 - b is 255 minus its own, exactly when the smallest and largest b are equal, that is when every
rank sent the same byte. So every rank learns whether every rank sent its tally, at no collective
of its own: 48 bytes more in one small all-reduce per step, whatever the number of ranks (48 more
bytes at 1,024 ranks too, counted by ``comm_stats()`` and predicted by comm_model.py). A rank that
differs from any other sees its own bytes overtaken in one of the two halves, so every rank of a
tally that disagrees raises ``UnitOrderError`` before the step changes anything; to name what each
rank did, each posts its tally on the process group's store and reads the others' (for at most
``NAME_WAIT_S``); where only the digests differ, the order guard names the first gather that
differed, from the tags each rank posts.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from . import rank_board
from .watchdog import out_of_step

WORDS = 3  # steps begun, backward passes, the digest of the headers left out
TALLY_BYTES = 2 * 8 * WORDS
"""Bytes the tally adds to the step's all-reduce of which parameters got a gradient."""

NAME_WAIT_S = 5.0
"""How long a rank that found a disagreement waits for the others' posted tallies, to name them."""


def word_bytes(*words: int) -> torch.Tensor:
    """int64 ``words`` as their bytes, then their complements (uint8): sent in an all-reduce that takes
    the maximum, they come back unchanged exactly when every rank sent the same words."""
    raw = torch.tensor(words, dtype=torch.int64).view(torch.uint8)
    return torch.cat([raw, 255 - raw])


def tally_bytes(steps: int, backwards: int, digest: int = 0) -> torch.Tensor:
    """The ``TALLY_BYTES`` a rank adds (see ``word_bytes``)."""
    return word_bytes(steps, backwards, digest)


def agreed(sent: torch.Tensor, reduced: torch.Tensor) -> bool:
    """Whether every rank sent ``sent``, from the elementwise maximum ``reduced`` of every rank's."""
    return torch.equal(sent, reduced.to(sent.device))


def _describe(text: str) -> str:
    steps, backwards, _ = text.split(",")
    return f"step {int(steps)}, after {int(backwards)} backward passes since the engine was made"


def raise_disagreement(steps: int, backwards: int, digest: int, key: str, scope: Optional[str] = None,
                       explain: Optional[Callable[[], None]] = None) -> None:
    """This rank's tally differs from another's: post it, read the others' and raise UnitOrderError
    (``scope``: the engine's, see ``watchdog.out_of_step``). Where the ranks differ in the digest
    alone, ``explain()`` raises the order guard's error naming the gathers that differed."""
    mine = f"{steps},{backwards},{digest}"
    board = rank_board.board()
    posted = board.exchange(key, mine, NAME_WAIT_S)
    everyone = board.enabled and len(posted) >= board.world_size - 1
    if everyone and len({t.rsplit(",", 1)[0] for t in [mine, *posted.values()]}) == 1:  # the same work, other gathers
        if explain is not None:
            explain()  # names them, from the tags each rank kept
        raise out_of_step(
            f"the ranks reached optimizer step {steps} after the same {backwards} backward passes, but gathered "
            "different stage-3 units in them (the digests of their gathers differ; the gathers themselves could not "
            "be read from the other ranks in time). Every rank must run the same stage-3 units in the same order, "
            "whatever its data. Nothing was updated.", scope)
    lines = [f"  rank {r}: {_describe(t)}" for r, t in sorted({board.rank: mine, **posted}.items())]
    missing = "" if everyone else "\n  (the other ranks did not say theirs in time)"
    raise out_of_step(
        "the ranks reached this optimizer step after different work:\n" + "\n".join(lines) + missing + "\n"
        "Every rank must run the same number of micro-batches (backward passes) before each step and take every "
        "step: a rank with one more batch (uneven data: use zero_strategy.Join, or drop the last batches, as a "
        "DistributedSampler with drop_last does), a backward skipped or repeated on one rank, or a step skipped on "
        "one rank averages gradients of different passes. Nothing was updated.", scope)


def check(sent: torch.Tensor, reduced: torch.Tensor, steps: int, backwards: int, key: Optional[str],
          scope: Optional[str] = None, digest: int = 0, explain: Optional[Callable[[], None]] = None) -> None:
    """Raise UnitOrderError on this rank if the ranks' tallies differ (``key``: where to post them;
    the rest: see ``raise_disagreement``)."""
    if not agreed(sent, reduced):
        raise_disagreement(steps, backwards, digest, key or "tally", scope, explain)
