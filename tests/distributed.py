"""Run a function on N gloo processes and collect what each returns.

[Note: the worker pool]
Starting a process that imports torch, Lightning and this package and joins a gloo group costs
seconds, far more than the ten steps of a tiny model that an engine test runs in it. So
``run_distributed`` keeps one pool of long-lived workers per world size, started on first use and
closed at the end of the session (tests/conftest.py, and atexit), and runs each call on it. A call
must behave as it would on fresh processes:
- before every call each worker puts back what a fresh process has (``_FreshState``): RNG seeds,
  default dtype and device, grad and anomaly mode, deterministic flags, global module and optimizer
  hooks, the kernel backend switch, CUDA's cached memory and peak, and the parent's current
  environment and working directory; the previous call's objects are dropped and collected;
- the gloo group is kept; after a call every rank checks it with one all_reduce, and a group found
  unusable (or destroyed by the call) means a new pool for the next call;
- a rank that raises reports its traceback and exits, as a fresh process would, so a peer waiting
  for it in a collective fails at once with its own traceback; a rank that has not answered
  ``GRACE_S`` after another failed, or by the call's deadline, has its stack dumped and the pool is
  killed; the next call starts a new one.
- a worker that dies of a signal (a native crash: glibc aborts on finding its heap corrupted) fails
  the call with the Python stacks of its threads at the crash, which faulthandler writes to the
  worker's stack file; the corruption may have been made by an earlier call in the same process,
  so the failure is where to start looking, not necessarily the culprit;
- a worker's stdout and stderr go to a file of its pool's; a failed call's message ends with what
  each failing rank printed;
- a call must leave no process of its own running: one found after the call fails the call, and is
  killed. (A Lightning Trainer or Fabric with devices=2 in a call, without LOCAL_RANK set, starts
  its "rank 1" by rerunning this worker's command line, pytest's: a copy of the rest of the suite
  ran in the background, competing for the cores, until test_hf_export.py set LOCAL_RANK.)
What a pool cannot undo is process-wide state fixed at start-up (variables read when a process
starts, such as ``MALLOC_*``, or a measured peak resident set): such tests pass ``fresh=True``.

[Note: workers forked from a loaded process]
Importing torch, Lightning (with what it pulls in: torchmetrics, transformers, torch._dynamo) and this
package costs a new process about 8 CPU-seconds, and a suite starts a few dozen workers (a pool per
world size, a new one after every failed or group-breaking call, the tests of this file). So workers
are forked from multiprocessing's fork server, which imports ``PRELOAD`` once, when the first pool
starts: a worker starts with those modules imported, as a spawned one has them once it imported
them, without paying again. Nothing else is shared: each worker still joins its own gloo group and
puts back a fresh state before every call. ``fresh=True`` calls (state fixed at start-up, such as
``MALLOC_*`` or the peak resident set, which a fork inherits) keep spawning new interpreters, as does
a platform without ``fork``. The fork server's parent is pytest, so workers check that pytest still
lives, not their parent (the fork server).
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import glob
import io
import os
import pickle
import queue
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.modules.module as module_hooks
import torch.optim.optimizer as optimizer_hooks

DEFAULT_CALL_TIMEOUT_S = 100.0  # outside pytest; inside, the test's own timeout less a margin (conftest.py)
TIMEOUT_ENV = "ZERO_TEST_CALL_TIMEOUT"  # seconds; overrides both, for slow or loaded machines
GRACE_S = 10.0  # after one rank fails, how long the others get to report (a peer's collective errors at once)
PRELOAD = ("torch", "torch.distributed", "lightning.pytorch", "transformers", "zero_strategy",
           "zero_strategy.strategy", "tests.distributed")
"""Imported once by the fork server that starts the workers (see [Note: workers forked from a loaded process])."""
STACK_SIGNAL = signal.SIGUSR2  # not Lightning's SLURM requeue signal (SIGUSR1)
_HOOK_DICTS = [getattr(module_hooks, name) for name in dir(module_hooks) if name.startswith("_global_")
               and isinstance(getattr(module_hooks, name), dict)] + [
    optimizer_hooks._global_optimizer_pre_hooks, optimizer_hooks._global_optimizer_post_hooks]

test_deadline: Optional[float] = None  # time.monotonic() by which the running test must end; set by conftest.py


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the worker side ---------------------------------------------------------------------------


class _FreshState:
    """What a fresh worker process has, captured after it joined the group, put back before each call."""

    def __init__(self) -> None:
        self.dtype = torch.get_default_dtype()
        self.device = torch.get_default_device()
        self.grad = torch.is_grad_enabled()
        self.anomaly = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())
        self.cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
        self.matmul_precision = torch.get_float32_matmul_precision()
        self.hooks = [dict(d) for d in _HOOK_DICTS]

    def restore(self, env: dict[str, str], cwd: str) -> None:
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        # a fresh process seeds torch, random and numpy from the OS: a call never inherits a sequence
        torch.seed()
        if torch.cuda.is_initialized():
            torch.cuda.seed_all()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # memory readings start as in a fresh process: nothing cached...
            torch.cuda.reset_peak_memory_stats()  # ...and no earlier call's peak
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        torch.set_default_dtype(self.dtype)
        if torch.get_default_device() != self.device:
            torch.set_default_device(None if self.device.type == "cpu" else self.device)
        torch.set_grad_enabled(self.grad)
        torch.set_anomaly_enabled(*self.anomaly)
        torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = self.cudnn
        torch.set_float32_matmul_precision(self.matmul_precision)
        torch.set_num_threads(1)  # two ranks on two cores: more threads only contend (Lightning may change it)
        for hooks, fresh in zip(_HOOK_DICTS, self.hooks):
            hooks.clear()
            hooks.update(fresh)
        loader = sys.modules.get("zero_strategy.kernels.loader")
        if loader is not None:
            loader.set_backend(None)  # back to $ZERO_STRATEGY_KERNELS, as at import


def _running_children() -> dict[int, str]:
    """This process's child processes that have not ended (zombies left out): pid -> command line.
    Read from /proc (Linux); elsewhere none are seen. multiprocessing's resource tracker, started on
    first use and kept for the process's life, is not the call's."""
    found = {}
    for listing in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        try:
            with open(listing) as f:
                pids = [int(pid) for pid in f.read().split()]
        except OSError:
            continue
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except (OSError, IndexError):
                continue  # ended meanwhile
            if state != "Z" and "multiprocessing.resource_tracker" not in command:
                found[pid] = command
    return found


def _end_children_left(before: dict[int, str]) -> Optional[str]:
    """Kill the child processes started during the call and still running; what to say, if any."""
    left = {pid: command for pid, command in _running_children().items() if pid not in before}
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if not left:
        return None
    return (f"the call left {len(left)} process(es) running (killed now): "
            + "; ".join(f"pid {pid}: {command[:300]}" for pid, command in left.items())
            + ". A call must end what it starts. A Lightning Trainer or Fabric with devices > 1 starts its "
              "other ranks by rerunning this worker's command line (pytest's) unless $LOCAL_RANK says the "
              "processes exist already: os.environ.update(LOCAL_RANK=str(rank), NODE_RANK=\"0\") first, "
              "as under torchrun.")


def _group_usable(call_id: int, world_size: int) -> bool:
    """Every rank is done with this call and the default group still carries a collective."""
    if not dist.is_initialized():
        return False
    try:
        total = torch.tensor([float(call_id)])
        dist.all_reduce(total)
        return total.item() == call_id * world_size
    except Exception:  # noqa: BLE001 - a broken group is reported as such; the pool is replaced
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's (the pid was reused)
        return True
    return True


def _next_task(tasks, parent: int):
    """The next task, or None (stop) once the process that started this worker's pool is gone: a
    pytest killed without closing its pools must not leave workers waiting for it forever."""
    while True:
        try:
            return tasks.get(timeout=5.0)
        except queue.Empty:
            if not _alive(parent):
                return None


def _output_path(stack_path: str) -> str:
    return stack_path.replace("stack_", "output_")


def _output_to(path: str) -> None:
    """This worker's stdout and stderr go to ``path``: a failed call's message ends with what the rank
    printed (forked workers would otherwise print to the fork server's, the terminal's, whichever test
    runs)."""
    sys.stdout.flush()
    sys.stderr.flush()
    opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd in (1, 2):
        os.dup2(opened, fd)
    os.close(opened)


def _serve(rank: int, world_size: int, port: int, tasks, reports, stack_path: str, parent: int) -> None:
    """A worker: join the group, then run calls until told to stop (None) or a call raises.

    Each call sends two reports: ("result", call, rank, bytes, traceback), then, once every rank
    has checked the group with one all_reduce, ("group", call, rank, usable, None).
    """
    dist_env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.update(dist_env)
    _output_to(_output_path(stack_path))
    stacks = open(stack_path, "w")  # noqa: SIM115 - faulthandler writes here until the process ends
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        fresh = _FreshState()
    except BaseException:  # noqa: BLE001 - shipped to the parent, which re-raises
        reports.put(("result", 0, rank, None, traceback.format_exc()))
        return
    while (task := _next_task(tasks, parent)) is not None:
        call_id, payload, env, cwd, check_group = task
        stacks.seek(0)
        stacks.truncate()
        faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True)
        faulthandler.enable(file=stacks, all_threads=True)  # a native crash (SIGSEGV, SIGABRT) writes its stack too
        children = _running_children()
        try:
            fresh.restore({**env, **dist_env}, cwd)
            fn, args = pickle.loads(payload)
            result = io.BytesIO()  # tensors pickled through a queue would point into this process
            torch.save(fn(rank, world_size, *args), result)
            del fn, args
        except BaseException:  # noqa: BLE001 - shipped to the parent, which re-raises
            reports.put(("result", call_id, rank, None, traceback.format_exc()))
            _end_children_left(children)
            break  # end as a fresh process would, so that peers waiting for this rank fail now
        left = _end_children_left(children)
        if left is not None:
            reports.put(("result", call_id, rank, None, left))
            break
        reports.put(("result", call_id, rank, result.getvalue(), None))
        del result
        gc.collect()  # the next call must not find this one's objects (or their hooks) alive
        gc.freeze()  # what survived stays: later collections scan only the new objects (0.15 s -> ms)
        if check_group:
            usable = _group_usable(call_id, world_size)
            reports.put(("group", call_id, rank, usable, None))
            if not usable:
                break
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- the parent side ---------------------------------------------------------------------------


def _context(fresh: bool):
    """Where workers come from: see [Note: workers forked from a loaded process]."""
    if fresh or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


class _Pool:
    """``world_size`` worker processes in one gloo group, running one call at a time."""

    def __init__(self, world_size: int, fresh: bool = False) -> None:
        ctx = _context(fresh)
        self.world_size = world_size
        self.usable = True  # False once a call failed or left the group broken: replace the pool
        self.calls = 0
        self.reports = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.folder = tempfile.mkdtemp(prefix="zero-test-workers-")
        port = free_port()
        self.procs = [ctx.Process(target=_serve, daemon=True, name=f"zero-test-rank{r}",
                                  args=(r, world_size, port, self.tasks[r], self.reports, self._stack_path(r), os.getpid()))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def _stack_path(self, rank: int) -> str:
        return os.path.join(self.folder, f"stack_rank{rank}.txt")

    def run(self, fn: Callable, args: tuple, deadline: float, check_group: bool) -> list:
        self.calls += 1
        call_id = self.calls
        payload = ForkingPickler.dumps((fn, args))  # here, so an unpicklable fn fails in the caller
        task = (call_id, bytes(payload), dict(os.environ), os.getcwd(), check_group)
        for q in self.tasks:
            q.put(task)
        results: dict[int, tuple] = {}  # rank -> (torch.save bytes, traceback)
        groups: dict[int, bool] = {}  # rank -> found the group usable after the call
        missing_because = self._collect(call_id, deadline, results, groups)
        failed = sorted(r for r, (_, error) in results.items() if error is not None)
        if failed or missing_because:
            self.usable = False
            raise RuntimeError("\n".join(
                [f"rank {r}:\n{results[r][1]}{self._printed(r)}" for r in failed]
                + [f"rank {r}: no answer {missing_because}. Its stack then:\n{self._stack(r)}"
                   for r in range(self.world_size) if r not in results]))
        if check_group:  # the results are good whatever this finds; a broken group only means a new pool
            end = time.monotonic() + GRACE_S
            while len(groups) < self.world_size and time.monotonic() < end:
                self._receive(call_id, end - time.monotonic(), results, groups)
            self.usable = len(groups) == self.world_size and all(groups.values())
        return [torch.load(io.BytesIO(results[r][0]), weights_only=True) for r in range(self.world_size)]

    def _receive(self, call_id: int, timeout: float, results: dict, groups: dict) -> bool:
        """File the next report of this call (or of start-up, call 0); False if none came in ``timeout``."""
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            try:
                kind, report_call, rank, value, error = self.reports.get(timeout=left)
            except queue.Empty:
                return False
            if report_call in (0, call_id):
                if kind == "result":
                    results[rank] = (value, error)
                else:  # "group": may overtake a peer's result, each rank's queue writer runs on its own
                    groups[rank] = value
                return True
        return False

    def _collect(self, call_id: int, deadline: float, results: dict, groups: dict) -> Optional[str]:
        """Wait for every rank's result; if some cannot come, say why."""
        budget = deadline - time.monotonic()
        first_failure: Optional[tuple[float, int]] = None  # when, and which rank
        while len(results) < self.world_size:
            now = time.monotonic()
            if now >= deadline:
                return (f"by the call's deadline ({budget:.0f} s): a hang? (ranks that issue different "
                        f"collectives wait for each other forever); if the call needs longer, pass "
                        f"run_distributed(..., timeout_s=...), set ${TIMEOUT_ENV} or raise the test's "
                        f"@pytest.mark.timeout")
            if first_failure and now >= first_failure[0] + GRACE_S:
                return f"{GRACE_S:.0f} s after rank {first_failure[1]} failed (probably waiting for it in a collective)"
            if not self._receive(call_id, min(0.5, deadline - now), results, groups):
                self._note_deaths(call_id, results, groups)
            if first_failure is None:
                first_failure = next(((now, r) for r, (_, error) in sorted(results.items()) if error), None)
        return None

    def _note_deaths(self, call_id: int, results: dict, groups: dict) -> None:
        """A worker that ended without a result died (a crash, a signal, os._exit in the call)."""
        dead = [r for r, p in enumerate(self.procs) if r not in results and p.exitcode is not None]
        if dead:
            while self._receive(call_id, 0.2, results, groups):  # what it sent before it ended
                pass
        for rank in dead:
            if rank not in results:
                code = self.procs[rank].exitcode
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                results[rank] = (None, f"the worker process died ({how}) without a result. Its stack then:\n"
                                       f"{self._written_stack(rank)}")

    def _stack(self, rank: int) -> str:
        p = self.procs[rank]
        if p.exitcode is not None:
            return f"(the process had ended: exit code {p.exitcode})\n{self._written_stack(rank)}"
        os.kill(p.pid, STACK_SIGNAL)
        time.sleep(0.5)  # faulthandler writes from its signal handler, even in a blocked collective
        return self._written_stack(rank)

    def _printed(self, rank: int, tail: int = 3000) -> str:
        """The end of what the rank printed, if anything."""
        try:
            with open(_output_path(self._stack_path(rank)), errors="replace") as f:
                text = f.read()[-tail:]
        except OSError:
            return ""
        return f"\nrank {rank} printed (the end):\n{text}" if text.strip() else ""

    def _written_stack(self, rank: int) -> str:
        """What faulthandler wrote for this call: the stack asked for, or that of a fatal signal."""
        try:
            with open(self._stack_path(rank)) as f:
                return f.read() or "(no stack written)"
        except OSError:
            return "(no stack written)"

    def close(self) -> None:
        """Ask the workers to leave the group and end; kill those that do not within 10 s."""
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=10)
        for q in [*self.tasks, self.reports]:
            q.cancel_join_thread()  # a dead reader must not block this process's exit
            q.close()
        shutil.rmtree(self.folder, ignore_errors=True)


_pools: dict[int, _Pool] = {}


def close_pools(*world_sizes: int) -> None:
    """End the pools of these world sizes, or every pool (at the end of the session); idempotent."""
    for world_size in world_sizes or list(_pools):
        if world_size in _pools:
            _pools.pop(world_size).close()


atexit.register(close_pools)


def _call_deadline(timeout_s: Optional[float]) -> float:
    now = time.monotonic()
    if timeout_s is None and os.environ.get(TIMEOUT_ENV):
        try:
            timeout_s = float(os.environ[TIMEOUT_ENV])
        except ValueError:
            raise ValueError(f"${TIMEOUT_ENV}={os.environ[TIMEOUT_ENV]!r} is not a number of seconds; "
                             "set it to e.g. 300, or unset it to use the test's own timeout.") from None
    if timeout_s is not None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}: a call needs a positive number of seconds.")
        return now + timeout_s
    return test_deadline if test_deadline is not None else now + DEFAULT_CALL_TIMEOUT_S


def run_distributed(fn: Callable[..., Any], world_size: int = 2, *args: Any, fresh: bool = False,
                    alone: bool = False, timeout_s: Optional[float] = None) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; returns the results by rank.

    ``fn`` must be a module-level function and its result something ``torch.save`` writes and
    ``torch.load(weights_only=True)`` reads. If any rank raises (or dies, or hangs), a RuntimeError
    carries every failing rank's traceback (a hung rank's stack). Calls run on a pool of long-lived
    workers (see [Note: the worker pool]); ``fresh=True`` runs this call on new interpreters instead,
    ended after it: use it when the call depends on state fixed at process start (variables such as
    ``MALLOC_*``, the peak resident set). ``alone=True`` runs it on workers of its own, forked as the
    pool's are (imports done), ended after it: use it when the call changes process-wide state the
    reset does not cover (patched module attributes, signal handlers, threads left running), or makes
    ranks diverge on purpose or die (the pool would spend ``GRACE_S`` finding its group unusable), and
    for calls run at the same time from threads (each on its own workers). ``timeout_s`` bounds the
    call (else $ZERO_TEST_CALL_TIMEOUT, else the running test's pytest timeout less a margin, else
    100 s); past it the call fails with the stacks of the ranks that had not answered.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: run_distributed needs a positive int number of ranks "
                         f"(the function to run comes first: run_distributed(fn, 2, *args)).")
    deadline = _call_deadline(timeout_s)
    if fresh or alone:
        pool = _Pool(world_size, fresh=fresh)
        try:  # the results are in once run returns: the processes are ended, not asked to leave the group
            return pool.run(fn, args, deadline, check_group=False)  # (whose teardown waits 10 s per rank
        finally:                                                    # after a call that diverged on purpose)
            pool.kill()
    pool = _pools.get(world_size)
    if pool is None or not pool.usable:
        if pool is not None:
            pool.kill()
        pool = _pools[world_size] = _Pool(world_size)
    try:
        return pool.run(fn, args, deadline, check_group=True)
    except BaseException:  # a failure, a deadline, pytest-timeout or Ctrl-C: no worker is left mid-call
        del _pools[world_size]
        pool.kill()
        raise
