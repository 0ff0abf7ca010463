"""Run the console scripts as a user would, in a fresh process, and read what a run leaves behind."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

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


def zero_train(cwd: Path, *overrides: str, check: bool = True, timeout: float = 240) -> subprocess.CompletedProcess:
    return run([script("zero-train"), *overrides], cwd, timeout, check)


def summaries(run_dir: Path, world_size: int = 2) -> list[dict]:
    """summary_rank<r>.json of every rank: present means that rank finished in this very folder."""
    return [json.loads((run_dir / f"summary_rank{r}.json").read_text()) for r in range(world_size)]


def metric_rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "csv" / "version_0" / "metrics.csv") as f:
        return list(csv.DictReader(f))
