"""zero-train and zero-estimate as users run them: every strategy preset on 2 CPU processes, a
multirun, a resume, bad command lines, and the estimator's numbers."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from zero_strategy import estimate_memory
from zero_strategy.checkpoint import is_sharded_checkpoint
from zero_strategy.cli.report import format_bytes

from .cli_runs import (EARLY, Commands, adopt, assert_succeeded, clean_env, finish, kill, metric_rows,
                       popen_logged, script, summaries)

CLI_CASES = Path(__file__).parent / "scripts" / "cli_cases.py"
SMOKE = ("experiment=smoke",)  # a 6-step one-layer GPT: every part of a run, in seconds


PRESETS = {"zero2": 2, "ddp": 0, "zero1": 1, "zero3": 3, "zero3_offload": 3}
"""The multirun's jobs, in order: zero2 first, so that the resume from its checkpoint runs while the
other jobs do (see ``launches``)."""


@pytest.fixture(scope="module")
def preset_sweep(launches):
    """One multirun over the strategy presets (the sweep folder, the process), shared by the tests
    that read its jobs: each job's ranks train in the job's own folder, rank 1 started by
    Lightning's launcher with its job's strategy, as a run of its own would."""
    proc, folder = launches["sweep"]
    assert_succeeded(proc)
    return folder / "sweep", proc


def job_dir(sweep, strategy: str):
    return sweep / str(list(PRESETS).index(strategy))


def check_finished_run(run_dir, stage: int, steps: int) -> list[dict]:
    ranks = summaries(run_dir)
    for r, s in enumerate(ranks):
        assert (s["global_rank"], s["world_size"], s["global_step"]) == (r, 2, steps)
        assert math.isfinite(s["metrics"]["val/loss"]) and s["metrics"]["val/loss"] < math.log(256) + 0.1
        assert s["metrics"]["throughput/tokens_per_sec"] > 0
        mem = s["memory"]
        assert mem["stage"] == stage
        for m in mem["measured"]:
            # the sharded optimizer state is the formula's (Adam: 8 bytes per parameter over the
            # ranks that share it) up to the per-piece step counters
            formula = mem["formula"]["optimizer_states"]
            assert formula <= m["optimizer_states"] <= formula + 512
            if stage < 3:
                assert m["params"] == mem["formula"]["params"]
            else:  # the shards, plus the small parameters that stay whole, plus padding
                assert mem["formula"]["params"] <= m["params"] < 2 * mem["formula"]["params"]
    # data parallel ranks end with the same model
    assert ranks[0]["param_digest"] == ranks[1]["param_digest"]
    last = run_dir / "checkpoints" / "last.ckpt"
    assert last.is_file() or is_sharded_checkpoint(last)  # DDP writes a file, ZeRO a sharded directory
    rows = metric_rows(run_dir)
    assert any(r.get("train/loss") for r in rows) and any(r.get("throughput/tokens_per_sec") for r in rows)
    return ranks


@pytest.mark.timeout(420)
def test_zero2_preset_and_what_a_run_prints(preset_sweep):
    sweep, proc = preset_sweep
    run_dir = job_dir(sweep, "zero2")
    check_finished_run(run_dir, stage=2, steps=6)
    out = proc.stdout
    for shown in ("zero-train model=gpt data=synthetic strategy=zero2", "Model-state memory per rank",
                  "ZeRO formula", "Final metrics", "throughput/tokens_per_sec", "val/ppl", "Epoch 0",
                  "Where the step's time went: rank 0, the mean of 5 steps after the first", "tokens/s over 2 rank(s)"):
        assert shown in out, shown
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / "train_ddp_process_1.log").is_file()


@pytest.mark.timeout(420)
def test_resume_from_last_checkpoint(launches, preset_sweep):
    # started by ``launches`` from the sweep's zero2 job's last.ckpt once that job had finished
    proc, folder = launches["resume"]
    assert_succeeded(proc)
    assert f"ckpt_path={job_dir(preset_sweep[0], 'zero2') / 'checkpoints' / 'last.ckpt'}" in proc.args
    assert "Restored all states from the checkpoint" in proc.stderr
    check_finished_run(folder / "r", stage=2, steps=9)
    logged_steps = [int(r["step"]) for r in metric_rows(folder / "r") if r.get("train/loss")]
    assert min(logged_steps) >= 6 and max(logged_steps) == 8  # continued from step 6, not from 0


@pytest.mark.timeout(420)
def test_each_strategy_preset_trains_on_two_processes_in_a_multirun_as_ddp(preset_sweep):
    sweep, proc = preset_sweep
    metrics = {}
    for job, (strategy, stage) in enumerate(PRESETS.items()):
        assert job_dir(sweep, strategy) == sweep / str(job)
        assert f"- strategy={strategy}" in (sweep / str(job) / ".hydra" / "overrides.yaml").read_text().splitlines()
        ranks = check_finished_run(sweep / str(job), stage=stage, steps=6)
        assert (sweep / str(job) / "train_ddp_process_1.log").is_file()
        if strategy == "zero1":  # each rank holds half of Adam's state; DDP holds all of it
            n = ranks[0]["memory"]["num_params"]
            assert ranks[0]["memory"]["formula"]["optimizer_states"] == 8 * n // 2
        metrics[strategy] = ranks[0]["metrics"]
    losses = sorted(k for k in metrics["ddp"] if "loss" in k)
    assert "val/loss" in losses and len(losses) > 1, metrics["ddp"]
    for strategy in PRESETS:  # fp32: every preset takes DDP's steps (a skipped or wrong step moves them far more)
        for key in losses:
            assert math.isclose(metrics[strategy][key], metrics["ddp"][key], rel_tol=1e-5), \
                (strategy, key, metrics[strategy][key], metrics["ddp"][key])
    assert not (sweep.parent / "outputs").exists(), "a child rank made a run folder of its own"
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == [str(j) for j in range(len(PRESETS))]
    for shown in ("Model-state memory per rank", "Final metrics"):
        assert proc.stdout.count(shown) == len(PRESETS), shown
    assert proc.stdout.count("Where the step's time went") == len(PRESETS) - 1  # ZeroStrategy's table; not DDP's


BAD = {
    "unknown strategy": (["strategy=zero9"], ["Could not find 'strategy/zero9'",  # Hydra's
                                              "Available: ddp, deepspeed_config, zero1, zero2, zero2_offload, zero3, zero3_offload",
                                              "Did you mean strategy=zero"]),
    "unknown key": (["trainer.max_stepz=5"], ["Key 'max_stepz' is not in struct", "Did you mean trainer.max_steps"]),
    "wrong type": (["trainer.max_steps=ten"], ["trainer.max_steps='ten' (str) does not fit",
                                               "lightning.pytorch.Trainer's max_steps: int"]),
    "missing value": (["data=text"], ["data.path is required"]),
    "models that do not fit": (["model=gpt", "data=gaussian"], ["this model and data set do not fit together"]),
}


ESTIMATES = {
    "gpt": ["model=gpt", "world_size=64"],
    "gpt2": ["model=gpt2", "world_size=8", "precision=bf16-mixed", "offload=true"],
    "bad world": ["world_size=0"],
}


QUICK = {**{f"bad: {name}": ["zero-train", *overrides] for name, (overrides, _) in BAD.items()},
         **{f"estimate: {name}": ["zero-estimate", *args] for name, args in ESTIMATES.items()}}
"""The command lines that end before training, run one after another in one process."""
CONSOLE_CASE = "unknown key"  # also run through the console script, as the shell runs it


LAUNCH = "cli_launches"  # the early launch's name (see [Note: launches started early] in tests/cli_runs.py)
FOLDERS = ("sweep", "quick", "console", "resume")


def _commands(base: Path) -> Commands:
    """The presets' multirun, ``QUICK``'s command lines in one process and ``CONSOLE_CASE`` through the
    console script, each in a folder of its own under ``base`` (there too the resume's, empty: see
    ``_resume``). Independent of each other and of any test, so they may start at collection."""
    folders = {name: base / name for name in FOLDERS}
    for folder in folders.values():
        folder.mkdir()
    quick = [[*line, f"hydra.run.dir={folders['quick'] / name.split(': ', 1)[1] / 'run'}"] if name.startswith("bad")
             else line for name, line in QUICK.items()]
    return {
        "sweep": ([script("zero-train"), "-m", *SMOKE, "strategy=" + ",".join(PRESETS),
                   f"hydra.sweep.dir={folders['sweep'] / 'sweep'}"], clean_env(), folders["sweep"]),
        "quick": ([sys.executable, str(CLI_CASES), str(folders["quick"] / "results.json"), json.dumps(quick)],
                  clean_env(), folders["quick"]),
        "console": ([script("zero-train"), *BAD[CONSOLE_CASE][0], f"hydra.run.dir={folders['console'] / 'run'}"],
                    clean_env(), folders["console"]),
    }


EARLY[LAUNCH] = (__name__, _commands)  # started at collection: see [Note: launches started early] in tests/cli_runs.py


def _zero2(base: Path) -> Path:
    return job_dir(base / "sweep" / "sweep", "zero2")


def _resume(base: Path) -> Commands:
    """The resume from the sweep's zero2 job's last checkpoint to step 9: it reads that job's output,
    so it starts only once the job has finished (``launches``), never at collection."""
    return {"resume": ([script("zero-train"), *SMOKE, f"ckpt_path={_zero2(base) / 'checkpoints' / 'last.ckpt'}",
                        "trainer.max_steps=9", f"hydra.run.dir={base / 'resume' / 'r'}"], clean_env(),
                       base / "resume")}


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """This module's command lines, at once (see ``_commands``; started at collection, see [Note:
    launches started early] in cli_runs.py): the presets' multirun; every line of ``QUICK`` in one
    process (tests/scripts/cli_cases.py: each as its console script would run it, a bad override in a
    folder of its own); ``CONSOLE_CASE`` through the real console script; and, started once the
    multirun's zero2 job has finished (its first), a resume from that job's last checkpoint to step 9,
    while the multirun's other jobs train. name -> (the finished process, its folder)."""
    start = time.monotonic()
    procs, logs, base = adopt(LAUNCH, lambda name: tmp_path_factory.mktemp(name, numbered=False))
    try:
        zero2 = _zero2(base)
        # both ranks write their summary after fit, so after the checkpoint (a failed sweep: the
        # resume fails too, and says why)
        while procs["sweep"].poll() is None and not all((zero2 / f"summary_rank{r}.json").exists() for r in (0, 1)):
            time.sleep(0.2)
        procs.update(popen_logged(_resume(base), logs))
        done = finish(procs, start, timeout=400)
    finally:
        kill(procs)
    return {name: (proc, base / name) for name, (proc, _) in done.items()}


@pytest.fixture(scope="module")
def quick_runs(launches) -> dict[str, SimpleNamespace]:
    """Case name of ``QUICK`` -> returncode, stdout, stderr, and the folder a bad override ran in."""
    proc, root = launches["quick"]
    assert_succeeded(proc)
    results = json.loads((root / "results.json").read_text())
    return {name: SimpleNamespace(**result, folder=root / name.split(": ", 1)[1])
            for name, result in zip(QUICK, results)}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", list(BAD))
def test_bad_overrides_say_what_to_do(quick_runs, case):
    proc = quick_runs[f"bad: {case}"]
    assert proc.returncode != 0
    for text in BAD[case][1]:
        assert text in proc.stderr, f"{text!r} not in:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr  # a typo is not a crash
    assert not (proc.folder / "run" / "checkpoints").exists()  # nothing was launched


@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", [CONSOLE_CASE])  # Hydra's error, explained by main()
def test_the_console_script_fails_as_the_shared_process_reports(launches, quick_runs, case):
    # quick_runs runs the command lines in one process; here the same line ran as the shell runs it
    proc, _ = launches["console"]
    assert proc.returncode == quick_runs[f"bad: {case}"].returncode != 0
    for text in BAD[case][1]:
        assert text in proc.stderr


def estimate_cells(stdout: str, stage: int) -> list[str]:
    line = next(ln for ln in stdout.splitlines() if re.match(rf"│ {stage}\b", ln))
    return [c.strip() for c in line.strip("│ ").split("│")]


@pytest.mark.timeout(420)
def test_estimate_prints_estimate_memory_for_every_stage(quick_runs):
    proc = quick_runs["estimate: gpt"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    n = 842_496  # conf/model/gpt.yaml: 4 layers of 128, byte vocabulary, tied embeddings counted once
    assert f"{n:,} parameters, 64 ranks, 32-true" in proc.stdout
    for stage in range(4):
        est = estimate_memory(n, stage=stage, world_size=64)
        cells = estimate_cells(proc.stdout, stage)
        assert cells[2:] == [format_bytes(est[k]) for k in ("params", "grads", "optimizer_states",
                                                             "master_params", "total")]
    assert estimate_cells(proc.stdout, 2)[0] == "2 *"  # the configured preset is zero2


@pytest.mark.timeout(420)
def test_estimate_transformers_gpt2_matches_own_gpt_and_rejects_bad_world(quick_runs):
    # model=gpt2 (GPT2LMHeadModel) has the same shape as model=gpt: the same count, ties counted once
    proc = quick_runs["estimate: gpt2"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "842,496 parameters, 8 ranks, bf16-mixed" in proc.stdout
    est = estimate_memory(842_496, stage=3, world_size=8, precision="bf16-mixed", offload_optimizer=True,
                          offload_params=True)
    assert format_bytes(est["host"]) in proc.stdout and "opt+params" in proc.stdout
    bad = quick_runs["estimate: bad world"]
    assert bad.returncode == 2 and "world_size=0 must be a positive integer" in bad.stderr
