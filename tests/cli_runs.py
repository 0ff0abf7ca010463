"""Run the console scripts as a user would, in a fresh process, and read what a run leaves behind."""

from __future__ import annotations

import contextlib
import csv
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

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


Commands = dict[str, tuple]
"""name -> (argv, environment, folder) for a process, or (argv, environment, folder, ranks) for a
script's ``ranks`` processes forked from the fork server (see [Note: ranks forked from a loaded process])."""


# ---- ranks forked from a loaded process --------------------------------------------------------
#
# [Note: ranks forked from a loaded process]
# A script that trains on 2 ranks through Lightning or Fabric (tests/scripts/*_run.py, the example
# projects) spends about 8 CPU-seconds per process importing torch, Lightning and this package before
# its first step, as much as many of its runs take. Where a test is about what the script trains, not
# about how it is started, its command is given ``ranks`` (a 4th element): both ranks are then forked
# from the fork server that the worker pool uses (see [Note: workers forked from a loaded process] in
# tests/distributed.py), which imported those modules once, and each runs the script as ``python
# script.py ARGS`` would (``runpy`` as ``__main__``, the script's folder first on ``sys.path``, its
# arguments, environment, folder and ``PYTHONWARNINGS``; an exception to ``sys.excepthook``, exit codes, non-daemon
# threads and ``atexit`` handlers as at an interpreter's end), with the variables Lightning's launcher
# gives the rank it starts (``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``):
# as under torchrun, no rank relaunches the script. Both write to the same two files, as a child that
# inherits rank 0's output does, and the launch fails when any rank does. The launches about starting
# (the README's main job, zero-train, torchrun, Fabric's launcher, zero-launch) stay real processes.


def _exit_code(stop: SystemExit) -> int:
    """What the interpreter exits with for ``raise SystemExit(code)`` (a message: printed, then 1)."""
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)
    return 1


def _run_rank(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """One rank of a forked launch: ``python argv[1:]`` in this (forked) process."""
    import atexit
    import runpy
    import threading
    import warnings

    for fd, path in ((1, out), (2, err)):
        opened = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = list(argv[1:])
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    for option in filter(None, env.get("PYTHONWARNINGS", "").split(",")):
        warnings._setoption(option)  # what the interpreter does with $PYTHONWARNINGS at start-up
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop)
    except BaseException:  # noqa: BLE001 - to sys.excepthook (which may be the package's), exit code 1
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # the interpreter's end: threading's exit hooks, non-daemon threads, then atexit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ForkedRanks:
    """A script's ranks forked from the fork server, with what tests read of a ``subprocess.Popen``:
    ``args``, ``pid`` (rank 0's; ``pids``: all), ``poll``, ``wait``, ``kill`` and ``returncode`` (the
    first failing rank's code, else 0); ``logs``: the two output files, as ``_start`` sets on a process."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Optional[Path], ranks: int, out: Path,
                 err: Path) -> None:
        from .distributed import _context, free_port

        self.args, self.logs = argv, (out, err)
        launcher = {"NODE_RANK": "0", "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": env.get("MASTER_PORT") or str(free_port())}
        ctx = _context(fresh=False)
        self.procs = [ctx.Process(target=_run_rank, name=f"rank{r}", args=(
            [str(a) for a in argv], {**env, **launcher, "LOCAL_RANK": str(r)}, str(cwd or os.getcwd()), str(out),
            str(err))) for r in range(ranks)]
        for proc in self.procs:
            proc.start()
        self.pids = [proc.pid for proc in self.procs]
        self.pid = self.pids[0]

    @property
    def returncode(self) -> Optional[int]:
        codes = [proc.exitcode for proc in self.procs]
        if None in codes:
            return None
        return next((code for code in codes if code != 0), 0)

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        for proc in self.procs:
            proc.join(None if end is None else max(0.0, end - time.monotonic()))
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def kill(self) -> None:
        for proc in self.procs:
            if proc.exitcode is None:
                proc.kill()
        for proc in self.procs:
            proc.join()


def _start(command: tuple, logs: Path, name: str, port: bool):
    """A command's process (output to files in ``logs``), or its forked ranks; with a MASTER_PORT of its
    own when ``port``."""
    cmd, env, cwd, *ranks = command
    from .distributed import free_port

    env = {**env, "MASTER_PORT": str(free_port())} if port else {k: v for k, v in env.items() if k != "MASTER_PORT"}
    out, err = logs / f"{name}.stdout", logs / f"{name}.stderr"
    if ranks:
        return ForkedRanks(cmd, env, cwd, ranks[0], out, err)
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, text=True, stdout=stdout, stderr=stderr)
    proc.logs = (out, err)
    return proc


@contextlib.contextmanager
def started(commands: Commands) -> Iterator[dict[str, subprocess.Popen]]:
    """Start every command together, each with a MASTER_PORT of its own so that their launches
    cannot meet; name -> the running process (or forked ranks). Much of a Lightning launch is
    importing on one core, which other work fills: run it inside the ``with``, then ``finish``.
    Whatever still runs when the ``with`` ends is killed."""
    with tempfile.TemporaryDirectory(prefix="zero-test-launch-") as logs:
        procs = {name: _start(command, Path(logs), name, port=True) for name, command in commands.items()}
        try:
            yield procs
        finally:
            kill(procs)


def finish(procs: dict[str, subprocess.Popen], start: float, timeout: float
           ) -> dict[str, tuple[subprocess.CompletedProcess, float]]:
    """Wait for ``started`` processes until ``timeout`` seconds after ``start`` (a ``time.monotonic()``,
    raising the timeout past it); name -> (the finished process, seconds from ``start`` until it was
    seen finished)."""
    done = {}
    for name, proc in procs.items():
        proc.wait(timeout=max(1.0, start + timeout - time.monotonic()))
        out, err = proc.logs
        done[name] = (subprocess.CompletedProcess(proc.args, proc.returncode, out.read_text(), err.read_text()),
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


# ---- launches started at collection ------------------------------------------------------------
#
# [Note: launches started early]
# The main job's and the examples' launches (test_main_job.py) need about 110 CPU-seconds, most of it
# importing Lightning, and run after half of the suite, much of which leaves a core idle (a rank
# waiting for its peer, a test that runs in one process). So once collection has selected their tests,
# conftest.py starts them (``start_early``) at the lowest CPU priority (SCHED_IDLE: they run only
# where no test wants the core), with their output in files (nothing reads a pipe meanwhile). The
# module's fixture takes them over (``take``): back to normal priority, then waited for, from that
# moment, with the timeout it always had. Not selected, nothing starts; where the OS refuses the
# priority change, they run at normal priority. The command lines, environments and folders are
# those the fixture built before; only the start moved. Launches that a test times (test_failures.py)
# or that depend on an earlier test's output are not started early. test_cli.py's three independent
# launches (the presets' multirun, the quick command lines, the console script) start early too; its
# resume reads the multirun's zero2 checkpoint, so its fixture starts it once that job has finished
# (``adopt`` hands over the running processes for that; ``take`` waits for them all).

EARLY: dict[str, tuple[str, Callable[[Path], Commands]]] = {}
"""name -> (the test module's name, a function of a fresh folder that gives the launch's commands)."""
_early: dict[str, tuple[dict[str, subprocess.Popen], Path, Path]] = {}  # name -> (processes, logs, their folder)


def _descendant_threads(pid: int) -> list[int]:
    """The threads of ``pid`` and of every process below it (Linux /proc; none seen elsewhere)."""
    tids, pids = [], [pid]
    while pids:
        p = pids.pop()
        for task in glob.glob(f"/proc/{p}/task/*"):
            tids.append(int(os.path.basename(task)))
            try:
                with open(f"{task}/children") as f:
                    pids.extend(int(c) for c in f.read().split())
            except OSError:
                pass
    return tids


def _set_priority(procs: dict[str, subprocess.Popen], idle: bool) -> None:
    policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
    pids = [pid for proc in procs.values() for pid in getattr(proc, "pids", [proc.pid])]
    for pid in pids:
        for tid in _descendant_threads(pid) if not idle else [pid]:
            try:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
            except OSError:  # ended meanwhile, or not allowed: it runs as it is
                pass


def popen_logged(commands: Commands, logs: Path) -> dict[str, subprocess.Popen]:
    """Start the commands, their output to files in ``logs``, without a MASTER_PORT: each Lightning
    launch finds a free port itself when it starts. A port picked here would sit unused while the
    launch waits at idle priority, minutes in which any other process may take it (a DDP launch of
    test_lightning.py once failed so: EADDRINUSE). Forked ranks take theirs when they start."""
    return {name: _start(command, logs, name, port=False) for name, command in commands.items()}


def start_early(module_names: set[str], folder_for: Callable[[str], Path]) -> None:
    """Start the registered launches of these modules now, at idle priority (see the Note);
    ZERO_TEST_EARLY=0 turns it off (each starts in its fixture, as before)."""
    if os.environ.get("ZERO_TEST_EARLY", "1") == "0":
        return
    for name, (module, build) in EARLY.items():
        if module in module_names and name not in _early and hasattr(os, "sched_setscheduler"):
            logs, base = folder_for(f"{name}-logs"), folder_for(name)
            procs = popen_logged(build(base), logs)
            _set_priority(procs, idle=True)
            _early[name] = (procs, logs, base)


def adopt(name: str, folder_for: Callable[[str], Path]) -> tuple[dict[str, subprocess.Popen], Path, Path]:
    """The early launch ``name`` (started now if it was not), back at normal priority and still
    running: (name -> process, the folder of their output files, the folder its commands were built
    for). The caller waits for them (``finish``) and kills what still runs (``kill``)."""
    if name in _early:
        procs, logs, base = _early.pop(name)
        _set_priority(procs, idle=False)
    else:
        logs, base = folder_for(f"{name}-logs"), folder_for(name)
        procs = popen_logged(EARLY[name][1](base), logs)
    return procs, logs, base


def take(name: str, folder_for: Callable[[str], Path], timeout: float
         ) -> tuple[dict[str, tuple[subprocess.CompletedProcess, float]], Path]:
    """The early launch ``name`` (started now if it was not): back at normal priority, waited for
    until ``timeout`` seconds from now. Returns (name -> (the finished process, seconds from now until
    seen finished), as ``finish`` gives; the folder its commands were built for)."""
    start = time.monotonic()
    procs, logs, base = adopt(name, folder_for)
    try:
        return finish(procs, start, timeout), base
    finally:
        kill(procs)


def kill(procs: dict[str, subprocess.Popen]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def end_early() -> None:
    """Kill the early launches no test took (the session ended first)."""
    while _early:
        kill(_early.popitem()[1][0])
