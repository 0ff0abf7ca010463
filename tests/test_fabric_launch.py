"""A Fabric script with strategy="zero_stage_3" launched the two ways users launch it: fabric.launch()
(which starts the other rank) and torchrun (which starts both). Both runs must see 2 ranks, train the
same, and serve Fabric's collectives (tests/scripts/fabric_run.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from .cli_runs import EARLY, Commands, assert_succeeded, take

SCRIPT = Path(__file__).parent / "scripts" / "fabric_run.py"
LAUNCH_VARS = ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
               "MASTER_PORT")
LAUNCH = "fabric_launches"  # the early launch's name (see [Note: launches started early] in tests/cli_runs.py)


def _commands(base: Path) -> Commands:
    """Both launches, each writing in ``base / how``, each finding a free port when it starts: Fabric's
    launcher as Lightning does, torchrun with ``--standalone``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONWARNINGS"] = "ignore"
    commands = {}
    for how in ("launch", "torchrun"):
        (base / how).mkdir()
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] \
            if how == "torchrun" else [sys.executable]
        commands[how] = ([*launcher, str(SCRIPT), "--out", str(base / how)], env, base)
    return commands


EARLY[LAUNCH] = (__name__, _commands)  # started at collection: see [Note: launches started early] in tests/cli_runs.py


def _results(done: dict, base: Path, how: str) -> list[dict]:
    assert_succeeded(done[how][0])
    return [torch.load(base / how / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.timeout(300)
def test_fabric_launch_and_torchrun_run_the_same_loop(tmp_path_factory):
    # both at once (much of a launch is importing Lightning on one core), started at collection
    done, base = take(LAUNCH, lambda name: tmp_path_factory.mktemp(name, numbered=False), timeout=200)
    launched, torchrun = (_results(done, base, how) for how in ("launch", "torchrun"))
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
