"""Run the console scripts as a user would, in a fresh process, and read what a run leaves behind."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

# variables a launcher sets: inherited, they would make zero-train believe it is a launched rank
LAUNCH_VARS = ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
               "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED")


def script(name: str) -> str:
    """The installed console script: next to this interpreter (pip puts it there), else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    assert found, f"console script {name} is not installed; run `pip install -e \".[app]\"`"
    return found


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONWARNINGS"] = "ignore"
    return env


def assert_succeeded(proc: subprocess.CompletedProcess) -> None:
    """The command exited 0; else the failure shows the command and the ends of what it printed."""
    assert proc.returncode == 0, \
        f"{' '.join(map(str, proc.args))} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"


def run(cmd: list[str], cwd: Path, timeout: float = 240, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=timeout)
    if check:
        assert_succeeded(proc)
    return proc


Commands = dict[str, tuple[list[str], dict[str, str], Optional[Path]]]
"""name -> argv, environment, folder."""


@contextlib.contextmanager
def started(commands: Commands) -> Iterator[dict[str, subprocess.Popen]]:
    """Start every command together, each with a MASTER_PORT of its own so that their launches
    cannot meet; name -> the running process. Much of a Lightning launch is importing on one core,
    which other work fills: run it inside the ``with``, then ``finish``. Whatever still runs when the
    ``with`` ends is killed."""
    from .distributed import free_port

    procs = {name: subprocess.Popen(cmd, cwd=cwd, env={**env, "MASTER_PORT": str(free_port())}, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, (cmd, env, cwd) in commands.items()}
    try:
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def finish(procs: dict[str, subprocess.Popen], start: float, timeout: float
           ) -> dict[str, tuple[subprocess.CompletedProcess, float]]:
    """Wait for ``started`` processes until ``timeout`` seconds after ``start`` (a ``time.monotonic()``,
    raising the timeout past it); name -> (the finished process, seconds from ``start`` until it was
    seen finished)."""
    done = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=max(1.0, start + timeout - time.monotonic()))
        done[name] = (subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr),
                      time.monotonic() - start)
    return done


def run_at_once(commands: Commands, timeout: float) -> dict[str, tuple[subprocess.CompletedProcess, float]]:
    """Run every command together (see ``started``) and wait for all (see ``finish``)."""
    start = time.monotonic()
    with started(commands) as procs:
        return finish(procs, start, timeout)


def zero_train(cwd: Path, *overrides: str, check: bool = True, timeout: float = 240) -> subprocess.CompletedProcess:
    return run([script("zero-train"), *overrides], cwd, timeout, check)


def summaries(run_dir: Path, world_size: int = 2) -> list[dict]:
    """summary_rank<r>.json of every rank: present means that rank finished in this very folder."""
    return [json.loads((run_dir / f"summary_rank{r}.json").read_text()) for r in range(world_size)]


def metric_rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "csv" / "version_0" / "metrics.csv") as f:
        return list(csv.DictReader(f))
