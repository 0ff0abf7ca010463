"""Run the console scripts as a user would, in a fresh process, and read what a run leaves behind."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

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


def run(cmd: list[str], cwd: Path, timeout: float = 240, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, \
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc


def run_at_once(commands: dict[str, tuple[list[str], dict[str, str], Optional[Path]]],
                timeout: float) -> dict[str, tuple[subprocess.CompletedProcess, float]]:
    """Start every command (name -> argv, environment, folder) together, each with a MASTER_PORT of
    its own so that their launches cannot meet; name -> (the finished process, seconds from the start
    until it was seen finished). Much of a Lightning launch is importing on one core, which the other
    runs fill. Whatever still runs at the deadline is killed, and the timeout raised."""
    from .distributed import free_port

    start = time.monotonic()
    procs = {name: subprocess.Popen(cmd, cwd=cwd, env={**env, "MASTER_PORT": str(free_port())}, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, (cmd, env, cwd) in commands.items()}
    try:
        done = {}
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=max(1.0, start + timeout - time.monotonic()))
            done[name] = (subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr),
                          time.monotonic() - start)
        return done
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def zero_train(cwd: Path, *overrides: str, check: bool = True, timeout: float = 240) -> subprocess.CompletedProcess:
    return run([script("zero-train"), *overrides], cwd, timeout, check)


def summaries(run_dir: Path, world_size: int = 2) -> list[dict]:
    """summary_rank<r>.json of every rank: present means that rank finished in this very folder."""
    return [json.loads((run_dir / f"summary_rank{r}.json").read_text()) for r in range(world_size)]


def metric_rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "csv" / "version_0" / "metrics.csv") as f:
        return list(csv.DictReader(f))
