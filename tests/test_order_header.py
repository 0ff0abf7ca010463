"""The order guard's header rides in every stage-3 all-gather (see [Note: the collective header]):
a rank that runs other units, at any pass, stops every rank with UnitOrderError before a step uses
mixed weights (2 gloo processes, engine only)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zero_strategy import gathered_parameters
from zero_strategy.config import ZeroConfig
from zero_strategy.engine import Collectives, ZeroOptimizer, shard_module
from zero_strategy.engine.diagnose.header import HEADER_BYTES, Header, decode, encode
from zero_strategy.engine.diagnose.watchdog import UnitOrderError
from zero_strategy.engine.diagnose.tally import TALLY_BYTES, agreed, tally_bytes

from .distributed import run_distributed


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    """Two blocks of the same size, as units: a gather of one pairs with a gather of the other."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.head = nn.Linear(width, 1)

    def forward(self, x, diverge=None):
        order = [0, 1]
        if diverge == "skip":
            order = [0]  # a data-dependent branch taken on one rank only
        elif diverge == "other":
            order = [1, 1]  # the other block of the same size in place of the first
        elif diverge == "twice":
            order = [0, 0, 1]  # one block called again
        for i in order:
            x = self.blocks[i](x)
        return self.head(x)


CASES = {
    # name: (how rank 1 diverges, at which pass (1-based), config options, tags compared at the end
    # of the pass as on CUDA)
    "skip-pass-1": ("skip", 1, {}, False),
    "skip-pass-15": ("skip", 15, {}, False),  # a pass the sampling guard did not check
    "other-unit-pass-15": ("other", 15, {}, False),
    "twice-pass-101": ("twice", 101, {}, False),
    "skip-pass-15-quantized": ("skip", 15, {"quantized_weights": True}, False),
    "other-unit-pass-15-secondary": ("other", 15, {"secondary_partition_size": 2}, False),
    "other-unit-pass-15-deferred": ("other", 15, {}, True),
    # wide blocks (see WIDE): headers left out, tags compared at the step, or at the end of an evaluation pass
    "skip-pass-15-broadcasts": ("skip", 15, {}, False),
    "other-unit-pass-15-broadcasts": ("other", 15, {}, False),
    "other-unit-in-evaluation-pass-15-broadcasts": ("other", 15, {}, False),
    # hybrid sharding, 4 ranks: ranks 0 and 1 find it in their shard group's gathers; ranks 2 and 3, in
    # step with each other, wait across the groups for them and learn it from the rank board
    "other-unit-pass-15-hybrid": ("other", 15, {"shard_group_size": 2}, False),
    # rank 1 evaluates (a forward without grad, no backward, no step) where rank 0 trains: rank 0's backward
    # gathers a block where rank 1 ends its pass and would gather the root (another size: gloo's abort)
    "evaluation-on-one-rank-pass-15": ("evaluate", 15, {}, False),
}
FOUR_RANKS = ("skip-pass-15", "other-unit-pass-15-secondary", "other-unit-pass-15-hybrid",
              "other-unit-pass-15-broadcasts")
TWO_RANKS = tuple(c for c in CASES if "shard_group_size" not in CASES[c][2])
# blocks whose gathers go by broadcasts on gloo (one thread per rank, over 1 MiB: [Note: all-gather on
# gloo]), which leave their headers out: see [Note: headers left out on gloo]
WIDE = {case: 512 for case in CASES if case.endswith("-broadcasts")}


def _diverging_runs(rank, world_size, cases):
    """Each case on a process group of its own (a diverged group keeps unmatched collectives):
    case -> (error message or None, seconds from the divergent pass to the error, whether this rank's
    shards and optimizer state are those from before the divergent pass, whether gathers left their
    headers out). An "evaluation" case's divergent pass is a forward without grad, backward or step."""
    out = {}
    for case in cases:
        how, at_pass, options, deferred = CASES[case]
        group = dist.new_group(list(range(world_size)))
        comm = Collectives(group, collective_timeout=600.0, ranks_per_node=world_size)
        config = ZeroConfig(stage=3, shard_modules=("Block",), param_persistence_threshold=0,
                            unit_order_wait=1.0, **options)  # 5 s by default: shorter, for a fast test
        torch.manual_seed(0)
        width = WIDE.get(case, 16)
        model = Net(width)
        torch.set_num_threads(1)
        sharder = shard_module(model, config, comm=comm)
        sharder.guard.deferred = deferred
        opt = ZeroOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), config, sharder=sharder)
        error, elapsed, before = None, None, None
        for step in range(at_pass + 1):  # one more: a rank that diverged by evaluating trains again
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(4, width, generator=g), torch.randn(4, 1, generator=g)
            diverging = rank == 1 and step == at_pass - 1
            if step == at_pass - 1:
                before = _state(sharder, opt)
            start = time.monotonic()
            try:
                if (diverging and how == "evaluate") or ("evaluation-pass" in case and step == at_pass - 1):
                    with torch.no_grad():
                        model(x, how if diverging and how != "evaluate" else None)
                    continue
                opt.zero_grad()
                F.mse_loss(model(x, how if diverging else None), y).backward()
                opt.step()
            except UnitOrderError as err:
                error, elapsed = str(err), time.monotonic() - start
                break
        unchanged = before is not None and all(torch.equal(a, b) for a, b in zip(before, _state(sharder, opt)))
        out[case] = (error, elapsed, unchanged, sharder.guard.leaves_out)
    return out


def _state(sharder, opt) -> list[torch.Tensor]:
    """The shards (stage 3), the optimizer's own parameters (the masters) and its state."""
    tensors = [g.shard.clone() for g in sharder.groups if hasattr(g, "shard")]
    inner = getattr(opt, "optimizer", None)
    if inner is not None:
        tensors += [p.detach().clone() for group in inner.param_groups for p in group["params"]]
        for state in inner.state.values():
            tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


@pytest.fixture(scope="module")
def diverged():
    """world size -> each rank's (unit cases, step cases): both tests' cases (``CASES`` and
    ``STEP_CASES``), each case on a group of its own, on workers of their own, three sets at once: at 2
    ranks the unit cases and the step cases, at 4 ranks both (most of a case is the 1 s a rank
    waits for the other's order report)."""
    # workers of their own, ended after: the diverged groups keep unmatched collectives, which stall a pool's closing
    sets = {(2, "unit"): ([*TWO_RANKS], []), (2, "step"): ([], STEP_CASES[2]),
            (4, "both"): ([*FOUR_RANKS], STEP_CASES[4])}
    with ThreadPoolExecutor(len(sets)) as pool:
        calls = {key: pool.submit(run_distributed, _all_runs, key[0], *cases, alone=True, timeout_s=150)
                 for key, cases in sets.items()}
        ranks = {key: call.result() for key, call in calls.items()}
    return {2: [(unit, step) for (unit, _), (_, step) in zip(ranks[2, "unit"], ranks[2, "step"])], 4: ranks[4, "both"]}


def _all_runs(rank, world_size, unit_cases, step_cases):
    return _diverging_runs(rank, world_size, unit_cases), _step_divergence_runs(rank, world_size, step_cases)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("world", "case"), [(2, c) for c in TWO_RANKS] + [(4, c) for c in FOUR_RANKS])
def test_a_rank_running_other_units_at_any_pass_stops_every_rank_before_the_step(diverged, world, case):
    how, at_pass, _, _ = CASES[case]
    for rank, (results, _) in enumerate(diverged[world]):
        error, elapsed, unchanged, left_out = results[case]
        assert left_out == (case in WIDE), f"rank {rank}: headers left out: {left_out}"
        assert error is not None, f"rank {rank}: no UnitOrderError"
        if how == "evaluate":  # gloo paired rank 0's gradient reduce-scatter with rank 1's next gather
            assert "the ranks issued different collectives at the same point" in error, error
            assert f"(backward, pass {at_pass})" in error and f"(pass {at_pass + 1}, gather 1 in it)" in error, error
        else:
            assert "the ranks gathered different units at the same point" in error, error
            assert f"(pass {at_pass}, gather" in error, error
        assert "rank 0:" in error and "rank 1:" in error, error
        assert elapsed < 30, f"rank {rank} took {elapsed:.0f} s"
        assert unchanged, f"rank {rank}: shards or optimizer state changed in the divergent pass"


def _step_divergence_runs(rank, world_size, cases):
    """Each (stage, how, pass) case: at that pass (1-based) rank 1 runs one micro-batch more than
    the others before the step ("extra micro-batch"), skips the step ("skipped step") or enters
    gathered_parameters alone; see [Note: collectives that differ] in zero_strategy/engine/diagnose/divergence.py
    (stages 2-3),
    [Note: the step's tally] in zero_strategy/engine/diagnose/tally.py (stage 1, whose collectives are the same either
    way)
    and [Note: gathers outside passes] in zero_strategy/engine/params/flat_parameters.py. -> (error or None, seconds
    from the
    divergent pass to it, whether this rank's shards and optimizer state are those from before it)."""
    out = {}
    for stage, how, at_pass in cases:
        group = dist.new_group(list(range(world_size)))
        comm = Collectives(group, collective_timeout=600.0, ranks_per_node=world_size)
        config = ZeroConfig(stage=stage, shard_modules=("Block",), param_persistence_threshold=0, unit_order_wait=1.0)
        torch.manual_seed(0)
        model = Net()
        sharder = shard_module(model, config, comm=comm)
        opt = ZeroOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), config, sharder=sharder)
        error, elapsed, before, start = None, None, None, 0.0
        for step in range(at_pass + 1):
            at = step == at_pass - 1
            diverging = rank == 1 and at
            before = _state(sharder, opt) if at else before
            start = time.monotonic() if at else start
            try:
                if diverging and how == "gathered_parameters":  # entered on one rank only
                    with gathered_parameters(model):
                        pass
                opt.zero_grad()
                for m in range(2 if diverging and how == "extra micro-batch" else 1):
                    g = torch.Generator().manual_seed(100 * step + 10 * m + rank)
                    x, y = torch.randn(4, 16, generator=g), torch.randn(4, 1, generator=g)
                    F.mse_loss(model(x), y).backward()
                if not (diverging and how == "skipped step"):
                    opt.step()
            except UnitOrderError as err:
                error, elapsed = str(err), time.monotonic() - start
                break
        out[(stage, how, at_pass)] = (error, elapsed, all(torch.equal(a, b) for a, b in zip(before, _state(sharder, opt))))
    return out


STEP_CASES = {
    2: [(stage, how, 15) for stage in (1, 2, 3) for how in ("extra micro-batch", "skipped step")]
    + [(1, "skipped step", 1), (1, "extra micro-batch", 101), (3, "gathered_parameters", 15)],
    4: [(1, "extra micro-batch", 15), (2, "skipped step", 15)],
}


@pytest.mark.timeout(240)
def test_a_rank_running_an_extra_micro_batch_or_skipping_a_step_stops_every_rank(diverged):
    for world, cases in STEP_CASES.items():
        results = [by_case for _, by_case in diverged[world]]
        assert all(list(by_case) == cases for by_case in results)
        for rank, by_case in enumerate(results):
            for (stage, how, at_pass), (error, elapsed, unchanged) in by_case.items():
                case = f"{world} ranks, stage {stage}, {how} at pass {at_pass}, rank {rank}"
                assert error is not None, f"{case}: no UnitOrderError"
                assert f"rank {rank}:" in error and "rank 1:" in error, error  # itself, and the rank that differs
                if stage == 1:  # every rank at its step at_pass, rank 1 after one more backward
                    assert "the ranks reached this optimizer step after different work" in error, error
                    assert f"rank 0: step {at_pass}, after {at_pass} backward passes" in error, error
                    assert f"rank 1: step {at_pass}, after {at_pass + 1} backward passes" in error, error
                    assert all(f"rank {r}:" in error for r in range(world)), error
                if how == "gathered_parameters":
                    assert "barrier that begins gathered_parameters" in error, error
                assert elapsed < 30, f"{case} took {elapsed:.0f} s"
                assert unchanged, f"{case}: shards or optimizer state changed after the divergence"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8])
def test_a_header_keeps_its_words_exactly_in_any_dtype(dtype):
    words = encode(2**31 - 1, 70_000, 4_000, 5, -1)  # beyond what bf16 or fp16 hold as numbers
    seen = []
    header = Header(words, seen.append)
    sent = header.send_as(dtype, torch.device("cpu"))
    assert sent.numel() * sent.element_size() == HEADER_BYTES
    received = Header.receive_buffer(2, dtype, torch.device("cpu"))
    received[0], received[1] = sent, sent
    header.received(received)
    assert decode(seen[0]) == [(2**31 - 1, 70_000, 4_000, 5, -1)] * 2


def test_the_tally_agrees_exactly_when_every_rank_sent_the_same():
    g = torch.Generator().manual_seed(0)
    values = [0, 1, 255, 256, 2**31 - 1] + torch.randint(0, 2**31 - 1, (20,), generator=g).tolist()
    for steps in values:
        for backwards in (steps, steps + 1, steps ^ 0x100, 0):
            for digest in (0, steps, 2**63 - 1 - steps):
                mine = tally_bytes(steps, steps, steps)
                other = tally_bytes(steps, backwards, digest)
                reduced = torch.maximum(mine, other)  # the all-reduce's MAX over the two ranks
                same = backwards == steps and digest == steps
                assert agreed(mine, reduced) == same and agreed(other, reduced) == same, (steps, backwards, digest)
    assert tally_bytes(7, 9, 11).numel() == TALLY_BYTES
