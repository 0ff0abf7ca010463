"""Where each rank is: the boundaries it passed, posted on the process group's store.

[Note: the rank board]
Every rank must run every unit (see [Note: order guard] in engine/comm/order_guard.py), so ranks in step pass
the same *boundaries* in the same order: the end of an evaluation loop, a ``generate()`` call's
start and end, the end of the process. Each rank posts each boundary it passes to the default
process group's store, as ``<prefix>/<rank>/<n>`` (its n-th boundary, a label such as "ended
validation") and ``<prefix>/<rank>/n``. That costs one store write per boundary (a few per epoch,
two per ``generate()``), nothing per collective.

A rank that waits long for a collective, or for the others at the end (see job_end.py), reads the
others' counts and compares (``RankBoard.divergence``):
- the same n-th boundary with another label: the ranks went different ways ("rank 0 entered
  generate() where rank 1 ended validation"), whatever else happens;
- another rank past a boundary this one has not reached, while this one waits in a collective:
  that rank has left the part of the program this collective belongs to ("rank 0 ended
  validation while rank 1 waited for ..."). A collective issued before a boundary is complete on
  the rank that issued it once it passes the boundary, so this is only believed after the wait has
  lasted ``LEFT_AFTER_S``, on two reads in a row;
- a rank behind is only slower: it may still arrive.
Boundaries a rank passes alone (joining ``Join``: see engine/join.py) are *notes*, shown in messages and
never compared. Without a process group, or with a store that cannot be read, the board is off:
nothing is posted and no divergence is found.

Reads cost one round trip per rank (a ``check`` for ranks not seen yet, then one ``multi_get``),
made only by a rank that has waited more than a slice of the watchdog (see [Note: hang watchdog]).
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Callable, Optional

import torch.distributed as dist

PREFIX = "zero_strategy/board"
LEFT_AFTER_S = 10.0
"""How long a wait must last, with another rank past a boundary, before that rank counts as gone."""

ADVICE = {
    "generate()": "at ZeRO stage 3 every rank must call generate() the same number of times, each with its own "
                  "inputs: the package turns synced_gpus on for Hugging Face models, so ranks that finish early keep "
                  "answering the others' gathers. Call it on every rank (not under `if trainer.is_global_zero:`), "
                  "and do not pass synced_gpus=False",
    "default": "every rank must run every unit: run evaluation, generation and each forward on every rank (each "
               "with its own data; work meant for one rank too, keeping that rank's result), and keep a loop's ranks "
               "in step with zero_strategy.Join (uneven batches) or zero_strategy.any_rank_busy (a decoding loop of "
               "your own)",
}


def advice_for(*labels: str) -> str:
    """What to do when ranks part at boundaries with these labels."""
    if any("generate()" in label for label in labels):
        return ADVICE["generate()"]
    return ADVICE["default"]


class RankBoard:
    """This rank's boundaries and notes on the store, and the others' as read back (see [Note: the rank board])."""

    def __init__(self, store: Optional[dist.Store], rank: int, world_size: int, group: object = None) -> None:
        self._store = store  # a store of its own (tests); None with ``group``: that group's, while it lasts
        self._group = weakref.ref(group) if group is not None else None  # not kept alive by the board
        self._gone = False  # a write failed: the store's host ended
        self.rank = rank
        self.world_size = world_size
        self.labels: list[str] = []  # this rank's boundaries, in order
        self._seen: set[int] = set()  # ranks that have posted a count
        self._suspect: Optional[tuple[int, int]] = None  # (rank, its count) seen past this rank at the last read
        self._lock = threading.Lock()

    @property
    def store(self) -> Optional[dist.Store]:
        """The store to post on, or None. The default group's store is looked up at each use, never kept:
        a reference held here would keep a destroyed group's TCP store serving on its port (a Hydra
        multirun's next job then meets the last job's store)."""
        if self._gone:
            return None
        if self._group is None:
            return self._store
        if not (dist.is_initialized() and dist.group.WORLD is self._group()):
            return None
        try:
            return dist.distributed_c10d._get_default_store()
        except Exception:  # no store we can read: the board is off
            return None

    @property
    def enabled(self) -> bool:
        return self.store is not None and self.world_size > 1

    def _key(self, rank: int, what: object) -> str:
        return f"{PREFIX}/{rank}/{what}"

    def mark(self, label: str) -> None:
        """This rank passed a boundary that every rank passes in the same order."""
        if not self.enabled:
            return
        with self._lock:
            self.labels.append(label)
            n = len(self.labels)
            try:
                self.store.set(self._key(self.rank, n), label)  # type: ignore[union-attr]
                self.store.set(self._key(self.rank, "n"), str(n))  # type: ignore[union-attr]
            except Exception:  # the store is gone (a peer that hosted it ended): nothing to tell anyone
                self._gone = True

    def note(self, text: str) -> None:
        """Where this rank is, for the others' messages only (never compared)."""
        if self.enabled:
            try:
                self.store.set(self._key(self.rank, "note"), text)  # type: ignore[union-attr]
            except Exception:
                self._gone = True

    # ---- the end of the process: see [Note: a failed rank fails the job] in frontend/job_end.py ----

    def post(self, what: str, text: str) -> None:
        """Post this rank's ``what`` ("end", "gone") as ``text``."""
        if self.enabled:
            try:
                self.store.set(self._key(self.rank, what), text)  # type: ignore[union-attr]
            except Exception:
                self._gone = True

    def posted(self, what: str) -> dict[int, str]:
        """The other ranks' ``what``, for those that posted it (raises when the store is gone)."""
        out = {}
        for r in range(self.world_size):
            if r != self.rank and self.store.check([self._key(r, what)]):  # type: ignore[union-attr]
                out[r] = self.store.get(self._key(r, what)).decode()  # type: ignore[union-attr]
        return out

    def exchange(self, what: str, text: str, wait_s: float) -> dict[int, str]:
        """Post this rank's ``what`` as ``text`` and read the other ranks', waiting at most ``wait_s``
        for all of them: the posts read by then (none when the board is off or the store gone)."""
        if not self.enabled:
            return {}
        self.post(what, text)
        deadline, posted = time.monotonic() + wait_s, {}
        while True:
            try:
                posted = self.posted(what)
            except Exception:  # the store is gone: what was read so far
                return posted
            if len(posted) >= self.world_size - 1 or time.monotonic() > deadline:
                return posted
            time.sleep(0.05)

    def _counts(self) -> dict[int, int]:
        others = [r for r in range(self.world_size) if r != self.rank]
        for r in others:
            if r not in self._seen and self.store.check([self._key(r, "n")]):  # type: ignore[union-attr]
                self._seen.add(r)
        seen = sorted(self._seen)
        values = self.store.multi_get([self._key(r, "n") for r in seen]) if seen else []  # type: ignore[union-attr]
        counts = {r: 0 for r in others}
        counts.update({r: int(v) for r, v in zip(seen, values)})
        return counts

    def _label(self, rank: int, n: int) -> str:
        return self.store.get(self._key(rank, n)).decode()  # type: ignore[union-attr]

    def _note(self, rank: int) -> str:
        key = self._key(rank, "note")
        if self.store.check([key]):  # type: ignore[union-attr]
            return f" ({self.store.get(key).decode()})"  # type: ignore[union-attr]
        return ""

    def divergence(self, waiting_for: Optional[str] = None, waited_s: float = 0.0,
                   sure: bool = False) -> Optional[str]:
        """Why the ranks are not in step, or None when nothing shows they are not. ``waiting_for``: the
        collective this rank has waited ``waited_s`` for (None: only a parting of ways counts);
        ``sure``: it failed, so one read of a rank gone past it is enough."""
        if not self.enabled:
            return None
        try:
            return self._divergence(waiting_for, waited_s, sure)
        except Exception:  # the store is gone or slow: nothing to say
            return None

    def _divergence(self, waiting_for: Optional[str], waited_s: float, sure: bool) -> Optional[str]:
        for rank, text in sorted(self.posted("end").items()):
            if text.startswith("failed"):
                return f"rank {rank} {text}"
        mine = len(self.labels)
        suspect = None
        for rank, theirs in self._counts().items():
            both = min(mine, theirs)
            if both and self._label(rank, both) != self.labels[both - 1]:
                first = next(i for i in range(1, both + 1) if self._label(rank, i) != self.labels[i - 1])
                theirs_label, my_label = self._label(rank, first), self.labels[first - 1]
                return (f"rank {rank} {theirs_label}{self._note(rank)} where rank {self.rank} {my_label} (boundary "
                        f"{first} of each): the ranks went different ways. To fix it: "
                        f"{advice_for(theirs_label, my_label)}.")
            if theirs > mine and waiting_for is not None and suspect is None:
                suspect = (rank, theirs)
        if suspect is None or waited_s < LEFT_AFTER_S:
            self._suspect = None
            return None
        confirmed, self._suspect = self._suspect == suspect, suspect
        if not (confirmed or sure):
            return None
        rank, theirs = suspect
        left = self._label(rank, mine + 1)
        where = f"; it last {self.labels[-1]}" if self.labels else ""
        return (f"rank {rank} {left}{self._note(rank)} while rank {self.rank} waited for the {waiting_for} "
                f"({waited_s:.0f} s{where}): rank {rank} will not join it. To fix it: "
                f"{advice_for(left, *self.labels[-1:])}.")

    def describe(self) -> str:
        """Every rank's last boundary, for a message (empty when the board is off or unreadable)."""
        if not self.enabled:
            return ""
        try:
            counts = {self.rank: len(self.labels), **self._counts()}
            lines = []
            for rank in sorted(counts):
                n = counts[rank]
                last = (self.labels[-1] if rank == self.rank else self._label(rank, n)) if n else "passed no boundary"
                lines.append(f"  rank {rank}: {last} (boundary {n}){self._note(rank)}")
            return "Where each rank was:\n" + "\n".join(lines)
        except Exception:
            return ""


_board: Optional[RankBoard] = None
_board_group: Callable[[], object] = lambda: None  # a weak reference to the group of `_board`


def board() -> RankBoard:
    """This process's board over the default process group (an inactive one without a group)."""
    global _board, _board_group
    group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if _board is None or _board_group() is not group:
        if group is None:
            _board = RankBoard(None, 0, 1)
        else:
            _board = RankBoard(None, dist.get_rank(), dist.get_world_size(), group=group)
        _board_group = weakref.ref(group) if group is not None else lambda: None
    return _board


def mark(label: str) -> None:
    """This rank passed a boundary every rank passes (see [Note: the rank board])."""
    board().mark(label)

