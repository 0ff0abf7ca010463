"""A rank that fails fails the job, and no rank is left running.

[Note: a failed rank fails the job]
Lightning's default launch runs rank 0 as the main process and the other ranks as its children,
watched by a thread that polls them every 5 s; when rank 0's script returns, the process ends with
status 0 and the thread with it, so a child that fails after that (or fails while rank 0 tears
down) goes unnoticed. torchrun and srun see every process's status, but nothing names the rank
whose error ended the job. So, for a job of several ranks, each process of this package's front
ends (``watch_the_job``, called once the process group exists):
- on an exception that ends it (``sys.excepthook``), prints ``zero_strategy: rank R failed: ...``
  and posts it on the process group's store, where waiting ranks read it (see [Note: the rank board] in
  engine/diagnose/rank_board.py: a rank waiting in a collective raises at once, naming it);
- at its end (``atexit``), posts that it ended and waits for every other rank to end too. While it
  waits it stops, with exit status 1 and a message naming the rank and its error, when another rank
  posts a failure, when a child process of the launch exits non-zero without posting one, when the
  ranks went different ways (one ended validation where another entered ``generate()``), or, with
  a limit (``collective_timeout``), when a rank has not ended that long after this one did. Rank 0,
  which hosts the store under Lightning's launch, ends last: once every rank has posted that it is
  going, and its children have exited (their exit codes checked), or are killed after
  ``GRACE_S`` when the job failed.
A rank in step waits at its end only for as long as the slowest rank takes to finish.

Rank 0 speaks first. Under Lightning's default launch the process that launched a node's other
ranks (rank 0 on the first node) runs a thread that kills it (SIGKILL) within 5 s of a child
exiting non-zero, so on a loaded machine a child that stopped with its message could take the
launcher's with it before the launcher had printed why it stopped (seen: "rank 1 ended validation
where rank 0 entered generate()" missing from rank 0's side). So a launcher posts ``watched`` when
it starts watching, and ``told`` once it has printed what ended the job for it (or found nothing
to print); a child of a launcher that posted ``watched``, ending with a failure or a problem, waits
up to ``GRACE_S`` for its ``told`` before its process exits. Under torchrun, srun or a pool of
workers nobody posts ``watched`` and nobody waits.
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys
import time
from typing import Callable, Optional, Sequence

from ..engine.diagnose import rank_board

GRACE_S = 10.0
"""After a failure, how long rank 0 waits for its children to end by themselves before killing them."""

POLL_S = 0.2
"""How often a rank waiting at its end reads the store."""

Children = Callable[[], Sequence[subprocess.Popen]]
"""The child processes this process launched (Lightning's popen launch: local ranks 1, 2, ...)."""

_state: dict = {"installed": False, "failure": None, "children": None, "first_child": 1, "launcher": 0, "limit_s": None,
                 "previous_hook": None}


def watch_the_job(children: Optional[Children] = None, first_child_rank: int = 1,
                  limit_s: Optional[float] = None) -> None:
    """Install the end-of-job checks of [Note: a failed rank fails the job] in this process, once (later
    calls only update the arguments): ``children`` gives the launch's child processes, whose global
    ranks are ``first_child_rank`` and on; ``limit_s`` bounds the wait at the end for ranks that have
    not ended (None: no bound). A no-op without a process group of several ranks."""
    board = rank_board.board()
    if not board.enabled:
        return
    _state["launcher"] = first_child_rank - 1  # this node's launching process (see "Rank 0 speaks first")
    if children is not None and list(children()):  # the front end that launched them (a later one has none)
        _state["children"], _state["first_child"] = children, first_child_rank
        board.post("watched", "yes")
    _state["limit_s"] = limit_s
    if _state["installed"]:
        return
    _state["installed"] = True
    _state["previous_hook"] = sys.excepthook
    sys.excepthook = _on_uncaught
    atexit.register(_at_exit)


def _on_uncaught(kind, value, tb) -> None:
    text = f"{kind.__name__}: {value}"
    _state["failure"] = text
    board = rank_board.board()
    print(f"zero_strategy: rank {board.rank} failed: {text} (its traceback follows)", file=sys.stderr, flush=True)
    board.post("end", f"failed: {text}")
    if _state["children"] is not None:
        board.post("told", "yes")
    (_state["previous_hook"] or sys.__excepthook__)(kind, value, tb)


def _at_exit() -> None:
    board = rank_board.board()
    if not board.enabled:
        return
    failure = _state["failure"]
    if failure is None:
        board.mark("ended its process")
        board.post("end", "ok")
    problem = _wait_for_the_others(board, failure is not None)
    board.post("gone", "yes")
    if problem is not None and failure is None:
        _say(board, problem)
    if _state["children"] is not None:
        board.post("told", "yes")
    if board.rank == 0:
        later = _end_children(board, problem, failed=failure is not None or problem is not None)
        if problem is None and later is not None and failure is None:
            _say(board, later)
            problem = later
    elif problem is not None or failure is not None:
        _wait_for_the_launcher_to_tell(board)
    if problem is not None and failure is None:
        sys.stdout.flush()
        logging.shutdown()
        os._exit(1)


def _say(board: rank_board.RankBoard, problem: str) -> None:
    print(f"zero_strategy: rank {board.rank}: the job failed: {problem.rstrip('.')}. Ending this process with exit "
          "status 1.", file=sys.stderr, flush=True)


def _wait_for_the_launcher_to_tell(board: rank_board.RankBoard) -> None:
    """Up to ``GRACE_S`` for this node's launching process, if it watches its children, to print what
    ended the job (see "Rank 0 speaks first" in the Note)."""
    launcher = _state["launcher"]
    deadline = time.monotonic() + GRACE_S
    try:
        if launcher == board.rank or launcher not in board.posted("watched"):
            return
        while time.monotonic() < deadline and launcher not in board.posted("told"):
            time.sleep(POLL_S)
    except Exception:  # the store is gone: so is rank 0
        return


def _wait_for_the_others(board: rank_board.RankBoard, failed: bool) -> Optional[str]:
    """None once every rank has ended well; else what went wrong. A rank that failed itself waits for
    nothing (rank 0 still waits for its children in ``_end_children``)."""
    if failed:
        return None
    start = time.monotonic()
    limit = _state["limit_s"]
    while True:
        try:
            ended = board.posted("end")
        except Exception:
            return "rank 0's process ended before this one could end (its store is gone): see its output"
        bad = {r: text for r, text in ended.items() if text != "ok"}
        if bad:
            return "; ".join(f"rank {r} {text}" for r, text in sorted(bad.items()))
        if len(ended) == board.world_size - 1:
            return None
        dead = _dead_children(set(ended))
        if dead:
            return dead
        cause = board.divergence()
        if cause is not None:
            return cause
        waited = time.monotonic() - start
        if limit is not None and waited > limit:
            missing = sorted(set(range(board.world_size)) - set(ended) - {board.rank})
            return (f"ranks {missing} had not ended {waited:.0f} s after rank {board.rank} did (collective_timeout="
                    f"{limit:g} s)\n{board.describe()}")
        time.sleep(POLL_S)


def _children() -> list[tuple[int, subprocess.Popen]]:
    getter = _state["children"]
    procs = list(getter()) if getter is not None else []
    return [(rank, proc) for rank, proc in enumerate(procs, start=_state["first_child"])]


def _dead_children(ended: set[int]) -> Optional[str]:
    """A child of the launch that exited non-zero without posting why."""
    for rank, proc in _children():
        code = proc.poll()
        if code not in (None, 0) and rank not in ended:
            return f"rank {rank} (pid {proc.pid}) exited with status {code} without a message (killed, or it crashed)"
    return None


def _end_children(board: rank_board.RankBoard, problem: Optional[str], failed: bool) -> Optional[str]:
    """Rank 0 ends last: wait for the other ranks to go and for the launch's children to exit, checking
    their exit codes; after a failure, kill those still running ``GRACE_S`` later."""
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:
        try:
            gone = board.posted("gone")
        except Exception:
            gone = {}
        children = _children()
        if len(gone) == board.world_size - 1 and all(proc.poll() is not None for _, proc in children):
            break
        time.sleep(POLL_S)
    for rank, proc in _children():
        if proc.poll() is None:
            if not failed:
                try:  # ended well: its exit is a moment away
                    proc.wait(timeout=GRACE_S)
                    continue
                except subprocess.TimeoutExpired:
                    pass
            print(f"zero_strategy: rank 0: killing rank {rank} (pid {proc.pid}), still running after the job "
                  f"{'failed' if failed else 'ended'}", file=sys.stderr, flush=True)
            proc.kill()
            proc.wait()
        elif proc.returncode != 0 and problem is None:
            problem = f"rank {rank} (pid {proc.pid}) exited with status {proc.returncode}"
    return problem
