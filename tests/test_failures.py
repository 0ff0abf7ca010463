"""Ranks that disagree end every process, quickly, with a message naming the cause (2 CPU processes).

The cases run in tests/scripts/diverge_run.py, in processes of their own, since they end them: the
Lightning cases' two ranks forked from the tests' fork server (the message is the subject, not the
launch: see [Note: ranks forked from a loaded process] in tests/cli_runs.py), the engine cases'
started by the test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from zero_strategy.engine.diagnose.watchdog import HANG_EXIT_CODE, SIGTERM_EXIT_CODE

from .cli_runs import run_at_once
from .distributed import free_port

SCRIPT = Path(__file__).parent / "scripts" / "diverge_run.py"


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for var in ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


DIVERGING = {
    # rank 1 skips blocks.1 at the third step: rank 0 is in blocks.1 prefetching blocks.2, rank 1
    # already starts blocks.2
    "skip": ("rank 0: prefetching 'blocks.2' while starting the forward of 'blocks.1'",
             "rank 1: starting the forward of 'blocks.2' (the unit it ran before: 'blocks.0')"),
    # rank 1 runs blocks.0 twice
    "twice": ("rank 0: prefetching 'blocks.2' while starting the forward of 'blocks.1'",
              "rank 1: starting the forward of 'blocks.0' (the unit it ran before: 'blocks.0')"),
}


@pytest.fixture(scope="module")
def diverged() -> dict[str, tuple[subprocess.CompletedProcess, float]]:
    """Both cases at once (each a Lightning fit on 2 forked ranks with a port of its own): case ->
    (the finished ranks, seconds until both ended)."""
    return run_at_once({case: ([sys.executable, str(SCRIPT), case], _env(), None, 2) for case in DIVERGING},
                       timeout=100)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(DIVERGING))
def test_a_rank_running_other_units_stops_every_rank_naming_what_each_ran(diverged, case):
    rank0, rank1 = DIVERGING[case]
    proc, elapsed = diverged[case]
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert elapsed < 60, f"took {elapsed:.0f} s"
    assert "UnitOrderError: ZeRO stage 3: the ranks gathered different units at the same point" in out, out[-3000:]
    assert rank0 in out and rank1 in out, out[-3000:]
    assert "(pass 3, gather" in out  # the third training step
    assert "Run every unit on every rank" in out
    # the module inside which the ranks part (the LightningModule), to name in leaf_modules
    assert "Here that is 'the model itself': leaf_modules=['Net']" in out, out[-3000:]


def _start_engine_pair(case: str) -> list[subprocess.Popen]:
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {**_env(), "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), case], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def _wait_for_line(proc: subprocess.Popen, line: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = proc.stdout.readline()  # type: ignore[union-attr]
        if line in text:
            return
        if proc.poll() is not None:
            break
    raise AssertionError(f"never printed {line!r}: {proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]


@pytest.mark.timeout(120)
def test_a_collective_that_nobody_joins_ends_the_process_saying_which():
    procs = _start_engine_pair("hang")  # collective_timeout=3
    try:
        _wait_for_line(procs[0], "rank 0 waiting", 60)
        start = time.monotonic()
        code = procs[0].wait(timeout=30)
        assert code == HANG_EXIT_CODE
        assert 2.5 < time.monotonic() - start < 10
        err = procs[0].stderr.read()  # type: ignore[union-attr]
        assert "rank 0 waited more than collective_timeout=3 s for the all-reduce that rank 1 never joins" in err
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.timeout(120)
def test_sigterm_ends_a_process_waiting_in_a_collective():
    procs = _start_engine_pair("sigterm")  # collective_timeout=600: only SIGTERM can end the wait
    try:
        _wait_for_line(procs[0], "rank 0 waiting", 60)
        time.sleep(1.0)  # well inside the wait
        start = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(timeout=30) == SIGTERM_EXIT_CODE
        assert time.monotonic() - start < 5
        err = procs[0].stderr.read()  # type: ignore[union-attr]
        assert "rank 0 received SIGTERM while waiting for the all-reduce that rank 1 never joins" in err
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_check_unit_order_every_is_accepted_ignored_and_warned_about_and_unit_order_wait_checked():
    from zero_strategy import ZeroConfig

    with pytest.warns(FutureWarning, match="check_unit_order_every=10 is deprecated and ignored"):
        ZeroConfig(stage=3, check_unit_order_every=10)
    with pytest.raises(ValueError, match="check_unit_order_every=0 must be a positive integer or None"):
        ZeroConfig(stage=3, check_unit_order_every=0)
    with pytest.raises(ValueError, match="unit_order_wait=0 must be a positive number of seconds"):
        ZeroConfig(stage=3, unit_order_wait=0)
    with pytest.raises(ValueError, match="unit_order_wait=30 must be below collective_timeout=20"):
        ZeroConfig(stage=3, unit_order_wait=30, collective_timeout=20)
