"""Stage 3 with no option (``ZeroConfig(stage=3)``) on models whose calls depend on the data (issue 52),
against DDP(find_unused_parameters=True) on the same seed and data, engine only, gloo: routed experts
(top-1, top-2 calling an expert twice, DeepSeek's shared + routed) whose layers the plan makes leaves
([Note: leaf modules] in zero_strategy/engine/params/plan.py), and experts without a router, a block
applied a per-rank number of times and a branch taken on some ranks, whose leaves are learned in the
first passes ([Note: learned leaves] in zero_strategy/engine/params/leaves.py). Two micro-batches per
step in every other step; 2 ranks for every model, 4 for one, whose checkpoint 2 ranks resume."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from zero_strategy import ZeroConfig, ZeroOptimizer, gathered_parameters
from zero_strategy.checkpoint import CheckpointReader, load_model, load_optimizers, save_sharded
from zero_strategy.checkpoint.sharded import flat_groups
from zero_strategy.engine import Collectives, shard_module
from zero_strategy.engine.params.unit import UnitState

from .distributed import run_distributed
from .routed import EXPERTS, MODELS, batch, batch_of, loss_of

STEPS, SAVE_AT, LR = 10, 5, 0.01
TOLERANCE = dict(rtol=1e-6, atol=1e-6)
LEARNED = {  # the leaf learned where the ranks part first; its class-mates with it
    "hashed": ({"blocks.0.moe", "blocks.1.moe"}, ["blocks.0.moe", "blocks.1.moe"]),
    "adaptive-depth": ({"(the model)"}, ["(the model)"]),
    "branch": ({"blocks.0", "blocks.1"}, ["blocks.0", "blocks.1"]),
}
FOUR_RANKS = ("hashed",)  # learned where 4 ranks part, and resumed by 2 (each run costs seconds: one case)
RESUMED = ("hashed",)  # saved by 4 ranks at SAVE_AT, resumed by 2


def _optimizer(model) -> torch.optim.Optimizer:
    # SGD: its update is linear in the gradient, so the two runs' rounding (sums in another order) stays at
    # rounding; Adam's first steps follow a near-zero gradient's sign, which that rounding may flip
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def _engine(model):
    config = ZeroConfig(stage=3)  # the defaults, as a user meets them
    user = _optimizer(model)  # over the parameters before sharding
    sharder = shard_module(model, config)
    return sharder, ZeroOptimizer(user, config, sharder=sharder)


def _steps(model, opt, batches, steps: range) -> list[float]:
    losses = []
    for step in steps:
        opt.zero_grad()
        micros = 2 if step % 2 == 0 else 1  # gradient accumulation in every other step (DDP's first without sync)
        for micro in range(micros):
            with model.no_sync() if isinstance(model, DistributedDataParallel) and micro < micros - 1 \
                    else contextlib.nullcontext():
                loss = loss_of(model, *batches(step, micro))
                loss.backward()
            losses.append(loss.item())
        opt.step()
    return losses


def _whole(model) -> dict[str, torch.Tensor]:
    with gathered_parameters(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _run(rank: int, world_size: int, case: str, folder: str) -> dict:
    factory, _ = MODELS[case]
    torch.manual_seed(0)
    model = factory()
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(reference, find_unused_parameters=True)
    ddp_opt = _optimizer(reference)
    sharder, opt = _engine(model)
    planned = [u.name for u in sharder.units]
    released = []  # at the last block's forward in the last step: the first block's units are released

    def look(module, args) -> None:
        first = {id(m) for m in model.blocks[0].modules()}
        units = [u for u in sharder.units if all(id(m) in first for m in u.modules)]
        released.append(bool(units) and all(u.state is UnitState.RELEASED for u in units))

    def batches(step, micro):
        return batch(step, rank, micro)

    losses, ref_losses, hook = [], [], None
    for step in range(STEPS):
        if step == STEPS - 1 and hasattr(model, "blocks"):
            hook = model.blocks[-1].register_forward_pre_hook(look)
        ref_losses += _steps(ddp, ddp_opt, batches, range(step, step + 1))
        losses += _steps(model, opt, batches, range(step, step + 1))
        if step + 1 == SAVE_AT and case in RESUMED and world_size == 4:
            save_sharded(Path(folder) / case, {"global_step": SAVE_AT, "optimizer_states": [{}]}, model, [opt],
                         sharder, Collectives(), 3)
    if hook is not None:
        hook.remove()
    learner = sharder.learner
    params = _whole(model)
    return {"mismatch": _mismatch(losses, ref_losses, params, reference),
            "params": params if case in RESUMED else {},
            "record": model.record, "planned": planned, "plan_leaves": [n for n, _ in sharder.plan.leaves],
            "learned": list(learner.learned), "checking": learner.checking, "units": [u.name for u in sharder.units],
            "released": released}


def _mismatch(losses: list[float], ref_losses: list[float], params: dict, reference) -> list[str]:
    """Where the run differs from DDP's beyond TOLERANCE (compared here: the weights stay in the worker)."""
    found = []
    pairs = [("losses", torch.tensor(losses), torch.tensor(ref_losses))]
    pairs += [(n, params[n], p.detach()) for n, p in reference.named_parameters()]
    for name, got, want in pairs:
        try:
            torch.testing.assert_close(got, want, **TOLERANCE)
        except AssertionError as error:
            found.append(f"{name}: {error}")
    return found


def _resume(rank: int, world_size: int, case: str, folder: str) -> dict:
    """Rank ``rank`` of 2 stands for ranks 2r and 2r+1 of the 4 that saved: their batches as one."""
    torch.manual_seed(1)  # other weights: all must come from the checkpoint
    model = MODELS[case][0]()
    sharder, opt = _engine(model)
    reader = CheckpointReader(Path(folder) / case)
    saved = reader.trainer_state()["zero_checkpoint"]
    load_model(reader, saved, model, flat_groups([opt], sharder))
    load_optimizers(reader, saved, model, [opt])
    _steps(model, opt, lambda step, micro: batch_of(step, [2 * rank, 2 * rank + 1], micro), range(SAVE_AT, STEPS))
    return {"params": _whole(model), "learned": list(sharder.learner.learned)}


class _Pairs(torch.nn.Module):
    """Eight small experts, of which each token takes the first or the second by its sign: with units of
    two experts, every rank gathers the same unit, but enters it once or twice (see _entries_differ)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(8))

    def forward(self, x):
        out = torch.zeros_like(x)
        for e in range(2):
            rows = ((x[:, 0] > 0).long() == e).nonzero().squeeze(1)
            if rows.numel():
                out = out.index_add(0, rows, self.experts[e](x[rows]))
        return x + out


def _entries_differ(rank: int) -> dict:
    """Where the ranks' gathers agree and the units they enter do not, the leaf is learned at the pass's
    end (``LeafLearner._learn_from_entries``); a small model, units of two experts (unit_params=150)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Pairs(), _Pairs())
    reference = DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    config = ZeroConfig(stage=3, param_persistence_threshold=0, unit_params=150)
    user = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sharder = shard_module(model, config)
    opt = ZeroOptimizer(user, config, sharder=sharder)
    planned = [u.name for u in sharder.units]
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    losses, ref_losses = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
        for m, o, out in ((reference, ref_opt, ref_losses), (model, opt, losses)):
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            o.step()
            out.append(loss.item())
    return {"mismatch": _mismatch(losses, ref_losses, _whole(model), reference.module), "planned": planned,
            "units": [u.name for u in sharder.units], "learned": list(sharder.learner.learned),
            "announced_only": sharder.learner.checking is False}


def _runs(rank: int, world_size: int, cases: tuple[str, ...], folder: str) -> dict:
    out = {case: _run(rank, world_size, case, folder) for case in cases}
    if world_size == 2:
        out["entries"] = _entries_differ(rank)
    return out


def _resumes(rank: int, world_size: int, folder: str) -> dict:
    return {case: _resume(rank, world_size, case, folder) for case in RESUMED}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """world size -> each rank's runs; "resumed" -> each of 2 ranks' runs from the 4 ranks' checkpoints."""
    folder = str(tmp_path_factory.mktemp("checkpoints"))
    out = {2: run_distributed(_runs, 2, tuple(MODELS), folder), 4: run_distributed(_runs, 4, FOUR_RANKS, folder)}
    out["resumed"] = run_distributed(_resumes, 2, folder)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "case"), [(2, case) for case in MODELS] + [(4, case) for case in FOUR_RANKS])
def test_stage3_defaults_train_data_dependent_models_as_ddp(runs, world, case):
    by_rank = [r[case] for r in runs[world]]
    for rank, run in enumerate(by_rank):
        assert not run["mismatch"], f"rank {rank}: " + "\n".join(run["mismatch"])
        assert not run["checking"], "the checking passes go on"  # learned, then stable: they stop
        assert all(run["released"]), "a learned leaf stayed gathered after its pass"
    run = by_rank[0]
    if MODELS[case][1]:  # the plan sees the router: the layers are leaves from the start
        assert run["plan_leaves"] == ["blocks.0.moe", "blocks.1.moe"] == run["planned"] == run["units"]
        assert run["learned"] == []
    else:  # the plan split the modules; the ranks parted inside them and a leaf was learned
        first, units = LEARNED[case]
        assert run["plan_leaves"] == [] and len(run["planned"]) > len(units)
        for r in by_rank:
            assert len(r["learned"]) == 1 and r["learned"][0] in first, r["learned"]
            assert r["units"] == units, r["units"]
    _assert_the_data_made_the_ranks_part(case, [r["record"] for r in by_rank])


def _assert_the_data_made_the_ranks_part(case: str, records: list) -> None:
    """What the models recorded shows the pattern each case is about, so parity above means something."""
    if case == "adaptive-depth":  # one entry per forward
        assert any(len({r[i] for r in records}) > 1 for i in range(len(records[0]))), "the depths never differed"
        return
    for layer in range(len(records[0])):
        forwards = [r[layer] for r in records]  # per rank: one entry per forward
        differ = [i for i in range(len(forwards[0])) if len({tuple(f[i]) if case != "branch" else f[i]
                                                             for f in forwards}) > 1]
        assert differ, f"layer {layer}: the ranks never called different modules"
        if case == "branch":
            continue
        unused = [i for i in range(len(forwards[0])) if set().union(*(set(f[i]) for f in forwards)) != set(
            range(EXPERTS))]
        assert unused, f"layer {layer}: no forward left an expert unused on every rank"
        if case in ("top2", "shared-routed"):
            assert any(len(f[i]) > len(set(f[i])) for f in forwards for i in range(len(f))), "no expert ran twice"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", RESUMED)
def test_a_checkpoint_of_4_ranks_resumes_on_2_as_the_uninterrupted_run(runs, case):
    for rank, resumed in enumerate(runs["resumed"]):
        for name, value in runs[4][2 * rank][case]["params"].items():  # the 4-rank run went on without a stop
            torch.testing.assert_close(resumed[case]["params"][name], value, **TOLERANCE,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
        assert len(resumed[case]["learned"]) == 1 and resumed[case]["learned"][0] in LEARNED[case][0]


def test_the_leaf_is_the_innermost_module_every_rank_is_in_or_past_in_the_same_call():
    """``LeafLearner._choose`` on what ranks report (their phase, the modules their forward is inside and
    each module's calls in the pass), without processes: see [Note: learned leaves]."""
    from zero_strategy.engine.comm.order_guard import BACKWARD, FORWARD, PREFETCH_FORWARD
    from zero_strategy.engine.params.leaves import LeafLearner

    from .routed import MoENet

    model = MoENet(top_k=1, gate="hash")
    number = {m: i for i, m in enumerate(model.modules())}
    root, block, moe = 0, number[model.blocks[1]], number[model.blocks[1].moe]
    learner = LeafLearner.__new__(LeafLearner)
    learner.modules = list(model.modules())
    holders = {model, model.blocks[0], model.blocks[1], model.blocks[0].moe, model.blocks[1].moe}
    learner.sharder = type("Sharder", (), {"units_inside": staticmethod(lambda m: m in holders)})()
    calls = {root: 1, number[model.blocks[0]]: 1, number[model.blocks[0].moe]: 1, block: 1, moe: 1}

    def choose(*ranks):
        return learner._choose(list(ranks))

    # both inside the same call of the layer, asking for different experts: the layer
    assert choose((FORWARD, [root, block, moe], calls), (FORWARD, [root, block, moe], calls)) is model.blocks[1].moe
    # one rank called fewer experts and went on to backward: it is past the layer's call
    assert choose((PREFETCH_FORWARD, [root, block, moe], calls), (BACKWARD, [], calls)) is model.blocks[1].moe
    # the layer's calls differ (a block applied a per-rank number of times): the module around it
    assert choose((FORWARD, [root, block, moe], {**calls, moe: 2}), (BACKWARD, [], calls)) is model.blocks[1]
    # the model's forward entered a different number of times (an extra forward on one rank): no leaf
    assert choose((FORWARD, [root], {root: 2}), (FORWARD, [root], {root: 1})) is None
    # a divergence in backward only: no forward to learn from
    assert choose((BACKWARD, [], calls), (BACKWARD, [], calls)) is None


@pytest.mark.timeout(300)
def test_ranks_that_gather_alike_but_enter_units_differently_learn_the_leaf_at_the_pass_end(runs):
    for rank, by_case in enumerate(runs[2]):
        run = by_case["entries"]
        assert not run["mismatch"], f"rank {rank}: " + "\n".join(run["mismatch"])
        assert "0.experts.0..0.experts.1" in run["planned"]  # two experts a unit
        assert run["units"] == ["0", "1"] and len(run["learned"]) == 1 and run["announced_only"], run
