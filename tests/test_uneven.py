"""Ranks whose work differs (issue 33): uneven batches under Join against DDP's Join, GPT-2's
generate() with per-rank lengths at stage 3 in every front end against DDP's tokens, a rank that
fails after rank 0 finished failing the job, and generate() on rank 0 only named as the cause."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import HashStore
from torch.nn.parallel import DistributedDataParallel

from zero_strategy import Join, ZeroConfig, initialize
from zero_strategy.engine import Collectives
from zero_strategy.engine.diagnose.rank_board import RankBoard
from zero_strategy.frontend import WorkingPrecision, clip_grad_norm, setup_engine
from zero_strategy.frontend.in_step import no_sync

from .cli_runs import run_at_once
from .distributed import run_distributed

SCRIPT = Path(__file__).parent / "scripts" / "uneven_run.py"
BATCHES = (5, 3)  # rank 0 has 5 batches, rank 1 has 3


# ---- the rank board, without processes ---------------------------------------------------------
BOARD_LETS_GO = """
import socket
import torch.distributed as dist
from zero_strategy.engine.diagnose import rank_board
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
try:
    board = rank_board.board()
    assert board.store is not None and rank_board.board() is board
finally:
    dist.destroy_process_group()
assert board.store is None and not rank_board.board().enabled
with socket.socket() as s:  # the port is free again: nothing serves the old store
    s.bind(("127.0.0.1", port))
print("free")
"""


@pytest.mark.timeout(60)
def test_the_board_keeps_no_destroyed_group_serving():
    """The board holds neither the group nor its store: once the group is destroyed its TCP store
    stops serving, so a Hydra multirun's next job cannot meet the last job's store (it did: its
    ranks timed out connecting). In a process of its own: the suite's may hold a group already."""
    proc = subprocess.run([sys.executable, "-c", BOARD_LETS_GO], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0 and "free" in proc.stdout, proc.stderr[-3000:]




def test_the_board_tells_parted_ways_from_a_rank_gone_ahead_or_behind():
    store = HashStore()
    zero, one = RankBoard(store, 0, 2), RankBoard(store, 1, 2)
    for board in (zero, one):
        board.mark("ended validation")
    assert zero.divergence("all-gather of unit 'h.0'", 60.0) is None  # in step
    one.mark("ended validation")  # rank 1 has gone ahead: rank 0, waiting in a collective, sees it only...
    assert zero.divergence("all-gather of unit 'h.0'", 1.0) is None  # ...after LEFT_AFTER_S
    assert zero.divergence("all-gather of unit 'h.0'", 11.0) is None  # ...on two reads in a row
    left = zero.divergence("all-gather of unit 'h.0'", 12.0)
    assert left.startswith("rank 1 ended validation while rank 0 waited for the all-gather of unit 'h.0' (12 s; it "
                           "last ended validation): rank 1 will not join it. To fix it:"), left
    assert "zero_strategy.Join" in left
    assert one.divergence("all-gather of unit 'h.1'", 60.0) is None  # rank 0 behind: only slower
    zero.mark("entered generate()")  # boundary 2 of each differs: the ranks went different ways
    one.note("joined (Join)")
    parted = zero.divergence()
    assert parted.startswith("rank 1 ended validation (joined (Join)) where rank 0 entered generate() (boundary 2")
    assert "every rank must call generate()" in parted
    one.post("end", "failed: ValueError: boom")
    assert zero.divergence() == "rank 1 failed: ValueError: boom"
    assert RankBoard(None, 0, 2).divergence() is None  # no store: the board is off


# ---- Join against DDP's Join --------------------------------------------------------------------


def _net(batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    # a norm's statistics follow each rank's batches (issue 50); the linear before it has no bias, whose gradient
    # would be rounding noise, which AdamW scales up to a whole step (summed in another order than DDP's)
    norm = [nn.BatchNorm1d(16)] if batchnorm else []
    return nn.Sequential(nn.Linear(6, 16, bias=not batchnorm), *norm, nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def _batches(rank: int, counts: tuple[int, int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(counts[rank])]


def _loop(model, optimizer, scheduler, batches, accumulate: int, clip, no_sync) -> None:
    for i, (x, y) in enumerate(batches):
        boundary = (i + 1) % accumulate == 0
        with no_sync() if not boundary else contextlib.nullcontext():
            (F.mse_loss(model(x), y) / accumulate).backward()
        if boundary:
            clip()
            optimizer.step()
            scheduler.step()  # on the working ranks only, once one has joined: it steps with their rate
            optimizer.zero_grad()


def _join_vs_ddp(rank, world_size, cases):
    results = {}
    for stage, accumulate, max_norm, counts, *batchnorm in cases:
        batches = _batches(rank, counts)
        reference = _net(bool(batchnorm))
        ddp = DistributedDataParallel(reference)
        ddp_opt = torch.optim.AdamW(reference.parameters(), lr=0.05, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(ddp_opt, step_size=1, gamma=0.5)
        with ddp.join():  # DDP's: the joined rank all-reduces zeros; the last joiner's weights go to every rank
            _loop(ddp, ddp_opt, scheduler, batches, accumulate,
                  lambda: torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm) if max_norm else None,
                  ddp.no_sync)

        model = _net(bool(batchnorm))
        if stage == "initialize":  # DeepSpeed's loop: engine(x), engine.backward(loss), engine.step()
            engine, _, _, _ = initialize(model=model, config=_deepspeed_config(max_norm),
                                         lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
            with Join(engine):
                for x, y in batches:
                    engine.backward(F.mse_loss(engine(x), y))
                    engine.step()  # clips, steps the optimizer and the scheduler, zeroes the gradients
            ours = engine.engine_model.full_state_dict()
        else:
            config = ZeroConfig(stage=stage, shard_modules=("Linear",), param_persistence_threshold=0)
            engine = setup_engine(model, config, WorkingPrecision("32-true"), Collectives(), torch.device("cpu"),
                                  [torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)])
            opt = engine.optimizers[0]
            ours_scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            with Join(model, opt):  # no_sync: DDP's buffer flag (the reduction happens anyway at stages 2-3)
                _loop(model, opt, ours_scheduler, batches, accumulate,
                      lambda: clip_grad_norm(opt, max_norm) if max_norm else None,
                      lambda: no_sync(engine.buffer_sync))
            ours = engine.full_state_dict()
            engine.remove_hooks()
        theirs = reference.state_dict()
        results[(stage, accumulate, max_norm, counts, *batchnorm)] = max((ours[k].float() - theirs[k].float()).abs().max()
                                                                          .item() for k in theirs)
    return results


def _deepspeed_config(max_norm: float) -> dict:
    """The run above as a DeepSpeed config: stage 3, AdamW, clipping."""
    return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": max_norm,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.1, "torch_adam": True}}}


def test_uneven_batches_under_join_end_with_ddp_joins_weights_at_every_stage():
    # (stage, micro-batches per step, clipping, batches of rank 0 and 1); at stage 3 every Linear is a
    # sharded unit. With accumulation, rank 1 joins at a step boundary: a micro-batch it had accumulated
    # would count here (its gradient is reduced already at stages 2-3), where DDP's Join drops it
    cases = [(1, 1, None, BATCHES), (2, 1, None, BATCHES), (3, 1, None, BATCHES), (3, 1, 0.05, BATCHES),
             (1, 2, 0.05, (6, 4)), (3, 2, 0.05, (6, 4)), ("initialize", 1, 0.05, BATCHES),
             # a batch norm: the buffers come from the highest working rank, and a joined rank's stay as the
             # broadcast left them (see [Note: joining] in zero_strategy/engine/join.py)
             (2, 1, None, BATCHES, "bn"), (3, 2, None, (6, 4), "bn")]
    for differences in run_distributed(_join_vs_ddp, 2, cases):
        for case, difference in differences.items():
            assert difference < 1e-6, (case, difference)


# ---- launched jobs: generate() and a failing rank -----------------------------------------------


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for var in ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict:
    """Both launched jobs at once: case -> (finished process, its folder, when it ended)."""
    dirs = {case: tmp_path_factory.mktemp(case) for case in ("generate", "rank0_only")}
    runs = run_at_once({case: ([sys.executable, str(SCRIPT), case, str(d)], _env(), None)
                        for case, d in dirs.items()}, timeout=200)
    return {case: (runs[case][0], dirs[case], time.time()) for case in dirs}


@pytest.mark.timeout(300)
def test_generate_at_stage_3_gives_each_rank_ddps_tokens_and_a_rank_failing_later_fails_the_job(jobs):
    proc, out, ended = jobs["generate"]
    output = proc.stdout + proc.stderr
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, seen in enumerate(ranks):
        reference = seen["ddp_validation"]
        assert len(reference[0]) == 4 + 3 + 3 * rank  # its own prompt and its own number of new tokens
        for where in ("zero_validation", "zero_predict", "fabric", "peft"):
            assert seen[where] == reference, (rank, where, seen)
    assert ranks[0]["ddp_validation"] != ranks[1]["ddp_validation"]
    # rank 0's script had returned when rank 1 raised: the job still fails, naming rank 1 and its error
    assert proc.returncode != 0, output[-3000:]
    assert "zero_strategy: rank 0: the job failed: rank 1 failed: RuntimeError: rank 1 broke after rank 0 had " \
           "finished" in output, output[-3000:]
    assert ended - float((out / "finished").read_text()) < 60


@pytest.mark.timeout(300)
def test_generate_on_rank_zero_only_names_the_cause_on_every_rank(jobs):
    proc, out, ended = jobs["rank0_only"]
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert "rank 1: the job failed: rank 0 entered generate() where rank 1 ended validation" in output, output[-3000:]
    assert "rank 1 ended validation where rank 0 entered generate()" in output, output[-3000:]
    assert output.count("not under `if trainer.is_global_zero:`") >= 2  # the way that works, on both ranks
    started = max(float((out / f"started{r}").read_text()) for r in range(2))
    assert ended - started < 60
