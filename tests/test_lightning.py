"""ZeroStrategy through Lightning's Trainer on 2 CPU processes, against Lightning's DDP on the same
seed and data: fit with validation, then validate, test and predict, a torchmetrics metric, a
StepLR scheduler stepped by Lightning, a frozen layer, two param groups.

[Note: one launch per strategy]
Starting Lightning in two processes costs more than the runs themselves, so the ZeRO strategies'
runs are launched once, every case of every strategy one after another in the same processes (see
tests/scripts/lightning_run.py's ``--cases``; a case names its strategy), and DDP once for all the
references, the two launches at the same time; each test reads its case. A case starts from
``seed_everything(0)`` with a new Trainer and model, as a separate launch did, so the assertions
are those of separate runs.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from .cli_runs import EARLY, Commands, run_at_once, take

SCRIPT = Path(__file__).parent / "scripts" / "lightning_run.py"


def script_command(out: Path, strategy: str, *extra: str, script: Path = SCRIPT) -> tuple[list[str], dict[str, str]]:
    """The script's command line and environment, as a user would run it (no launcher's variables of
    its own: its 2 ranks are forked with those Lightning gives the ranks it starts, see [Note: ranks
    forked from a loaded process] in tests/cli_runs.py)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return [sys.executable, str(script), "--strategy", strategy, "--out", str(out), *extra], env


def assert_ran(proc, strategy: str) -> None:
    assert proc.returncode == 0, f"{strategy} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def run_script(out: Path, strategy: str, *extra: str, script: Path = SCRIPT, timeout: int = 240) -> None:
    """Run the script's 2 ranks (forked: see ``script_command``); they must succeed."""
    out.mkdir(parents=True, exist_ok=True)
    cmd, env = script_command(out, strategy, *extra, script=script)
    assert_ran(run_at_once({strategy: (cmd, env, None, 2)}, timeout)[strategy][0], strategy)


def results(folder: Path) -> list[dict]:
    """What each of the 2 ranks saved in ``folder``."""
    return [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(2)]


def launch(out: Path, strategy: str, *extra: str, script: Path = SCRIPT) -> list[dict]:
    """One run of the script: each rank's results."""
    run_script(out, strategy, *extra, script=script)
    return results(out)


def launch_cases(out: Path, strategy: str, cases: dict[str, tuple[str, ...]], script: Path = SCRIPT
                 ) -> dict[str, list[dict]]:
    """Every case in one launch (see [Note: one launch per strategy]): case name -> each rank's results."""
    run_script(out, strategy, *cases_args(cases), script=script, timeout=cases_timeout(len(cases)))
    return {name: results(out / name) for name in cases}


def cases_args(cases: dict[str, tuple[str, ...]]) -> tuple[str, str]:
    return "--cases", json.dumps({name: list(args) for name, args in cases.items()})


def cases_timeout(count: int) -> int:
    """Seconds a launch of ``count`` cases may take."""
    return 120 + 60 * count


CASES: dict[str, tuple[str, ...]] = {
    "plain": (),
    "clip": ("--clip", "0.05"),  # below the gradient norm of the steps here, so the clip changes the run
    "clip_value": ("--clip", "0.01", "--clip-algorithm", "value"),
    "accumulate": ("--accumulate", "4"),
    "resume": ("--stop-at", "5"),
    "manual": ("--manual",),
    "bf16": ("--precision", "bf16-mixed", "--steps", "20"),
    "fp16": ("--precision", "16-mixed", "--steps", "20"),
    "fp64": ("--precision", "64-true"),  # fp64 weights, their own master copy
    "meta": ("--configure-model",),
    # issue 50: a batch norm's buffers, and the network kept in the hyper-parameters saved by ModelCheckpoint
    "bn": ("--net-in-hparams", "--stop-at", "5"),
    "bn_nobroadcast": ("--net-in-hparams", "--no-broadcast-buffers"),
    # issue 51: Muon beside AdamW under manual optimization (each of the two steps counts as a Trainer step:
    # 12 batches), saved after the third batch and resumed
    "muon": ("--muon", "--steps", "24", "--stop-at", "6"),
    "muon_bf16": ("--muon", "--steps", "24", "--precision", "bf16-mixed"),
    "muon_fp32": ("--muon", "--steps", "24"),  # DDP's reference of muon_bf16
    "muon_one": ("--muon-one",),  # automatic optimization: MuonWithAdamW and a StepLR schedule
    # issue 52: experts chosen without a router, at zero_stage_3 with no option (DDP needs find_unused_parameters)
    "moe": ("--moe",),
}
DDP_CASES = {**{name: CASES[name] for name in ("plain", "clip", "clip_value", "accumulate", "resume", "bn",
                                               "bn_nobroadcast", "muon", "muon_fp32", "muon_one", "fp64")},
             "steps20": ("--steps", "20"),  # the fp32 reference of the mixed-precision runs
             "manual": ("--manual", "--strategy", "ddp_find_unused_parameters_true"),
             "moe": ("--moe", "--strategy", "ddp_find_unused_parameters_true")}
ZERO_CASES = {  # what each strategy's tests read
    "zero_stage_1": ("plain", "clip", "clip_value", "accumulate", "manual", "bf16", "fp16", "muon_one"),
    "zero_stage_2": ("plain", "clip", "clip_value", "accumulate", "resume", "manual", "bf16", "fp16", "bn",
                     "bn_nobroadcast", "muon"),
    "zero3-linear": ("plain", "clip", "clip_value", "accumulate", "resume", "manual", "bf16", "fp16", "meta", "bn"),
    "zero_stage_3": ("manual", "muon", "muon_bf16", "muon_one", "moe", "fp64"),
    "zero_stage_3_offload": ("plain",),  # test_offload.py's
    "zero2-offload-overlap": ("plain", "clip", "accumulate", "resume"),  # test_offload_overlap.py's
    "zero2-local": ("accumulate",),  # local_accumulation
    "zero3-linear-local": ("accumulate",),
    "zero3-linear-hsdp": ("accumulate", "resume"),  # shard_group_size: test_hybrid.py's engine tests, here the Trainer
}


EXTRA = {("zero3-linear", "plain"): ("--log-every", "2", "--keep-printed")}
"""Arguments a case adds that change nothing it is compared on: the step breakdown's logs and table
(issue 53) are read from zero3-linear's plain case."""


def _zero_cases() -> dict[str, tuple[str, ...]]:
    return {f"{strategy}__{name}": (*CASES[name], *EXTRA.get((strategy, name), ()), "--strategy", strategy)
            for strategy, names in ZERO_CASES.items() for name in names}


def _strategies() -> dict[str, dict[str, tuple[str, ...]]]:
    """The two launches: the strategy each starts with -> its cases."""
    return {"ddp": DDP_CASES, "zero_stage_2": _zero_cases()}


def _commands(base: Path) -> Commands:
    """DDP's references and every ZeRO case: two launches, each writing in ``base / strategy``."""
    commands = {}
    for strategy, cases in _strategies().items():
        (base / strategy).mkdir()
        commands[strategy] = (*script_command(base / strategy, strategy, *cases_args(cases)), None, 2)
    return commands


LAUNCHES = "lightning_launches"
EARLY[LAUNCHES] = (__name__, _commands)  # started at collection: see [Note: launches started early] in
                                         # tests/cli_runs.py


@functools.lru_cache(maxsize=None)
def _launches(tmp_root: str) -> tuple[dict[str, list[dict]], dict[str, list[dict]]]:
    """DDP's references and every ZeRO case, the two launches at once (see [Note: one launch per
    strategy]): while one imports Lightning, the other trains. Started at collection where this
    module's tests were selected (in ``tmp_root`` where not)."""
    def folder(name: str) -> Path:
        (Path(tmp_root) / name).mkdir()
        return Path(tmp_root) / name

    done, base = take(LAUNCHES, folder, timeout=cases_timeout(sum(map(len, _strategies().values()))))
    runs = []
    for strategy, cases in _strategies().items():
        assert_ran(done[strategy][0], strategy)
        runs.append({name: results(base / strategy / name) for name in cases})
    return runs[0], runs[1]


def ddp_runs(tmp_root: str) -> dict[str, list[dict]]:
    return _launches(tmp_root)[0]


def ddp_run(tmp_root: str, *extra: str, strategy: str = "ddp") -> tuple:
    """DDP's run with these extra arguments (from the one DDP launch when it holds that case)."""
    wanted = tuple(extra) + (("--strategy", strategy) if strategy != "ddp" else ())
    for name, args in DDP_CASES.items():
        if args == wanted:
            return tuple(ddp_runs(tmp_root)[name])
    return tuple(launch(Path(tmp_root) / (strategy + "_".join(extra)), strategy, *extra))


def zero_runs(tmp_root: str, strategy: str) -> dict[str, list[dict]]:
    """``strategy``'s cases (every zero strategy's cases run in one launch: see the Note above)."""
    runs = _launches(tmp_root)[1]
    return {name: runs[f"{strategy}__{name}"] for name in ZERO_CASES[strategy]}


def assert_same_run(zero: list[dict], ddp: tuple) -> None:
    for r, (z, d) in enumerate(zip(zero, ddp)):
        assert len(z["losses"]) == len(d["losses"]) >= 12, f"rank {r} ran {len(z['losses'])} batches"
        torch.testing.assert_close(torch.tensor(z["losses"]), torch.tensor(d["losses"]), rtol=1e-5, atol=1e-7)
        assert z["lrs"] == pytest.approx(d["lrs"], rel=1e-12)
        assert len(set(z["lrs"])) > 1, "the scheduler never changed the learning rate"
        for name, value in d["params"].items():
            torch.testing.assert_close(z["params"][name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        for key in ("validate", "test"):
            got, want = z[key][0], d[key][0]
            assert got.keys() == want.keys() and got, f"{key}: {got} vs {want}"
            for metric in want:
                assert got[metric] == pytest.approx(want[metric], rel=1e-5), f"{key}/{metric}"
        assert torch.equal(z["predict"], d["predict"])
    # the ranks agree with each other, as data parallel training must
    for name, value in zero[0]["params"].items():
        assert torch.equal(value, zero[1]["params"][name]), name


STAGES = ["zero_stage_1", "zero_stage_2", "zero3-linear"]  # zero3-linear: every Linear a stage-3 unit


LAUNCH_TIMEOUT = 900  # a test may wait for its strategy's launch of every case (and DDP's)


@pytest.mark.timeout(LAUNCH_TIMEOUT)
@pytest.mark.parametrize("strategy", STAGES)
def test_trainer_matches_ddp(tmp_root, strategy):
    zero = zero_runs(tmp_root, strategy)["plain"]
    for z in zero:
        assert z["world_size"] == 2
        c = z["collectives"]  # the strategy's reduce / all_gather / broadcast Lightning and users call
        assert c["reduce_sum"].item() == 3.0 and c["reduce_mean"].item() == 1.5
        assert c["all_gather"].tolist() == [[0, 0], [1, 10]]
        assert c["broadcast"] == "from rank 0"
    assert_same_run(zero, ddp_run(tmp_root))
    assert_comm_stats_predicted(zero)


def assert_comm_stats_predicted(zero: list[dict], accumulation_steps: int = 1, net_in_hparams: bool = False) -> None:
    """comm_stats() after fit: the last training step's bytes, validation's gathers left out, equal
    the communication model's prediction for this model and config."""
    from zero_strategy.comm_model import predict_step_bytes
    from zero_strategy.config import ZeroConfig

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from lightning_run import Classifier, Net, NetInHparams
    finally:
        sys.path.remove(str(SCRIPT.parent))
    with torch.device("meta"):
        model = NetInHparams(Net()) if net_in_hparams else Classifier()
    config = ZeroConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in zero[0]["config"].items()})
    want = predict_step_bytes(model, config, 2, accumulation_steps=accumulation_steps, backend="gloo")
    for rank, z in enumerate(zero):
        assert z["comm"] == want, f"rank {rank}"
    assert want["total"] > 0


@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_the_step_breakdown_is_logged_and_its_table_printed_at_the_end_of_fit(tmp_root):
    from zero_strategy.engine.diagnose.breakdown import PARTS
    from zero_strategy.step_report import LABELS

    zero = zero_runs(tmp_root, "zero3-linear")["plain"]
    for z in zero:  # logged every 2 steps (log_every_n_steps), the means of the steps since the last log
        metrics = z["metrics"]
        parts = [metrics[f"zero/{part}_ms"] for part in PARTS]
        assert min(parts) >= 0 and sum(parts) == pytest.approx(metrics["zero/step_ms"], rel=1e-6)
        assert metrics["zero/samples_per_sec"] > 0 and metrics["zero/model_tflops"] > 0
        assert "zero/mfu" not in metrics  # a CPU's peak is not known
    table = zero[0]["printed"].split("Where the step's time went: ")[1]  # rank 0 prints it, once
    assert table.startswith("rank 0, the mean of 11 steps after the first") and zero[1]["printed"] == ""
    for part in PARTS:
        assert f"\n  {LABELS[part]}" in table
    assert "max over ranks" in table and "throughput: " in table and "FLOPs: " in table
    assert "(as the communication model predicts" in table  # the bytes measured are the prediction's


@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_stage3_builds_configure_model_on_meta_and_matches_ddp(tmp_root):
    # Layers built in configure_model go on the meta device and are materialised one unit at a
    # time, in module order, so they draw the same random numbers as DDP's eager construction.
    zero = zero_runs(tmp_root, "zero3-linear")["meta"]
    assert [z["built_on"] for z in zero] == ["meta", "meta"]
    assert_same_run(zero, ddp_run(tmp_root))


@pytest.mark.timeout(LAUNCH_TIMEOUT)
@pytest.mark.parametrize("strategy", STAGES)
def test_clipping_by_norm_matches_ddp(tmp_root, strategy):
    # 0.05 is below the gradient norm of the steps here, so the clip changes the run
    clipped = ddp_run(tmp_root, "--clip", "0.05")
    assert clipped[0]["losses"][2:] != pytest.approx(ddp_run(tmp_root)[0]["losses"][2:], rel=1e-3)
    assert_same_run(zero_runs(tmp_root, strategy)["clip"], clipped)


@pytest.mark.timeout(LAUNCH_TIMEOUT)
@pytest.mark.parametrize("strategy", STAGES)
def test_gradient_accumulation_matches_ddp(tmp_root, strategy):
    # 4 micro-batches per step: stage 2 reduces each into the gradient shard, stage 1 once
    assert_same_run(zero_runs(tmp_root, strategy)["accumulate"], ddp_run(tmp_root, "--accumulate", "4"))


@pytest.mark.timeout(LAUNCH_TIMEOUT)
@pytest.mark.parametrize("stage", [2, 3])
def test_local_accumulation_matches_ddp_and_reduces_once_per_step(tmp_root, stage):
    """Trainer(accumulate_grad_batches=4) with local_accumulation: block_backward_sync defers the first
    three micro-batches' reductions (see [Note: local accumulation] in zero_strategy/engine/grads/accumulation.py)."""
    strategy = "zero2-local" if stage == 2 else "zero3-linear-local"
    local = zero_runs(tmp_root, strategy)["accumulate"]
    usual = zero_runs(tmp_root, "zero_stage_2" if stage == 2 else "zero3-linear")
    assert_same_run(local, ddp_run(tmp_root, "--accumulate", "4"))
    assert_comm_stats_predicted(local, accumulation_steps=4)
    for z, plain, every in zip(local, usual["plain"], usual["accumulate"]):
        assert z["comm"]["reduce_scatter"] == plain["comm"]["reduce_scatter"] > 0  # one micro-batch's worth
        assert every["comm"]["reduce_scatter"] == 4 * z["comm"]["reduce_scatter"]


@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_hybrid_sharding_accumulates_and_resumes_as_ddp(tmp_root):
    """ZeroStrategy(shard_group_size=1) on 2 ranks: ZeRO within each rank, the gradient shards
    all-reduced across the two once per optimizer step (replica_all_reduce="boundary"), a sharded
    checkpoint written by the first group and resumed."""
    runs = zero_runs(tmp_root, "zero3-linear-hsdp")
    assert_same_run(runs["accumulate"], ddp_run(tmp_root, "--accumulate", "4"))
    assert_comm_stats_predicted(runs["accumulate"], accumulation_steps=4)
    assert all(z["comm"]["all_gather"] == z["comm"]["reduce_scatter"] == 0 for z in runs["accumulate"])
    assert_same_run(runs["resume"], ddp_run(tmp_root, "--stop-at", "5"))


@pytest.mark.timeout(LAUNCH_TIMEOUT)
@pytest.mark.parametrize("strategy", ["zero_stage_2", "zero_stage_3"])
def test_muon_beside_adamw_trains_saves_and_resumes_as_under_ddp(tmp_root, strategy):
    # each Muon matrix stepped whole on one rank (see [Note: whole-parameter step]), its momentum in the
    # sharded checkpoint that the Trainer's save_checkpoint wrote after the third batch
    assert_same_run(zero_runs(tmp_root, strategy)["muon"], ddp_run(tmp_root, *CASES["muon"]))


@pytest.mark.timeout(LAUNCH_TIMEOUT)
@pytest.mark.parametrize("strategy", ["zero_stage_1", "zero_stage_3"])
def test_one_muon_with_adamw_optimizer_under_automatic_optimization_matches_ddp(tmp_root, strategy):
    assert_same_run(zero_runs(tmp_root, strategy)["muon_one"], ddp_run(tmp_root, *CASES["muon_one"]))


@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_muon_beside_adamw_in_bf16_mixed_at_stage_3_follows_fp32_ddp(tmp_root):
    # bf16 weights, the fp32 masters gathered whole for Muon's step: as test_mixed_precision_follows_fp32_ddp
    zero, ddp = zero_runs(tmp_root, "zero_stage_3")["muon_bf16"], ddp_run(tmp_root, *CASES["muon_fp32"])
    for z, d in zip(zero, ddp):
        assert len(z["losses"]) == len(d["losses"]) == 12
        torch.testing.assert_close(torch.tensor(z["losses"]), torch.tensor(d["losses"]), rtol=2e-2, atol=0)
        assert z["params"]["body.0.weight"].dtype == torch.bfloat16


@pytest.mark.timeout(LAUNCH_TIMEOUT)
@pytest.mark.parametrize("strategy", ["zero_stage_2", "zero3-linear"])
def test_resume_from_checkpoint_matches_ddp_resume(tmp_root, strategy):
    # Fit 5 steps, save, resume in a fresh Trainer and model, against DDP doing the same (Lightning
    # restarts a plain dataloader's epoch on resume, so an uninterrupted run sees other batches).
    # The checkpoint is a sharded directory (each rank saved its own pieces); the optimizer state must
    # carry over exactly, mid-epoch.
    assert_same_run(zero_runs(tmp_root, strategy)["resume"], ddp_run(tmp_root, "--stop-at", "5"))


@pytest.mark.timeout(LAUNCH_TIMEOUT)
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("strategy", STAGES)
def test_mixed_precision_follows_fp32_ddp(tmp_root, strategy, precision):
    # low-precision weights and gradients, fp32 master shards: within 2e-2 of fp32 over 20 steps
    zero = zero_runs(tmp_root, strategy)["bf16" if precision == "bf16-mixed" else "fp16"]
    ddp = ddp_run(tmp_root, "--steps", "20")
    want_dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    for z, d in zip(zero, ddp):
        assert len(z["losses"]) == len(d["losses"]) == 20
        torch.testing.assert_close(torch.tensor(z["losses"]), torch.tensor(d["losses"]), rtol=2e-2, atol=0)
        assert z["params"]["head.weight"].dtype == want_dtype
    if precision == "16-mixed":  # the loss scale and the skipped steps are logged
        assert zero[0]["metrics"]["loss_scale"] == 256.0 and zero[0]["metrics"]["skipped_steps"] == 0.0


@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_double_precision_at_stage_3_defaults_is_ddps_run(tmp_root):
    # precision="64-true": fp64 weights are their own master (an fp32 copy would round each step to 1e-8)
    zero, ddp = zero_runs(tmp_root, "zero_stage_3")["fp64"], ddp_run(tmp_root, *CASES["fp64"])
    assert_same_run(zero, ddp)
    for z, d in zip(zero, ddp):
        assert z["params"]["head.weight"].dtype == torch.float64
        for name, value in d["params"].items():
            torch.testing.assert_close(z["params"][name], value, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")


@pytest.mark.timeout(LAUNCH_TIMEOUT)
@pytest.mark.parametrize("strategy", STAGES)
def test_clipping_by_value_matches_ddp(tmp_root, strategy):
    clipped = ddp_run(tmp_root, *CASES["clip_value"])
    assert clipped[0]["losses"][2:] != pytest.approx(ddp_run(tmp_root)[0]["losses"][2:], rel=1e-3)
    assert_same_run(zero_runs(tmp_root, strategy)["clip_value"], clipped)


@pytest.mark.timeout(LAUNCH_TIMEOUT)
@pytest.mark.parametrize("strategy", [*STAGES, "zero_stage_3"])  # zero_stage_3: one resident group here
def test_manual_optimization_with_two_optimizers_matches_ddp(tmp_root, strategy):
    # GAN style: manual_backward and opt.step() for each of two optimizers over disjoint parameters
    reference = ddp_run(tmp_root, "--manual", strategy="ddp_find_unused_parameters_true")
    assert_same_run(zero_runs(tmp_root, strategy)["manual"], reference)


@pytest.mark.timeout(LAUNCH_TIMEOUT)
@pytest.mark.parametrize("strategy", ["zero_stage_2", "zero3-linear"])
def test_batch_norm_and_a_network_in_the_hparams_save_and_resume_as_under_ddp(tmp_root, strategy):
    """Issue 50: the network passed to __init__ is in the hyper-parameters, which Lightning pickles into
    every checkpoint: ModelCheckpoint saves at step 5 and a new Trainer resumes (weights_only=False, as
    unpickling a module needs under DDP too). The pickled network is the user's module with its values at
    the save, whole (at stage 3 too: see [Note: a module's copies hold what the user sees] in
    zero_strategy/engine/params/attached.py). Its batch norm's running statistics are broadcast as
    DDP's default does, so validation equals DDP's within 1e-6."""
    zero, ddp = zero_runs(tmp_root, strategy)["bn"], ddp_run(tmp_root, *CASES["bn"])
    assert_same_run(zero, ddp)
    for z, d in zip(zero, ddp):
        for key in ("validate", "test"):
            for metric, want in d[key][0].items():
                assert z[key][0][metric] == pytest.approx(want, rel=0, abs=1e-6), f"{key}/{metric}"
        for metric in ("val_loss", "val_acc"):  # the fit's last validation
            assert z["metrics"][metric] == pytest.approx(d["metrics"][metric], rel=0, abs=1e-6), metric
        for name, value in d["params"].items():
            torch.testing.assert_close(z["params"][name], value, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")
    saved = zero[0]["net_at_save"]  # rank 0 pickles the checkpoint's state: its buffers, everyone's weights
    assert saved.keys() == ddp[0]["net_at_save"].keys() and "body.1.running_mean" in saved
    for z in zero:
        assert z["loaded_net"].keys() == saved.keys()
        for key, value in saved.items():
            assert z["loaded_net"][key].shape == value.shape and torch.equal(z["loaded_net"][key], value), key
    assert_comm_stats_predicted(zero, net_in_hparams=True)
    assert all(z["comm"]["broadcast"] > 0 for z in zero)  # the last step's broadcast of the buffers


@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_broadcast_buffers_false_is_ddps_broadcast_buffers_false(tmp_root):
    zero = zero_runs(tmp_root, "zero_stage_2")["bn_nobroadcast"]
    ddp = ddp_run(tmp_root, *CASES["bn_nobroadcast"])
    assert_same_run(zero, ddp)
    for z, d in zip(zero, ddp):
        for metric in ("val_loss", "val_acc"):
            assert z["metrics"][metric] == pytest.approx(d["metrics"][metric], rel=0, abs=1e-6), metric
    # at the fit's end each rank has its own statistics, where the broadcast before the fit's last validation
    # leaves the ranks' equal (validate's set-up takes rank 0's either way, as under DDP)
    name = "net.body.1.running_mean"
    for z, d in zip(zero, ddp):
        torch.testing.assert_close(z["fit_buffers"][name], d["fit_buffers"][name], rtol=0, atol=1e-6)
    assert not torch.allclose(zero[0]["fit_buffers"][name], zero[1]["fit_buffers"][name])
    broadcast = zero_runs(tmp_root, "zero_stage_2")["bn"]
    assert torch.equal(broadcast[0]["fit_buffers"][name], broadcast[1]["fit_buffers"][name])
    assert all(z["comm"]["broadcast"] == 0 for z in zero)


@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_stage3_defaults_learn_to_gather_experts_chosen_without_a_router_as_ddp_trains(tmp_root):
    """Issue 52: ``strategy="zero_stage_3"`` and nothing else, on experts each rank calls for its own tokens;
    the first passes (the sanity check's validation, then training) find the ranks asking for different
    experts and make their layer one unit (see [Note: learned leaves] in zero_strategy/engine/params/leaves.py)."""
    zero = zero_runs(tmp_root, "zero_stage_3")["moe"]
    assert_same_run(zero, ddp_run(tmp_root, "--moe", strategy="ddp_find_unused_parameters_true"))
    for z in zero:
        assert z["learned"] == ["body"] and z["units"] == ["body"], (z["learned"], z["units"])
