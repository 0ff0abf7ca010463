"""``zero_strategy.initialize``: DeepSpeed's tutorial loop on this package's engine.

On 2 gloo ranks the loop (``loss = engine(inputs, labels=labels).loss; engine.backward(loss);
engine.step()``) equals the same loop written with ``ZeroOptimizer`` and with torch DDP, on the
same seed and data, at stages 0-3 with accumulation (2 micro-steps) and clipping: fp32 within 1e-5.
fp16 (on CPU) equals the engine driven by hand with the same LossScaler, bit for bit, through
overflows. A save at 2 ranks, stage 3 goes on equally at 1 rank, stage 2. DeepSpeed's own fp32
checkpoints (tests/data/deepspeed) go on as DeepSpeed went on, within 1e-5, at 1 and 2 ranks and
stages 1-3; its bf16 and fp16 ones load with the fp32 masters and Adam moments bit-equal to
DeepSpeed's reading, and the fp16 loss scale moves on as DeepSpeed's did. Two spawned groups run
every case.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from zero_strategy import ZeroConfig, ZeroOptimizer, gathered_parameters
from zero_strategy.deepspeed.launch import discover_launch
from zero_strategy.deepspeed.schedulers import WarmupLR
from zero_strategy.engine import LossScaler, shard_module

from .deepspeed_model import CASES, CONTINUE, SAVE_AT, batch_for, build_model, deepspeed_config, loss_of, param_groups
from .distributed import run_distributed

DATA = Path(__file__).parent / "data" / "deepspeed"
BOUNDARIES, GAS, MICRO, LR = 4, 2, 4, 0.02
WARMUP = {"warmup_min_lr": 0.002, "warmup_max_lr": LR, "warmup_num_steps": 3, "warmup_type": "linear"}


@dataclass
class Output:
    loss: torch.Tensor
    logits: torch.Tensor


class TutorialMLP(nn.Module):
    """The tutorials' model shape: ``model(inputs, labels=labels).loss``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(10, 24), nn.Linear(24, 24), nn.Linear(24, 3)

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> Output:
        logits = self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(inputs)))))  # (B, 3)
        return Output(F.mse_loss(logits.float(), labels), logits)


def micro_batch(micro_step: int, rank: int, world_size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro batch; a 1-rank run takes both of the 2-rank run's (same mean gradient)."""
    if world_size == 1:
        pairs = [micro_batch(micro_step, r) for r in (0, 1)]
        return torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
    g = torch.Generator().manual_seed(100 * micro_step + rank)
    return torch.randn(MICRO, 10, generator=g), 4 * torch.randn(MICRO, 3, generator=g)  # big targets: norms > 1


def tutorial_config(stage: int, **extra) -> dict:
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}},
              "scheduler": {"type": "WarmupLR", "params": WARMUP}, **extra}
    if stage > 0:
        config["zero_optimization"] = {"stage": stage, "stage3_param_persistence_threshold": 0}
    return config


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    with gathered_parameters(model):
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _engine_loop(engine, rank, world_size, micro_steps, first=0) -> tuple[list, list]:
    losses, boundaries = [], []
    for m in range(first, first + micro_steps):
        inputs, labels = micro_batch(m, rank, world_size)
        loss = engine(inputs.to(engine.device), labels=labels.to(engine.device)).loss
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, boundaries


def _reference_loop(model, opt, sched, clip, rank, scaler=None, half=False) -> list:
    """The loop by hand: loss / GAS, backward every micro-step, clip + step + schedule at a boundary."""
    losses = []
    for m in range(BOUNDARIES * GAS):
        inputs, labels = micro_batch(m, rank)
        loss = model(inputs.half() if half else inputs, labels=labels.half() if half else labels).loss
        scaled = loss / GAS
        (scaler.scale_loss(scaled) if scaler else scaled).backward()
        losses.append(loss.item())
        if (m + 1) % GAS:
            continue
        if isinstance(opt, ZeroOptimizer):
            opt.reduce_gradients()
            if not opt.overflowed:
                opt.clip_grad_norm_(clip)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if not getattr(opt, "overflowed", False):
            sched.step()
        opt.zero_grad()
    return losses


def _three_ways(stage: int, rank: int, world_size: int, clip: float, **extra) -> dict:
    """The tutorial loop through initialize, through ZeroOptimizer and through DDP."""
    from zero_strategy.deepspeed import initialize

    torch.manual_seed(0)
    model = TutorialMLP()
    by_hand, ddp_model = copy.deepcopy(model), copy.deepcopy(model)
    engine, optimizer, _, scheduler = initialize(model=model, config=tutorial_config(stage, **extra),
                                                 model_parameters=model.parameters())
    losses, boundaries = _engine_loop(engine, rank, world_size, BOUNDARIES * GAS)
    config = ZeroConfig(stage=max(stage, 1), param_persistence_threshold=0)
    sharder = shard_module(by_hand, config) if stage == 3 else None
    zero = ZeroOptimizer(torch.optim.AdamW(by_hand.parameters(), lr=LR, weight_decay=0.01), config, sharder=sharder)
    zero_losses = _reference_loop(by_hand, zero, WarmupLR(zero, **WARMUP), clip, rank)
    ddp = DistributedDataParallel(ddp_model)
    ddp_opt = torch.optim.AdamW(ddp_model.parameters(), lr=LR, weight_decay=0.01)
    ddp_losses = _reference_loop(ddp, ddp_opt, WarmupLR(ddp_opt, **WARMUP), clip, rank)
    return {"losses": (losses, zero_losses, ddp_losses), "params": (_params(model), _params(by_hand),
                                                                   _params(ddp_model)),
            "boundaries": boundaries, "steps": (engine.global_steps, scheduler.last_epoch, engine.micro_steps),
            "lr": (engine.get_lr(), ddp_opt.param_groups[0]["lr"]), "norm": engine.get_global_grad_norm(),
            "returned": (optimizer is engine.optimizer, engine.zero_optimization_stage(), engine.world_size),
            "comm": (engine.comm_stats(), zero.comm_stats() if stage >= 1 else None)}


def _fp16(rank: int, world_size: int, stage: int) -> dict:
    """fp16 through initialize against the engine by hand with the same LossScaler; the first scale
    overflows, so steps are skipped and the scheduler waits."""
    from zero_strategy.deepspeed import initialize

    fp16 = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 2, "hysteresis": 1}
    torch.manual_seed(0)
    model = TutorialMLP()
    by_hand = copy.deepcopy(model).half()
    engine, _, _, scheduler = initialize(model=model, config=tutorial_config(stage, fp16=fp16))
    losses, _ = _engine_loop(engine, rank, world_size, BOUNDARIES * GAS)
    config = ZeroConfig(stage=stage, param_persistence_threshold=0)
    scaler = LossScaler(scale=2.0**16, window=2, hysteresis=1)
    sharder = shard_module(by_hand, config) if stage == 3 else None
    zero = ZeroOptimizer(torch.optim.AdamW(by_hand.parameters(), lr=LR, weight_decay=0.01), config, sharder=sharder,
                         scaler=scaler)
    sched = WarmupLR(zero, **WARMUP)
    by_hand_losses = _reference_loop(by_hand, zero, sched, 1.0, rank, scaler=scaler, half=True)
    return {"losses": (losses, by_hand_losses), "params": (_params(model), _params(by_hand)),
            "scale": (engine.precision.scaler.scale, scaler.scale), "skipped": (engine.skipped_steps,
                                                                                 scaler.skipped_steps),
            "scheduler": (scheduler.last_epoch, sched.last_epoch), "dtype": next(model.parameters()).dtype}


def _deepspeed_resumes(rank: int, world_size: int) -> dict:
    """Each fp32 DeepSpeed checkpoint through engine.load_checkpoint at stages 1-3, then CONTINUE steps."""
    from zero_strategy.deepspeed import initialize

    out = {}
    for case in (name for name, (_, precision, _, _) in CASES.items() if precision == "fp32"):
        for stage in (1, 2, 3):
            model = build_model(seed=1)  # other weights: everything must come from the checkpoint
            engine, _, _, _ = initialize(model=model, config=deepspeed_config(stage, "fp32"),
                                         model_parameters=param_groups(model))
            path, client = engine.load_checkpoint(DATA / case)
            steps = engine.global_steps
            losses = []
            for step in range(SAVE_AT, SAVE_AT + CONTINUE):
                loss = loss_of(engine, *batch_for(step, world_size, rank))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            out[(case, stage)] = (losses, _params(model), steps, Path(path).name, client)
    return out


def _deepspeed_half(rank: int, world_size: int) -> dict:
    """bf16 and fp16 DeepSpeed checkpoints loaded at another stage: the fp32 masters and Adam moments
    as DeepSpeed saved them, and (fp16) the loss scale going on as DeepSpeed's went on."""
    from zero_strategy.checkpoint.sharded import parameter_names
    from zero_strategy.deepspeed import initialize

    out = {}
    for case, stage in (("stage3_bf16", 1), ("stage2_fp16", 3)):
        model = build_model(seed=1)
        engine, optimizer, _, _ = initialize(model=model, config=deepspeed_config(stage, CASES[case][1]),
                                             model_parameters=param_groups(model))
        engine.load_checkpoint(DATA / case)
        names = parameter_names(model)
        masters = {}  # this rank's pieces of each master: name -> (start, values)
        for g in optimizer.groups:
            for piece in g.pieces:
                values = g.master_shard[piece.shard_offset : piece.shard_offset + piece.numel]
                masters.setdefault(names[g.params[piece.param]], []).append((piece.param_start, values.clone()))
        state = optimizer.state_dict()  # a collective: every piece gathered, in torch's layout
        order = [names[p] for group in optimizer.param_groups for p in group["params"]]
        moments = {order[i]: entry["exp_avg"] for i, entry in state["state"].items()}
        scales = []
        for step in range(SAVE_AT, SAVE_AT + CONTINUE):
            engine.backward(loss_of(engine, *batch_for(step, world_size, rank)))
            engine.step()
            scaler = engine.precision.scaler
            scales.append([scaler.scale if scaler is not None else None, engine.skipped_steps])
        out[case] = (masters, moments, scales, next(model.parameters()).dtype)
    return out


def _save_then_continue(rank: int, world_size: int, folder: str) -> dict:
    from zero_strategy.deepspeed import initialize

    torch.manual_seed(0)
    model = TutorialMLP()
    engine, _, _, _ = initialize(model=model, config=tutorial_config(3))
    _engine_loop(engine, rank, world_size, 2 * GAS)
    engine.save_checkpoint(folder, client_state={"epoch": 1, "seen": torch.tensor([3, 4])})
    losses, _ = _engine_loop(engine, rank, world_size, 2 * GAS, first=2 * GAS)
    return {"losses": losses, "params": _params(model), "lr": engine.get_lr(), "steps": engine.global_steps}


def _loader(rank: int, world_size: int) -> list[list[int]]:
    from zero_strategy.deepspeed import initialize

    model = TutorialMLP()
    data = torch.utils.data.TensorDataset(torch.arange(20))
    _, _, loader, _ = initialize(model=model, config=tutorial_config(1), training_data=data)
    return [batch[0].tolist() for batch in loader]


def _two_ranks(rank: int, world_size: int, folder: str) -> dict:
    results = {f"stage{stage}": _three_ways(stage, rank, world_size, 1.0) for stage in (1, 2, 3)}
    results["loader"] = _loader(rank, world_size)
    results["stage0-clip0.5"] = _three_ways(0, rank, world_size, 0.5, gradient_clipping=0.5)
    results["fp16"] = {stage: _fp16(rank, world_size, stage) for stage in (2, 3)}
    results["saved"] = _save_then_continue(rank, world_size, folder)
    results["deepspeed"] = _deepspeed_resumes(rank, world_size)
    results["deepspeed_half"] = _deepspeed_half(rank, world_size)
    return results


def _one_rank(rank: int, world_size: int, folder: str) -> dict:
    from zero_strategy.deepspeed import initialize

    torch.manual_seed(1)  # other weights: they must come from the checkpoint
    model = TutorialMLP()
    config = {**tutorial_config(2), "train_micro_batch_size_per_gpu": 2 * MICRO}  # both ranks' micro batches
    engine, _, _, _ = initialize(model=model, config=config)
    path, client = engine.load_checkpoint(folder)
    steps = engine.global_steps
    losses, _ = _engine_loop(engine, rank, world_size, 2 * GAS, first=2 * GAS)
    return {"path": path, "client": client, "steps_at_load": steps, "losses": losses, "params": _params(model),
            "lr": engine.get_lr(), "steps": engine.global_steps, "deepspeed": _deepspeed_resumes(rank, world_size)}


def _close(actual, expected, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _reference(case: str) -> tuple[dict[str, torch.Tensor], dict]:
    """What DeepSpeed wrote beside its checkpoint (see tests/data/deepspeed/README.md)."""
    import json

    from safetensors.torch import load_file

    return load_file(DATA / case / "reference.safetensors"), json.loads((DATA / case / "reference.json").read_text())


def _check_deepspeed_resumes(runs: dict, world_size: int, rank: int) -> None:
    for (case, stage), (losses, params, steps, tag, client) in runs.items():
        reference, info = _reference(case)
        theirs = torch.tensor(info["losses"])  # (ranks, steps)
        want = theirs.mean(0) if world_size == 1 else theirs[rank]
        what = f"{case} resumed at stage {stage} on {world_size} ranks"
        torch.testing.assert_close(torch.tensor(losses), want, rtol=0, atol=1e-5, msg=lambda m: f"{what}: {m}")
        continued = {k.split("/", 1)[1]: v for k, v in reference.items() if k.startswith("continued/")}
        for name, value in continued.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-5, msg=lambda m: f"{what} {name}: {m}")
        assert (steps, tag, client) == (SAVE_AT, info["tag"], {}), what


def _check_deepspeed_half(runs: dict) -> None:
    for case, (masters, moments, scales, dtype) in runs.items():
        reference, info = _reference(case)
        assert str(dtype).removeprefix("torch.") == info["model_dtype"]
        assert masters, case
        for name, pieces in masters.items():  # bit-equal to zero_to_fp32's reading
            for start, values in pieces:
                assert torch.equal(values, reference[f"zero_to_fp32/{name}"].reshape(-1)[start : start + len(values)])
        for name, value in moments.items():
            assert torch.equal(value, reference[f"exp_avg/{name}"]), (case, name)
        if info["precision"] == "fp16":
            assert scales == info["loss_scale_and_skipped_steps"]


@pytest.mark.timeout(300)
def test_the_tutorial_loop_equals_zero_optimizer_and_ddp_and_checkpoints_go_on(tmp_path):
    folder = str(tmp_path / "checkpoints")
    by_rank = run_distributed(_two_ranks, 2, folder)
    for rank, results in enumerate(by_rank):
        for name in ("stage1", "stage2", "stage3", "stage0-clip0.5"):
            r = results[name]
            for other, label in ((1, "ZeroOptimizer"), (2, "DDP")):
                _close(torch.tensor(r["losses"][0]), torch.tensor(r["losses"][other]), f"{name} losses vs {label}")
                for key, value in r["params"][0].items():
                    _close(value, r["params"][other][key], f"{name} {key} vs {label}")
            assert r["boundaries"] == [(m + 1) % GAS == 0 for m in range(BOUNDARIES * GAS)]
            assert r["steps"] == (BOUNDARIES, BOUNDARIES, BOUNDARIES * GAS)  # one scheduler step per boundary
            assert math.isclose(r["lr"][0][0], r["lr"][1]) and r["norm"] > 1.0  # so the default clip of 1.0 acted
            assert r["returned"] == (True, int(name[5]), 2)
            engine_bytes, by_hand_bytes = r["comm"]  # the last step's bytes, counted through the engine
            assert engine_bytes["total"] > 0 and engine_bytes["total"] == sum(
                engine_bytes[k] for k in ("all_gather", "reduce_scatter", "all_reduce", "broadcast"))
            if by_hand_bytes is not None and name in ("stage1", "stage2"):  # same stage, buckets and clipping
                assert engine_bytes["reduce_scatter"] == by_hand_bytes["reduce_scatter"]
        for stage, r in results["fp16"].items():
            assert r["dtype"] == torch.float16
            assert r["losses"][0] == r["losses"][1], f"fp16 stage {stage}"
            for key, value in r["params"][0].items():
                assert torch.equal(value, r["params"][1][key]), f"fp16 stage {stage} {key}"
            assert r["scale"][0] == r["scale"][1] and r["skipped"][0] == r["skipped"][1] > 0
            assert r["scheduler"][0] == r["scheduler"][1] == BOUNDARIES - r["skipped"][0]  # skipped: not stepped
        _check_deepspeed_resumes(results["deepspeed"], 2, rank)
        _check_deepspeed_half(results["deepspeed_half"])
        assert [len(b) for b in results["loader"]] == [MICRO, MICRO, 2]  # 10 samples a rank, micro batches of 4
    assert sorted(i for r in by_rank for b in r["loader"] for i in b) == list(range(20))  # each sample once

    # the stage-3 save at 2 ranks, loaded at 1 rank and stage 2, goes on as the 2 ranks went on
    (one,) = run_distributed(_one_rank, 1, folder)
    saved = [r["saved"] for r in by_rank]
    assert Path(one["path"]) == Path(folder) / "global_step2"
    assert (Path(folder) / "latest").read_text() == "global_step2"
    assert one["client"]["epoch"] == 1 and torch.equal(one["client"]["seen"], torch.tensor([3, 4]))
    assert one["steps_at_load"] == 2 and one["steps"] == saved[0]["steps"] == 4
    _close(torch.tensor(one["losses"]), torch.tensor([s["losses"] for s in saved]).mean(0), "losses after the load")
    for key, value in one["params"].items():
        _close(value, saved[0]["params"][key], f"{key} after the load")
    assert one["lr"] == saved[0]["lr"]
    _check_deepspeed_resumes(one["deepspeed"], 1, 0)


@pytest.mark.parametrize(("environ", "expected"), [
    ({}, (0, 1, 0, None, "none")),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1234"},
     (1, 2, 1, "h", "torchrun")),
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODELIST": "node[007-008]"},
     (3, 4, 1, "node007", "slurm")),
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_JOB_NAME": "interactive"}, (0, 1, 0, None, "none")),
])
def test_launchers_are_read_as_deepspeed_reads_them(environ, expected):
    launch = discover_launch(environ, distributed_port=29511)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.master_addr, launch.launcher) == expected
    assert launch.master_port == (1234 if "MASTER_PORT" in environ else 29511 if launch.master_addr else None)


@pytest.mark.parametrize(("environ", "message"), [
    ({"RANK": "0", "WORLD_SIZE": "2"}, r"sets \$RANK, \$WORLD_SIZE but not \$LOCAL_RANK, \$MASTER_ADDR, \$MASTER_PORT"),
    ({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, r"\$RANK='x'"),
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "rank 2 is outside"),
    ({"OMPI_COMM_WORLD_SIZE": "4"}, "started by MPI.*torchrun"),
])
def test_bad_launcher_variables_are_named(environ, message):
    with pytest.raises((RuntimeError, ValueError), match=message):
        discover_launch(environ)


def world_of_one_main() -> None:
    """Run by test_a_world_of_one_needs_no_launcher in a fresh process without launcher variables:
    prints what happened, as JSON, the errors' messages included."""
    import json

    import torch.distributed as dist

    import zero_strategy.deepspeed as deepspeed
    from zero_strategy.deepspeed.config import map_deepspeed_config

    deepspeed.init_distributed()
    report = {"world": dist.get_world_size(), "backend": dist.get_backend()}
    model = TutorialMLP()
    data = torch.utils.data.TensorDataset(torch.randn(12, 10), torch.randn(12, 3))
    engine, _, loader, _ = deepspeed.initialize(model=model, config=tutorial_config(2), training_data=data)
    for inputs, labels in loader:
        engine.backward(engine(inputs.to(engine.device), labels=labels.to(engine.device)).loss)
        engine.step()
    report["steps"] = (engine.global_steps, engine.micro_steps, engine.train_batch_size())
    errors = {}

    def error(name, call):
        try:
            call()
        except Exception as err:  # noqa: BLE001 - the message is what is checked
            errors[name] = f"{type(err).__name__}: {err}"

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    fresh = TutorialMLP()
    other = torch.optim.SGD(TutorialMLP().parameters(), lr=0.1)
    no_batch = {k: v for k, v in tutorial_config(2).items() if k != "train_micro_batch_size_per_gpu"}
    cases = {
        "no config": lambda: deepspeed.initialize(model=TutorialMLP()),
        "auto": lambda: deepspeed.initialize(model=TutorialMLP(), config={**tutorial_config(2),
                                                                         "gradient_clipping": "auto"}),
        "no batch size": lambda: deepspeed.initialize(model=TutorialMLP(), config=no_batch),
        "foreign scheduler": lambda: deepspeed.initialize(
            model=fresh, config=tutorial_config(2), optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1),
            lr_scheduler=torch.optim.lr_scheduler.StepLR(other, 1)),
        "callable optimizer": lambda: deepspeed.initialize(model=TutorialMLP(), config=tutorial_config(2),
                                                           optimizer=lambda params: "adam"),
        "iterable data": lambda: deepspeed.initialize(model=TutorialMLP(), config=tutorial_config(2),
                                                      training_data=Stream()),
        "mpu": lambda: deepspeed.initialize(model=TutorialMLP(), config=tutorial_config(2), mpu=object()),
        "other backend": lambda: deepspeed.init_distributed(dist_backend="nccl"),
        "exclude frozen": lambda: engine.save_checkpoint("unused", exclude_frozen_parameters=True),
        "missing tag": lambda: engine.load_checkpoint(Path.cwd(), tag="nope"),
    }
    for name, call in cases.items():
        error(name, call)
    evaluator, _, _, _ = deepspeed.initialize(model=TutorialMLP(), config={
        **{k: v for k, v in tutorial_config(2).items() if k not in ("optimizer", "scheduler")}})
    error("no optimizer", lambda: evaluator.backward(evaluator(*micro_batch(0, 0)).loss))
    report["errors"] = errors
    report["no latest"] = list(engine.load_checkpoint(Path.cwd() / "empty"))
    report["clipping"] = (engine.gradient_clipping(), map_deepspeed_config({}).clipping())
    print("REPORT" + json.dumps(report))


@pytest.mark.timeout(120)
def test_a_world_of_one_needs_no_launcher_and_mistakes_are_named(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from zero_strategy.deepspeed.launch import TORCHRUN_VARIABLES

    (tmp_path / "empty").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES and not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", "from tests.test_deepspeed_engine import world_of_one_main as m; m()"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.split("REPORT", 1)[1])
    assert (report["world"], report["backend"]) == (1, "gloo")
    assert report["steps"] == [1, 3, 8]  # 12 samples in micro batches of 4: 3 micro-steps, one boundary
    assert report["no latest"] == [None, None] and report["clipping"] == [1.0, 1.0]
    expected = {
        "no config": "DeepSpeedConfigError: initialize() needs a DeepSpeed config",
        "auto": "gradient_clipping = 'auto'", "no batch size": "neither train_batch_size nor",
        "foreign scheduler": "built on another optimizer", "callable optimizer": "returned str, not a torch.optim",
        "iterable data": "must be a map-style", "mpu": "not supported", "other backend": "already running on 'gloo'",
        "exclude frozen": "exclude_frozen_parameters=True) is not supported", "missing tag": "'nope'",
        "no optimizer": "backward(): this engine has no optimizer",
    }
    assert report["errors"].keys() == expected.keys()
    for name, fragment in expected.items():
        assert fragment in report["errors"][name], (name, report["errors"][name])
