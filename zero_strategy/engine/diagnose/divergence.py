"""Ranks whose collectives part: what each issued, compared when a wait lasts (``Collectives``'s part
that reads the others' posts; the collectives themselves are in engine/comm/collectives.py).

[Note: collectives that differ]
Ranks in step issue the same collectives on a group in the same order, so the k-th collective a
``Collectives`` object issued is of the same kind on every rank, and a stage-3 gather of the same
unit. When ranks part (one ran an extra micro-batch, skipped a step or a unit, evaluated where the
others trained), their collectives stop matching, and gloo either waits (two kinds that do not
fit), or completes a pair that happens to fit (an all-to-all and an all-gather of the same bytes:
the ranks' counts then part), or aborts (see [Note: the collective header]). So every watched
object (gloo's: see [Note: hang watchdog] in engine/diagnose/watchdog.py; NCCL's waits are left to NCCL) keeps the
last ``HISTORY`` collectives it issued, (k, kind, the gather's tag), and a wait that has lasted
``mismatch_wait_s`` (the engine sets it to ``unit_order_wait``, 5 s by default; then again at
intervals of a quarter of the time waited, so that a long wait does not flood the store) posts on the
process group's store, under its engine's scope (every rank makes its objects in the same order),
the histories of all the scope's groups and which collective it waits for, and reads the others':
- the same k of the same group with another kind, or another gather's tag, in any two histories:
  the ranks issued different collectives there. What a rank issued at k is a fact, never stale, so
  any two posts may be compared;
- this rank waits for collective k of a group where another rank has issued fewer, and that rank
  waits for one that this rank has not issued: each waits for the other, for ever (that rank's
  wait cannot have ended: it needs this rank's collective). Groups of other shapes (hybrid
  sharding's, the secondary partition's) are included, so ranks stuck in different groups are found;
then every waiting rank raises ``UnitOrderError``, after letting the order guard name the first
gather that differed where it can (``explain``). Nothing is posted or read before that wait, so a
step costs nothing but appending to the histories. Ranks that differ only in what they compute
(stage 1 accumulates micro-batches without a collective) issue the same collectives, and nothing
here can see it: the step's tally does ([Note: the step's tally] in engine/diagnose/tally.py).
"""

from __future__ import annotations

import json
from typing import Callable, Protocol, Sequence

from . import rank_board
from .watchdog import out_of_step

HISTORY = 32
"""Collectives each watched object remembers for [Note: collectives that differ]."""

ADVICE = ("Every rank must run the same steps, micro-batches and units in the same order: a rank that ran an extra "
          "micro-batch (uneven data: use zero_strategy.Join, or the same number of batches on every rank), skipped a "
          "step, skipped a module or evaluated alone waits for collectives the others never issue; and at stage 3 "
          "gathered_parameters and state dicts are collectives too, to enter on every rank (not under `if rank == "
          "0:`).")


class Issuer(Protocol):
    """What a comparison reads of one group's collectives object (``Collectives``)."""

    key: str  # the group's name, the same on every rank
    scope: str  # its engine's name: posts are compared within a scope
    issued: int  # collectives issued so far
    history: Sequence[tuple[int, str, tuple]]  # the last HISTORY of them: (k, kind, the gather's tag)


def compare_posted(groups: Sequence[Issuer], waiting: Issuer, seq: int, doing: str,
                   named: Callable[[str, tuple], str], explain: Callable[[], None]) -> None:
    """This rank has waited long for ``waiting``'s ``seq``-th collective (``doing``): post where it is and
    what ``groups`` (its engine's) issued, read the other ranks' posts, and raise UnitOrderError if they
    show the ranks out of step (see [Note: collectives that differ]). ``named`` words a history's
    entry; ``explain`` lets what knows more (the order guard) raise first."""
    board = rank_board.board()
    if not board.enabled:
        return
    scope = waiting.scope
    mine = {c.key: list(c.history) for c in groups}
    try:
        board.post(f"where/{scope}", json.dumps({"waits": [waiting.key, seq, doing], "issued": mine}))
        posted = {r: json.loads(text) for r, text in board.posted(f"where/{scope}").items()}
    except Exception:  # the store is gone or slow: the watchdog goes on
        return
    issued_here = {c.key: c.issued for c in groups}
    for rank, theirs in sorted(posted.items()):
        for key, history in theirs["issued"].items():
            at = {k: (kind, tuple(tag)) for k, kind, tag in mine.get(key, ())}
            for k, kind, tag in history:
                tag = tuple(tag)
                if k in at and (at[k][0] != kind or (tag and at[k][1] and tag != at[k][1])):
                    explain()  # a rank that went on to other work: named below
                    raise out_of_step(
                        f"the ranks issued different collectives at the same point (collective {k} of a group "
                        f"of theirs):\n  rank {board.rank}: issued {named(*at[k])} there; now waits for "
                        f"the {doing}\n  rank {rank}: issued {named(kind, tag)} there; now waits for the "
                        f"{theirs['waits'][2]}\n" + ADVICE, scope)
        key, k, their_doing = theirs["waits"]
        their_count = {g: (h[-1][0] if h else 0) for g, h in theirs["issued"].items()}
        if their_count.get(waiting.key, seq) < seq and issued_here.get(key, k) < k:
            explain()
            raise out_of_step(
                f"the ranks wait for each other, each in a collective the other has not issued:\n"
                f"  rank {board.rank}: waits for the {doing} (collective {seq} of its group)\n"
                f"  rank {rank}: waits for the {their_doing} (collective {k} of its group)\n" + ADVICE, scope)
