"""The test helper's worker pool (tests/distributed.py): a call sees what a fresh process would, and a
failure, a hang or a dead worker fails the call with what is known and leaves a working pool behind."""

from __future__ import annotations

import os
import pickle
import time

import pytest
import torch
import torch.distributed as dist

from . import distributed
from .distributed import run_distributed


def _pid_and_sum(rank, world_size, offset):
    total = torch.tensor([float(rank + offset)])
    dist.all_reduce(total)
    return os.getpid(), total.item()


def _dirty_the_process(rank, world_size, folder):
    from zero_strategy import kernels

    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.use_deterministic_algorithms(True)
    torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    os.environ["ZERO_TEST_LEFT_BEHIND"] = "1"
    os.chdir(folder)
    kernels.set_backend("torch")
    return torch.rand(3)


def _what_a_call_sees(rank, world_size):
    from zero_strategy import kernels

    return {"rand": torch.rand(3), "dtype": str(torch.get_default_dtype()), "grad": torch.is_grad_enabled(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "hooks": len(torch.nn.modules.module._global_forward_hooks), "cwd": os.getcwd(),
            "left_behind": os.environ.get("ZERO_TEST_LEFT_BEHIND"), "set_by_test": os.environ.get("ZERO_TEST_SET"),
            "rank_var": os.environ["RANK"], "backend": kernels.backend(), "threads": torch.get_num_threads()}


@pytest.mark.timeout(120)
def test_calls_reuse_the_workers_and_see_a_fresh_process(tmp_path, monkeypatch):
    first = run_distributed(_pid_and_sum, 2, 10)
    assert [total for _, total in first] == [21.0, 21.0]
    dirty = run_distributed(_dirty_the_process, 2, str(tmp_path))
    monkeypatch.setenv("ZERO_TEST_SET", "from the test")
    seen = run_distributed(_what_a_call_sees, 2)
    again = run_distributed(_what_a_call_sees, 2)
    assert run_distributed(_pid_and_sum, 2, 0)[0][0] == first[0][0]  # the same workers all along
    seeded = torch.Generator().manual_seed(0)
    assert torch.equal(dirty[0], torch.rand(3, generator=seeded, dtype=torch.float64))  # the dirty call's draw
    inherited = torch.rand(3, generator=seeded)  # what the next call would draw if it kept that generator
    for rank, (view, view_again) in enumerate(zip(seen, again)):
        assert not torch.allclose(view["rand"], inherited), "the RNG kept the previous call's seed"
        assert not torch.equal(view["rand"], view_again["rand"]), "two calls drew the same numbers"
        assert view["dtype"] == "torch.float32" and view["grad"] and not view["deterministic"]
        assert view["hooks"] == 0 and view["cwd"] == os.getcwd() and view["left_behind"] is None
        assert view["set_by_test"] == "from the test" and view["rank_var"] == str(rank)
        assert view["backend"] == os.environ.get("ZERO_STRATEGY_KERNELS", "auto") and view["threads"] == 1


def _raise_on_rank_0_while_1_waits(rank, world_size):
    if rank == 0:
        raise ValueError("rank 0 gives up")
    dist.all_reduce(torch.ones(1))  # waits for rank 0, which never comes
    return "unreachable"


def _hang_on_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(3600)
    return rank


def _die_on_rank_1(rank, world_size):
    if rank == 1:
        os._exit(3)
    return rank


def _abort_on_rank_1(rank, world_size):
    if rank == 1:
        os.abort()  # what glibc does on finding its heap corrupted
    return rank


@pytest.mark.timeout(180)
def test_a_failure_a_hang_and_a_death_fail_the_call_and_the_next_call_works():
    first_pool = run_distributed(_pid_and_sum, 2, 0)[0][0]
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="(?s)rank 0:.*ValueError: rank 0 gives up.*rank 1:.*all_reduce"):
        run_distributed(_raise_on_rank_0_while_1_waits, 2)
    assert time.monotonic() - start < distributed.GRACE_S + 5, "the waiting peer held the call"
    second_pool = run_distributed(_pid_and_sum, 2, 0)[0][0]  # started here, so the deadline below is the call's
    assert second_pool != first_pool
    with pytest.raises(RuntimeError, match="(?s)rank 1: no answer by the call's deadline.*_hang_on_rank_1"):
        run_distributed(_hang_on_rank_1, 2, timeout_s=3)
    with pytest.raises(RuntimeError, match=r"rank 1:\nthe worker process died \(exit code 3\)"):
        run_distributed(_die_on_rank_1, 2)
    # a native crash comes with the Python stack it happened in (faulthandler's, written by the worker)
    with pytest.raises(RuntimeError, match=r"(?s)rank 1:\nthe worker process died \(signal SIGABRT\).*Fatal Python "
                                           r"error: Aborted.*_abort_on_rank_1"):
        run_distributed(_abort_on_rank_1, 2)
    pid, total = run_distributed(_pid_and_sum, 2, 1)[0]
    assert total == 3.0 and pid not in (first_pool, second_pool)


def _destroy_the_group(rank, world_size):
    dist.destroy_process_group()
    return os.getpid()


@pytest.mark.timeout(180)
def test_fresh_calls_and_other_world_sizes_get_their_own_processes_and_a_broken_group_is_replaced():
    pooled = run_distributed(_pid_and_sum, 2, 0)[0][0]
    fresh = run_distributed(_pid_and_sum, 2, 0, fresh=True)[0][0]
    three = run_distributed(_pid_and_sum, 3, 0)
    one = run_distributed(_pid_and_sum, 1, 5)
    distributed.close_pools(1, 3)  # two cores: do not keep them for the rest of the session
    assert len({pooled, fresh, three[0][0], one[0][0]}) == 4
    assert [total for _, total in three] == [3.0] * 3 and one[0][1] == 5.0
    assert run_distributed(_pid_and_sum, 2, 0)[0][0] == pooled
    destroyed_in = run_distributed(_destroy_the_group, 2)  # the call itself succeeds...
    assert destroyed_in[0] == pooled
    assert run_distributed(_pid_and_sum, 2, 0)[0][0] != pooled  # ...and the next one gets a new pool


@pytest.mark.timeout(60)
def test_bad_arguments_are_refused_in_the_caller():
    with pytest.raises(ValueError, match="world_size='2'"):
        run_distributed(_pid_and_sum, "2", 0)
    with pytest.raises(ValueError, match="timeout_s=0"):
        run_distributed(_pid_and_sum, 2, 0, timeout_s=0)
    # in the caller, at once, not in a worker (AttributeError for a local object before Python 3.14)
    with pytest.raises((AttributeError, pickle.PicklingError), match="Can't pickle local object.*<lambda>"):
        run_distributed(lambda rank, world_size: rank, 2)
