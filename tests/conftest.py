"""Session-wide test plumbing: the deadline of run_distributed's calls, and closing its worker pools."""

from __future__ import annotations

import os
import time

import pytest

from . import cli_runs, distributed

# what a test needs after its last run_distributed call returns: assertions, killing a hung pool
DEADLINE_MARGIN_S = 15.0


def _pytest_timeout_of(item: pytest.Item) -> float:
    """The item's pytest-timeout in seconds (its marker, else --timeout / the ini file), or 0 for none."""
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    else:
        try:
            value = item.config.getoption("timeout", None) or item.config.getini("timeout")
        except ValueError:  # pytest-timeout is not installed: no "timeout" ini key
            value = 0
    return float(value or 0)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # pytest-timeout starts its clock here too: a hung call fails with the workers' stacks and a
    # clean pool before pytest-timeout would interrupt the test
    timeout = _pytest_timeout_of(item)
    distributed.test_deadline = time.monotonic() + max(timeout - DEADLINE_MARGIN_S, timeout / 2) if timeout else None
    try:
        return (yield)
    finally:
        distributed.test_deadline = None


@pytest.fixture(autouse=True)
def _restore_environ():
    """Put the environment back after each test. A test that sets up a Lightning Trainer in this
    process leaves the launch variables there (MASTER_PORT, LOCAL_RANK, NODE_RANK) and
    OMP_NUM_THREADS, which Lightning sets to the cores per process; every later launch inherited
    it, and the four launches of test_main_job then ran 8 ranks of 2 OpenMP threads each on 2 cores,
    2.5x slower than with one thread each (benchmarks/RESULTS.md, "The test suite's time")."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session", autouse=True)
def _close_worker_pools():
    yield
    distributed.close_pools()


@pytest.fixture(scope="session")
def tmp_root(tmp_path_factory) -> str:
    """A folder for the Lightning launches tests share (test_lightning.py's cached runs: see [Note: one
    launch per strategy] there), so DDP's references are launched once per session."""
    return str(tmp_path_factory.mktemp("lightning"))


def pytest_collection_finish(session):
    """Start the launches of the selected modules that may start early ([Note: launches started early] in tests/cli_runs.py)."""
    if session.config.option.collectonly or not session.items:
        return
    factory = session.config._tmp_path_factory  # the one behind the tmp_path_factory fixture
    modules = {item.module.__name__ for item in session.items if getattr(item, "module", None) is not None}
    cli_runs.start_early(modules, lambda name: factory.mktemp(name, numbered=False))


def pytest_sessionfinish(session):
    cli_runs.end_early()
