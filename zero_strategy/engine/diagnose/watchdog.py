"""A hung collective ends the process, saying what it waited for.

[Note: hang watchdog]
When ranks disagree about what comes next (one skipped a module, one is still writing a file),
the others wait in a collective that no peer will join. gloo would only give up at the process
group's timeout (30 minutes by default) with a message that names no cause, and a process blocked
in C++ does not even run Python's SIGTERM handler, so the job cannot be stopped cleanly either.

So the engine waits for its gloo collectives in slices of ``POLL_S`` seconds. A wait that lasts
longer than ``limit_s`` prints, on this rank, which collective it was (the unit or gradient
segment, the phase and pass) and how long it waited, and ends the process with exit code
``HANG_EXIT_CODE``; every rank of a hung job does the same with its own collective, or sees its
peer's connection close and raises naming its collective. Between slices Python runs signal
handlers: ``install_sigterm_handler`` makes SIGTERM that arrives during such a wait end the process
(exit 143) if the collective does not complete within the slice, and otherwise hands the signal to
the handler that was there before, once the wait is over (Lightning's own handler issues a
collective, which must not run in the middle of another).

While it waits, a rank reads where the others are (see [Note: the rank board] in engine/diagnose/rank_board.py):
when another rank has gone a different way (entered ``generate()`` where this one ended
validation) or has left the part of the program the collective belongs to (ended validation, or
its process, while this one still gathers), the wait ends at once with a ``CollectiveError``
saying so and what to do, instead of at the limit or with gloo's "Connection closed by peer". And
when another rank of the same engine found the ranks out of step (``out_of_step``: its order guard,
the step's tally, or collectives of different kinds) the wait ends with that ``UnitOrderError``:
under hybrid sharding the ranks of another shard group wait in a collective across the groups,
which the ones that found it will never join, and would otherwise wait for ``collective_timeout``.

NCCL collectives are not waited for on the host (``wait()`` only orders CUDA streams), so they are
left to NCCL's own watchdog, which aborts at the process group's timeout.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Optional

import torch.distributed as dist

from . import rank_board

POLL_S = 1.0
"""A slice of a watched wait: how late a SIGTERM may be handled, and the limit's resolution."""

HANG_EXIT_CODE = 124
"""Exit code of a process the watchdog ended (as ``timeout(1)`` uses)."""

SIGTERM_EXIT_CODE = 128 + signal.SIGTERM


class CollectiveError(RuntimeError):
    """A collective failed (a peer's connection closed, the process group timed out)."""


class UnitOrderError(RuntimeError):
    """Ranks ran different stage-3 units, issued different collectives at the same point, or reached
    a step after different work (see [Note: the step's tally] in engine/diagnose/tally.py)."""


OUT_OF_STEP = "out_of_step"
"""The rank board's post of a rank that found the ranks out of step: "<scope>|<message>"."""


def out_of_step(message: str, scope: Optional[str]) -> UnitOrderError:
    """``UnitOrderError(message)``, posted first on the rank board for the ranks of ``scope`` (an
    engine's group: ``Collectives.scope``) that wait in other collectives (see [Note: hang watchdog])."""
    if scope is not None:
        rank_board.board().post(OUT_OF_STEP, f"{scope}|{message}")
    return UnitOrderError(message)


_waiting = threading.local()  # .what: the collective the main thread waits for now (None: none)
_deferred_signal: list[tuple[int, Any]] = []  # SIGTERM received during a wait, for the previous handler
_previous_handler: Any = None


class Watchdog:
    """Waits for one process group's collectives with a time limit (see [Note: hang watchdog])."""

    def __init__(self, limit_s: Optional[float], rank: int, backend: str, scope: Optional[str] = None) -> None:
        self.limit_s = limit_s
        self.rank = rank
        self.scope = scope  # whose ``out_of_step`` posts end a wait (None: nobody's)
        self.watched = limit_s is not None and backend == "gloo"

    def wait(self, work: dist.Work, what: Callable[[], str],
             waiting: Optional[Callable[[float], None]] = None) -> None:
        """Wait for ``work``; ``what()`` describes it if the wait fails or outlasts the limit.
        ``waiting(seconds waited)`` runs at each slice of a watched wait (it may raise: the order guard
        compares on the store what the ranks gather, see [Note: order guard] in engine/comm/order_guard.py)."""
        if not self.watched:
            work.wait()
            return
        start = time.monotonic()
        _waiting.what = what
        try:
            while True:
                try:
                    work.wait(timeout=datetime.timedelta(seconds=POLL_S))
                    break
                except RuntimeError as err:
                    if "operation timed out" not in str(err).lower():  # not our slice ending: a real failure
                        raise CollectiveError(self._failed(what, err, time.monotonic() - start)) from err
                waited = time.monotonic() - start
                if waiting is not None:
                    waiting(waited)
                self._raise_if_out_of_step(what)
                if _deferred_signal:
                    self._end(what, waited, "received SIGTERM while waiting", SIGTERM_EXIT_CODE)
                cause = rank_board.board().divergence(what(), waited)
                if cause is not None:
                    raise CollectiveError(f"rank {self.rank}: {cause}")
                if waited >= self.limit_s:  # type: ignore[operator]
                    self._end(what, waited, f"waited more than collective_timeout={self.limit_s:g} s",
                              HANG_EXIT_CODE)
        finally:
            _waiting.what = None
        if _deferred_signal:
            _run_deferred_signal()

    def _raise_if_out_of_step(self, what: Callable[[], str]) -> None:
        """Raise the UnitOrderError another rank of this scope posted (``out_of_step``), if one did."""
        board = rank_board.board()
        if self.scope is None or not board.enabled:
            return
        try:
            posted = board.posted(OUT_OF_STEP)
        except Exception:  # the store is gone or slow: the watchdog goes on
            return
        for rank, text in sorted(posted.items()):
            scope, _, message = text.partition("|")
            if scope == self.scope:
                raise UnitOrderError(f"rank {self.rank}: waited for the {what()}, which will not complete: rank {rank} "
                                     f"found the ranks out of step:\n{message}")

    def _failed(self, what: Callable[[], str], err: Exception, waited: float) -> str:
        """The message of a collective that failed: gloo's error, and why, when the board knows."""
        board = rank_board.board()
        message = f"rank {self.rank}: the {what()} failed: {err}"
        cause = board.divergence(what(), max(waited, rank_board.LEFT_AFTER_S), sure=True)
        try:
            failed = {r: text for r, text in board.posted("end").items() if text != "ok"}
        except Exception:
            failed = {}
        if cause is not None:
            message += f"\nThe cause: {cause}"
        for r, text in sorted(failed.items()):
            message += f"\nrank {r} had ended: {text}"
        where = board.describe() if cause is None and not failed else ""
        return message + (f"\n{where}" if where else "")

    def _end(self, what: Callable[[], str], waited: float, why: str, code: int) -> None:
        message = (f"zero_strategy: rank {self.rank} {why} for the {what()} ({waited:.0f} s). The other ranks did "
                   "not join this collective: they are waiting in a different one, or stopped. At stage 3 every rank "
                   "must run the same modules in the same order; see each rank's message for where it was. Ending "
                   f"this process (exit code {code}).")
        print(message, file=sys.stderr, flush=True)
        sys.stdout.flush()
        rank_board.board().post("end", f"failed: {message}")  # for the ranks that wait at the end (job_end.py)
        os._exit(code)


def _on_sigterm(signum: int, frame: Any) -> None:
    if getattr(_waiting, "what", None) is not None:
        _deferred_signal.append((signum, frame))  # the wait loop ends the process or hands it on
        return
    _call_previous(signum, frame)


def _run_deferred_signal() -> None:
    signum, frame = _deferred_signal.pop()
    _deferred_signal.clear()
    _call_previous(signum, frame)


def _call_previous(signum: int, frame: Any) -> None:
    previous = _previous_handler
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:  # the default action: end the process as SIGTERM would
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def install_sigterm_handler() -> None:
    """Route SIGTERM through the watchdog (see [Note: hang watchdog]); call it after other code (such
    as Lightning's Trainer) has installed its own handler, which is kept and called. Main thread only;
    a no-op elsewhere, and when installed already."""
    global _previous_handler
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm:
        return
    _previous_handler = current
    signal.signal(signal.SIGTERM, _on_sigterm)
