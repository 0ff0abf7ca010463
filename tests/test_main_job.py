"""The README's set-up commands as written, and the example projects with small settings."""

from __future__ import annotations

import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from .cli_runs import EARLY, Commands, assert_succeeded, clean_env, script, summaries, take

ROOT = Path(__file__).resolve().parents[1]


def setup_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Set-up", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_readme_setup_commands_are_install_then_main_job_then_pytest():
    first, second = setup_commands()
    steps = [s.strip() for s in first.split("&&")]
    assert steps[0] == "python -m pip install torch==2.13.0"
    assert steps[1] == 'python -m pip install -e ".[test]"'
    assert shlex.split(steps[-1])[0] == "zero-train"
    assert second == "python -m pytest"


EXAMPLES = {
    # example: (small settings, what it must print)
    "mlp_classifier": (["--max-steps", "60"], r"validation accuracy: (0\.\d+)", 0.3),  # chance 0.1
    "bert_classifier": (["--max-steps", "150"], r"validation accuracy: (0\.\d+)", 0.6),  # chance 0.5
    "gpt2_lm": (["--max-steps", "30", "--seq-len", "64", "--batch-size", "8"], r"validation loss: (\d+\.\d+)", None),
}
MAIN_JOB = "main_job"  # the README's (that each preset takes DDP's steps: tests/test_cli.py's multirun)
LAUNCH = "main_job_and_examples"  # the early launch's name (see [Note: launches started early])


def _commands(base: Path) -> Commands:
    """The README's main job and every example, each in a folder of its own under ``base``."""
    folders = {name: base / name for name in [MAIN_JOB, *EXAMPLES]}
    for folder in folders.values():
        folder.mkdir()
    main_job = shlex.split([s.strip() for s in setup_commands()[0].split("&&")][-1])
    # the README's exact arguments; only the length is capped (the full run takes about 1.5 minutes)
    commands = {MAIN_JOB: ([script(main_job[0]), *main_job[1:], "trainer.max_steps=20",
                            f"hydra.run.dir={folders[MAIN_JOB] / 'run'}"], clean_env(), folders[MAIN_JOB])}
    # the examples' 2 ranks are forked (see [Note: ranks forked from a loaded process] in tests/cli_runs.py)
    commands.update({example: ([sys.executable, str(ROOT / "examples" / example / "train.py"), *args], clean_env(),
                               folders[example], 2) for example, (args, _, _) in EXAMPLES.items()})
    return commands


EARLY[LAUNCH] = (__name__, _commands)  # started at collection: see [Note: launches started early]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """The README's main job and every example, run at once, each in its own folder: a run spends
    much of its time importing Lightning and starting its second rank, on one core, which the others'
    training fills; started at collection (see [Note: launches started early] in tests/cli_runs.py).
    name -> (the finished process, its folder)."""
    done, base = take(LAUNCH, lambda name: tmp_path_factory.mktemp(name, numbered=False), timeout=400)
    return {name: (proc, base / name) for name, (proc, _) in done.items()}


@pytest.mark.timeout(420)
def test_readme_main_job_as_written_with_a_step_cap(runs):
    proc, folder = runs[MAIN_JOB]
    assert_succeeded(proc)
    ranks = summaries(folder / "run")
    mem = ranks[0]["memory"]
    assert (mem["stage"], mem["num_params"], ranks[0]["world_size"]) == (2, 842_496, 2)  # small GPT, ZeRO-2
    assert ranks[0]["metrics"]["val/loss"] < math.log(256) - 1  # well below guessing a byte uniformly
    assert ranks[0]["param_digest"] == ranks[1]["param_digest"]
    assert "data=stdlib" in proc.stdout and "Final metrics" in proc.stdout


@pytest.mark.timeout(420)
@pytest.mark.parametrize("example", list(EXAMPLES))
def test_example_runs_on_two_cpu_processes(runs, example):
    _, pattern, at_least = EXAMPLES[example]
    proc, _ = runs[example]
    assert_succeeded(proc)
    value = float(re.search(pattern, proc.stdout).group(1))
    if at_least is not None:
        assert value > at_least, proc.stdout[-2000:]
    else:
        assert value < math.log(256) - 1  # nats per byte, below uniform guessing
    for rank in (0, 1):  # each rank reports its memory next to the formula
        assert f"[rank {rank}]   optimizer_states" in proc.stdout
    assert (ROOT / "examples" / example / "README.md").is_file()
