"""The overlapped host step (``offload_overlap``) against the same offloaded run without it: fp32,
2 gloo ranks, bit for bit; and the non-offloaded run within 1e-6, as in test_offload.py.

Each case also asserts what the overlap did (``offload_overlap_stats``): that updates made during
backward were committed where they are the step's own, and computed again or dropped where they
are not (clipping that cuts, a changed learning rate, accumulation, a late gradient, an overflow),
so that a run that silently never overlapped, or committed a wrong update, fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zero_strategy import ZeroConfig, ZeroOptimizer, gathered_parameters, memory_stats
from zero_strategy.engine import shard_module
from zero_strategy.engine.optim.step.overlap import same_settings
from zero_strategy.engine.grads.scaler import LossScaler

from .distributed import run_distributed
from .models import OddMLP, batch, param_groups
from .test_engine_parity import REENTRANT_BUCKET_MB, TINY_BUCKET_MB, SharedInsideCheckpoint

STEPS = 6
UNITS = dict(shard_modules=("Linear",), param_persistence_threshold=8)  # stage 3: biases stay whole

# what each case does differently from a plain step (max_norm 1e3 never clips OddMLP's gradients)
CASES = {
    "plain": {},
    "clip": dict(max_norm=0.05),  # cuts at every step: every early update is dropped
    "accumulate": dict(micro=2),  # the second backward reduces every segment again
    "lr": dict(lr_at=2),  # a learning rate changed between backward and step, at step 2
    "overflow": dict(overflow_at=3),  # a non-finite gradient at step 3 (loss scaler): step skipped
}


def _train(rank, stage, options, case):
    torch.manual_seed(0)
    model = OddMLP()
    config = ZeroConfig(stage=stage, bucket_cap_mb=TINY_BUCKET_MB, **(UNITS if stage == 3 else {}), **options)
    user_opt = torch.optim.AdamW(param_groups(model), lr=0.01)
    sharder = shard_module(model, config) if stage == 3 else None
    scaler = LossScaler(scale=2.0**4, hysteresis=1) if "overflow_at" in case else None
    opt = ZeroOptimizer(user_opt, config, sharder=sharder, scaler=scaler)
    sched = torch.optim.lr_scheduler.LambdaLR(user_opt, lambda s: 1.0 / (1 + 0.1 * s))
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(case.get("micro", 1)):
            x, y = batch(10 * step + micro, rank)
            loss = F.mse_loss(model(x, step, rank if stage < 3 else 0), y)  # stage 3: the same units everywhere
            if scaler is not None:
                bad = step == case["overflow_at"] and rank == 1
                (scaler.scale_loss(loss) * (float("inf") if bad else 1.0)).backward()
            else:
                loss.backward()
            losses.append(loss.item())
        if step == case.get("lr_at"):
            user_opt.param_groups[0]["lr"] *= 0.5
        opt.clip_grad_norm_(case.get("max_norm", 1e3))
        opt.step()
        sched.step()
    state = opt.state_dict()
    with gathered_parameters(model):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    host = memory_stats(model, [opt])["host"]
    stats = opt.offload_overlap_stats()
    opt.close()
    return losses, params, state, stats, host


def _variants(rank, world_size, stage, params_too):
    offload = dict(offload_optimizer=True, **(dict(offload_params=True) if params_too else {}))
    out = {}
    for name, case in CASES.items():
        out[name] = {"plain": _train(rank, stage, {}, case), "offload": _train(rank, stage, offload, case),
                     "overlap": _train(rank, stage, dict(offload_overlap=True, **offload), case)}
    return out


def _assert_same(got, want, what):
    """Bit for bit: the overlap commits exactly the step's own update, or makes the step itself."""
    g_losses, g_params, g_state = got[:3]
    w_losses, w_params, w_state = want[:3]
    assert g_losses == w_losses, what
    for key, value in w_params.items():
        assert torch.equal(g_params[key], value), f"{what}: {key}"
    assert g_state["param_groups"] == w_state["param_groups"], what
    assert g_state["state"].keys() == w_state["state"].keys(), what
    for index, entry in w_state["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(g_state["state"][index][key]), torch.as_tensor(value)), \
                f"{what}: state {index} {key}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage, params_too", [(2, False), (3, False), (3, True)])
def test_the_overlapped_host_step_gives_the_step_of_the_run_without_it(stage, params_too):
    for rank, rank_runs in enumerate(run_distributed(_variants, 2, stage, params_too)):
        for name, runs in rank_runs.items():
            what = f"rank {rank}, stage {stage}{' + offload_params' if params_too else ''}, {name}"
            _assert_same(runs["overlap"], runs["offload"], what)
            losses, params = runs["plain"][:2]
            torch.testing.assert_close(torch.tensor(runs["overlap"][0]), torch.tensor(losses), rtol=1e-6, atol=1e-6)
            for key, value in params.items():
                torch.testing.assert_close(runs["overlap"][1][key], value, rtol=1e-6, atol=1e-6)
            stats = runs["overlap"][3]
            assert runs["offload"][3] == {} and set(stats) == {"committed", "swapped", "redone", "dropped"}, what
            assert runs["overlap"][4] > runs["offload"][4], f"{what}: the shadows are not counted as host memory"
            if name == "plain":
                assert stats["committed"] > 0 and stats["dropped"] == 0 and stats["redone"] == 0, (what, stats)
                # groups commit without a copy, except where the parameter shard is the master
                assert 0 < stats["swapped"] <= stats["committed"], (what, stats)
                assert stats["swapped"] < stats["committed"] or not params_too, (what, stats)  # units' shards copy
            elif name == "clip":
                assert stats["committed"] == 0 and stats["dropped"] > 0, (what, stats)
            elif name == "accumulate":
                assert stats["redone"] > 0 and stats["committed"] > 0 and stats["dropped"] == 0, (what, stats)
            elif name == "lr":  # group 0's pieces of step 2 recomputed at the step, the rest committed
                assert 0 < stats["dropped"] < stats["committed"], (what, stats)
            elif name == "overflow":  # every rank skips step 3, whichever rank overflowed
                assert stats["dropped"] > 0 and stats["committed"] > 0, (what, stats)


def _late(rank, world_size):
    """A parameter reduced during backward gets a second gradient (reentrant checkpoint)."""
    out = {}
    for name, options in (("offload", {}), ("overlap", dict(offload_overlap=True))):
        torch.manual_seed(0)
        model = SharedInsideCheckpoint()
        opt = ZeroOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                            ZeroConfig(stage=2, bucket_cap_mb=REENTRANT_BUCKET_MB, offload_optimizer=True, **options))
        for step in range(4):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(5, 6, generator=g, requires_grad=True), torch.randn(5, 3, generator=g)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        out[name] = ({n: p.detach().clone() for n, p in model.named_parameters()}, opt.offload_overlap_stats())
        opt.close()
    return out


@pytest.mark.timeout(120)
def test_a_late_gradient_updates_its_segment_again():
    for rank_runs in run_distributed(_late, 2):
        (want, _), (got, stats) = rank_runs["offload"], rank_runs["overlap"]
        for key, value in want.items():
            assert torch.equal(got[key], value), key
        assert stats["redone"] > 0 and stats["committed"] > 0 and stats["dropped"] == 0, stats


def test_gradients_discarded_by_zero_grad_leave_the_step_as_it_was():
    torch.manual_seed(0)
    model = OddMLP()
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01),
                        ZeroConfig(stage=2, offload_optimizer=True, offload_overlap=True))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = batch(0, 0)
    F.mse_loss(model(x), y).backward()  # updated aside during backward...
    opt.zero_grad()  # ...and never stepped
    assert opt.state_dict()["state"] == {}
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name]), name
    assert opt.offload_overlap_stats()["committed"] == 0 and opt.offload_overlap_stats()["dropped"] > 0
    opt.close()


def test_offload_overlap_is_checked():
    with pytest.raises(ValueError, match="offload_overlap=True .* needs offload_optimizer=True at stage 2 or 3"):
        ZeroConfig(stage=2, offload_overlap=True)
    with pytest.raises(ValueError, match="stage=1"):
        ZeroConfig(stage=1, offload_optimizer=True, offload_overlap=True)
    with pytest.raises(ValueError, match="offload_dir='/tmp/x' keeps it on disk"):
        ZeroConfig(stage=2, offload_optimizer=True, offload_dir="/tmp/x", offload_overlap=True)
    with pytest.raises(ValueError, match="offload_overlap=1 must be True or False"):
        ZeroConfig(stage=2, offload_optimizer=True, offload_overlap=1)

    class MyAdam(torch.optim.Adam):
        pass

    with pytest.raises(ValueError, match="MyAdam is not one of them.*Set offload_overlap=False"):
        ZeroOptimizer(MyAdam(OddMLP().parameters()), ZeroConfig(stage=2, offload_optimizer=True, offload_overlap=True))


def test_settings_compare_by_value():
    lr = torch.tensor(0.1)
    assert same_settings({"lr": lr, "betas": (0.9, 0.99)}, {"lr": lr.clone(), "betas": (0.9, 0.99)})
    assert not same_settings({"lr": lr}, {"lr": lr * 2})
    assert not same_settings({"lr": 0.1}, {"lr": lr})
    assert not same_settings({"lr": 0.1}, {"lr": 0.1, "maximize": False})
    assert not same_settings({"betas": (0.9, 0.99)}, {"betas": (0.9, 0.98)})


@pytest.mark.timeout(900)  # may wait for DDP's launch of every case test_lightning.py needs
def test_the_overlapped_step_through_the_trainer_matches_ddp(tmp_root):
    # tests/scripts/lightning_run.py: fit with validation, an LR schedule, a frozen layer, two param groups
    from .test_lightning import CASES, assert_same_run, ddp_run, zero_runs

    runs = zero_runs(tmp_root, "zero2-offload-overlap")  # from test_lightning.py's one launch of every ZeRO case
    for name, zero in runs.items():
        assert_same_run(zero, ddp_run(tmp_root, *CASES[name]))
        for rank in zero:
            stats = rank["overlap"]
            if name == "clip":  # clipping cuts at every step: nothing made during backward is taken
                assert stats["committed"] == 0 and stats["dropped"] > 0, (name, stats)
            else:
                assert stats["committed"] > 0 and stats["dropped"] == 0, (name, stats)
            if name == "accumulate":
                assert stats["redone"] > 0, stats


def _one_process(loop, stage=2, scaler=False, **options):
    """``loop(model, user_opt, opt)`` on OddMLP, with and without the overlap: weights, state, stats."""
    out = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model = OddMLP()
        config = ZeroConfig(stage=stage, bucket_cap_mb=TINY_BUCKET_MB, offload_optimizer=True, offload_overlap=overlap,
                            **(UNITS if stage == 3 else {}), **options)
        user_opt = torch.optim.Adam(param_groups(model), lr=0.01)
        sharder = shard_module(model, config) if stage == 3 else None
        opt = ZeroOptimizer(user_opt, config, sharder=sharder, scaler=LossScaler(scale=2.0**4) if scaler else None)
        loop(model, user_opt, opt)
        with gathered_parameters(model):
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[overlap] = params, opt.state_dict(), opt.offload_overlap_stats(), memory_stats(model, [opt])
        opt.close()
    (want, want_state, _, _), (got, got_state, stats, memory) = out[False], out[True]
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    for index, entry in want_state["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(got_state["state"][index][key]), torch.as_tensor(value)), (index, key)
    return stats, out[False][3], memory


def _backward(model, opt, step, micro=0):
    x, y = batch(10 * step + micro, 0)
    loss = F.mse_loss(model(x, step, 0), y)
    (opt.scaler.scale_loss(loss) if opt.scaler is not None else loss).backward()


@pytest.mark.parametrize("stage", [2, 3])
def test_gradients_the_step_prepared_already_are_not_updated_early(stage):
    """A backward that adds to gradients reduce_gradients has unscaled (no zero_grad between steps,
    or clip_grad_norm_ between micro-batches) must not commit an update of its own unscaling."""
    def no_zero_grad(model, user_opt, opt):
        for step in range(4):
            _backward(model, opt, step)
            opt.step()

    def clip_between_micro_batches(model, user_opt, opt):
        for step in range(3):
            opt.zero_grad()
            _backward(model, opt, step, 0)
            opt.clip_grad_norm_(1e3)
            _backward(model, opt, step, 1)
            opt.step()

    stats = _one_process(no_zero_grad, stage, scaler=True)[0]
    assert stats["committed"] > 0, stats  # the first step's
    stats = _one_process(clip_between_micro_batches, stage, scaler=True)[0]
    assert stats["committed"] == 0, stats


def test_hyperparameters_changed_in_place_after_backward_are_seen():
    def loop(model, user_opt, opt):
        user_opt.param_groups[0]["betas"] = [0.9, 0.999]  # a list, changed in place below
        for step in range(3):
            opt.zero_grad()
            _backward(model, opt, step)
            if opt.reducer.host_listener is not None:
                opt.reducer.host_listener.wait()  # the worker is done with the old betas
            user_opt.param_groups[0]["betas"][1] = 0.99 - 0.01 * step
            opt.step()

    stats = _one_process(loop)[0]
    assert stats["dropped"] > 0 and stats["committed"] > 0, stats  # group 1 kept its betas


def test_accumulation_holds_one_update_per_piece():
    def accumulate(micro_batches):
        def loop(model, user_opt, opt):
            for step in range(2):
                opt.zero_grad()
                for micro in range(micro_batches):
                    _backward(model, opt, step, micro)
                opt.step()
        return loop

    _, plain, many = _one_process(accumulate(8))
    # at most a second copy of the state (spares: pieces stepped once, like ``sometimes``, keep theirs)
    assert plain["optimizer_states"] < many["optimizer_states"] <= 2 * plain["optimizer_states"], (many, plain)
    # a shadow per master piece (the master shard also holds the alignment padding between pieces)
    assert plain["master_params"] < many["master_params"] <= 2 * plain["master_params"], (many, plain)


@pytest.mark.parametrize("stage", [2, 3])
def test_weights_edited_between_backward_and_step_are_what_the_step_updates(stage):
    """gathered_parameters(modifier_rank=0) writes the masters: updates computed from their old
    values are dropped (and at stage 2 the masters follow the edit at all)."""

    def loop(model, user_opt, opt):
        for step in range(3):
            opt.zero_grad()
            _backward(model, opt, step)
            if opt.reducer.host_listener is not None:
                opt.reducer.host_listener.wait()  # the updates from the old values are made
            with gathered_parameters(model, modifier_rank=0), torch.no_grad():
                model.fc1.weight.mul_(0.5)
                edited = model.fc1.weight.clone()
            opt.step()
            with gathered_parameters(model):  # one Adam step from the edited values (lr 0.01), not the old ones
                assert (model.fc1.weight - edited).abs().max() < 0.02

    stats = _one_process(loop, stage)[0]
    assert stats["committed"] == 0 and stats["dropped"] > 0, stats
