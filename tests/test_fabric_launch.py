"""A Fabric script with strategy="zero_stage_3" launched the two ways users launch it: fabric.launch()
(which starts the other rank) and torchrun (which starts both). Both runs must see 2 ranks, train the
same, and serve Fabric's collectives (tests/scripts/fabric_run.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .distributed import free_port

SCRIPT = Path(__file__).parent / "scripts" / "fabric_run.py"
LAUNCH_VARS = ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
               "MASTER_PORT")


def _launch(out: Path, torchrun: bool) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(PYTHONWARNINGS="ignore", MASTER_PORT=str(free_port()))
    if torchrun:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   "--master-port", env.pop("MASTER_PORT"), str(SCRIPT), "--out", str(out)]
    else:
        command = [sys.executable, str(SCRIPT), "--out", str(out)]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc  # type: ignore[return-value]


def _results(proc, out: Path) -> list[dict]:
    stdout, stderr = proc.communicate(timeout=200)
    assert proc.returncode == 0, f"{proc.args}:\n{stdout[-3000:]}\n{stderr[-6000:]}"
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.timeout(300)
def test_fabric_launch_and_torchrun_run_the_same_loop(tmp_path):
    # both at once, each on a port of its own: much of a launch is importing Lightning on one core
    runs = {how: _launch(tmp_path / how, torchrun=how == "torchrun") for how in ("launch", "torchrun")}
    launched, torchrun = (_results(runs[how], tmp_path / how) for how in ("launch", "torchrun"))
    for ranks in (launched, torchrun):
        for r, result in enumerate(ranks):
            assert result["strategy"] == "ZeroFabricStrategy" and result["world_size"] == 2
            assert result["mean"] == 0.5 and result["gathered"] == [0, 1] and result["source"] == "from rank 1"
            assert result["reloaded_losses"] == ranks[0]["losses"]  # extra objects: rank 0's, as DDP saves them
        for name, value in ranks[0]["weights"].items():
            assert torch.equal(value, ranks[1]["weights"][name]), name
    for r in range(2):  # the same loop, whoever started the processes
        assert torchrun[r]["losses"] == launched[r]["losses"]
        for name, value in launched[r]["weights"].items():
            assert torch.equal(torchrun[r]["weights"][name], value), name
