"""The rest of DeepSpeed's surface that scripts use, piece by piece: the command-line route into
``initialize``, the accelerator, ``deepspeed.comm``, PyTorch-style backward (one division per path,
fp16 refused without the loss scale), ``zero.Init`` / ``GatheredParameters``, ``save_16bit_model``,
``utils.zero_to_fp32`` (on this package's checkpoints, and on DeepSpeed's, against DeepSpeed's own
reading), ``ops.adam``, ``checkpointing``, the ``moe`` / ``pipe`` refusals, ``zero-launch``'s
command lines, and DeepSpeedExamples' bf16_full config (bf16 weights under ``torch_autocast``). The
distributed parts share one call on the 2-rank worker pool.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zero_strategy as deepspeed
from zero_strategy.deepspeed.accelerator import CPUAccelerator, _choose
from zero_strategy.deepspeed.arguments import config_from_arguments, local_rank_from_arguments
from zero_strategy.deepspeed.keys import DeepSpeedConfigError
from zero_strategy.deepspeed.launcher import build_torchrun_arguments, parse_args

from .distributed import run_distributed

DATA = Path(__file__).parent / "data" / "deepspeed"
LR = 0.05


# ---- pure pieces ------------------------------------------------------------------------------


def test_config_arguments_and_where_initialize_finds_the_config(caplog):
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert (args.deepspeed, args.deepspeed_config, args.deepscale, args.deepscale_config) == (True, "ds.json", False,
                                                                                               None)
    assert config_from_arguments(None, None, args) == "ds.json"
    old = parser.parse_args(["--deepscale_config", "old.json"])
    assert config_from_arguments(None, None, old) == "old.json" and old.deepspeed_config == "old.json"
    assert old.deepscale_config is None  # moved, as DeepSpeed moves it
    with pytest.raises(DeepSpeedConfigError, match="both --deepscale_config"):
        config_from_arguments(None, None, parser.parse_args(["--deepscale_config", "a", "--deepspeed_config", "b"]))
    with pytest.raises(DeepSpeedConfigError, match="both from --deepspeed_config .* and from config="):
        config_from_arguments({"train_batch_size": 2}, None, args)
    with caplog.at_level(logging.WARNING):
        assert config_from_arguments({"a": 1}, {"b": 2}, None) == {"a": 1}  # config= wins, as in DeepSpeed
    assert "config_params is ignored" in caplog.text
    assert config_from_arguments(None, {"b": 2}, parser.parse_args([])) == {"b": 2}


def test_args_local_rank_must_agree_with_the_launcher():
    def local(value):
        return argparse.Namespace(local_rank=value)

    assert local_rank_from_arguments(local(-1), {"LOCAL_RANK": "1"}) is None  # the launcher's is used
    assert local_rank_from_arguments(local(1), {"LOCAL_RANK": "1"}) is None
    with pytest.raises(ValueError, match=r"args.local_rank=0 but the launcher set \$LOCAL_RANK=1"):
        local_rank_from_arguments(local(0), {"LOCAL_RANK": "1"})
    assert local_rank_from_arguments(local(1), {}) == 1 and local_rank_from_arguments(local(-1), {}) is None
    with pytest.raises(TypeError, match="must be an int"):
        local_rank_from_arguments(local("0"), {})
    assert local_rank_from_arguments(argparse.Namespace(), {}) is None


def test_the_accelerator_is_chosen_as_deepspeed_chooses(monkeypatch):
    assert type(_choose({"DS_ACCELERATOR": "cpu"})) is CPUAccelerator
    if not torch.cuda.is_available():
        assert type(_choose({})) is CPUAccelerator
        with pytest.raises(ValueError, match="sees no CUDA device"):
            _choose({"DS_ACCELERATOR": "cuda"})
    with pytest.raises(ValueError, match=r"\$DS_ACCELERATOR='xpu': this package runs on cuda or cpu"):
        _choose({"DS_ACCELERATOR": "xpu"})
    cpu = CPUAccelerator()
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert (cpu.device_name(1), cpu.current_device_name(), cpu.current_device(), cpu.device_count()) == (
        "cpu", "cpu", 3, 4)
    assert cpu.is_available() and cpu.communication_backend_name() == "gloo" and cpu.is_bf16_supported()
    cpu.reset_peak_memory_stats()
    assert cpu.max_memory_allocated() >= cpu.memory_allocated() - 4096 > 0  # the resident set, and its peak
    cpu.manual_seed(7)
    first = torch.rand(2)
    cpu.manual_seed(7)
    assert torch.equal(first, torch.rand(2))
    with cpu.stream(cpu.current_stream()):
        cpu.synchronize()
        cpu.empty_cache()


def test_launcher_command_lines():
    def line(*argv, cuda=0):
        return build_torchrun_arguments(parse_args([*argv, "train.py", "--x", "1"]), cuda)

    torchrun, extra = line("--num_gpus", "2", "--master_port", "1234")
    assert torchrun[:10] == ["--nnodes", "1", "--node-rank", "0", "--nproc-per-node", "2", "--master-addr",
                             "127.0.0.1", "--master-port", "1234"]
    assert torchrun[-5:] == ["script", "0", "train.py", "--x", "1"]  # --local_rank is passed (0: not suppressed)
    assert extra == {"LOCAL_SIZE": "2", "CROSS_RANK": "0", "CROSS_SIZE": "1"}
    assert line("--no_local_rank", "--module")[0][-5:-3] == ["module", "1"]
    assert line()[1]["LOCAL_SIZE"] == "1"  # the CPU: one process by default
    assert line(cuda=4)[1]["LOCAL_SIZE"] == "4"  # every visible GPU
    assert line("--include", "localhost:1,3", cuda=4)[1]["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert line("--exclude", "localhost:0", cuda=4)[1]["CUDA_VISIBLE_DEVICES"] == "1,2,3"
    two_nodes = line("--num_nodes", "2", "--node_rank", "1", "--master_addr", "node0", "--num_gpus", "2")
    assert two_nodes[0][:8] == ["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2", "--master-addr", "node0"]
    assert two_nodes[1]["CROSS_RANK"] == "1"
    for argv, message in ((("--num_nodes", "2"), "also give --node_rank and --master_addr"),
                          (("--include", "other:0"), "names host 'other'"),
                          (("--num_gpus", "5"), "this node has 4 CUDA"),
                          (("--include", "localhost:0", "--exclude", "localhost:1"), "exclude each other")):
        with pytest.raises(SystemExit, match=message):
            line(*argv, cuda=4)


@pytest.mark.parametrize("flag", ["--hostfile=hosts", "--launcher=openmpi", "--bind_cores_to_rank"])
def test_launcher_refuses_what_needs_ssh_or_is_not_offered(flag, capsys):
    with pytest.raises(SystemExit):
        parse_args([flag, "train.py"])
    assert f"{flag.split('=')[0]} is not supported:" in capsys.readouterr().err


def test_unsupported_names_import_and_say_what_to_use():
    from zero_strategy.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
    from zero_strategy.pipe import PipelineModule

    from zero_strategy.deepspeed.unsupported import UnsupportedFeature

    assert not is_moe_param(nn.Parameter(torch.zeros(1)))
    for use, fragment in ((lambda: deepspeed.moe.layer.MoE(hidden_size=4), "mixture-of-experts"),
                          (lambda: split_params_into_different_moe_groups_for_optimizer([]), "mixture-of-experts"),
                          (lambda: PipelineModule(layers=[]), "Use ZeRO stage 3"),
                          (lambda: deepspeed.pipe.PipeDataParallelTopology, "pipeline parallelism"),
                          (lambda: deepspeed.init_inference(nn.Linear(1, 1)), "inference engine")):
        with pytest.raises(UnsupportedFeature, match=fragment):
            use()


def test_z3_leaf_module_names_flag_modules_as_deepspeed_does():
    from .routed import Expert, MoELayer, MoENet

    model = MoENet(top_k=1, gate="hash")
    assert deepspeed.utils.get_z3_leaf_modules(model) == []
    flagged = deepspeed.utils.set_z3_leaf_modules(model, ["MoELayer"])  # a class name, or the class
    assert flagged == [b.moe for b in model.blocks] == deepspeed.utils.get_z3_leaf_modules(model)
    assert all(deepspeed.utils.z3_leaf_module(m) for m in flagged) and not deepspeed.utils.z3_leaf_module(model)
    assert not deepspeed.utils.z3_leaf_parameter(model.head.weight)
    assert deepspeed.utils.unset_z3_leaf_modules(model, [MoELayer]) == flagged
    assert deepspeed.utils.get_z3_leaf_modules(model) == []
    with pytest.raises(ValueError, match=r"no module of MoENet is of the classes \[<class 'torch.nn.*Conv2d'>\]"):
        deepspeed.utils.set_z3_leaf_modules(model, [nn.Conv2d])
    assert deepspeed.utils.set_z3_leaf_modules(model, [nn.Conv2d], raise_if_not_found=False) == []
    with pytest.raises(ValueError, match="must be a non-empty list of module classes or class names"):
        deepspeed.utils.set_z3_leaf_modules(model, [3])
    assert len(deepspeed.utils.set_z3_leaf_modules(model, Expert)) == 8  # exact class: subclasses are not taken


def test_fused_and_cpu_adam_are_torchs_adam():
    params = [nn.Parameter(torch.zeros(2))]
    fused = deepspeed.ops.adam.FusedAdam(params, lr=0.1, betas=(0.8, 0.9), weight_decay=0.2)
    assert type(fused) is torch.optim.AdamW and fused.defaults["betas"] == (0.8, 0.9)
    assert fused.defaults["weight_decay"] == 0.2
    assert type(deepspeed.ops.adam.DeepSpeedCPUAdam(params, adamw_mode=False)) is torch.optim.Adam
    assert deepspeed.ops.adam.DeepSpeedCPUAdam(params).defaults["weight_decay"] == 0.0  # DeepSpeed's default
    with pytest.raises(ValueError, match="bias_correction=False"):
        deepspeed.ops.adam.FusedAdam(params, bias_correction=False)


def test_activation_checkpointing_api_recomputes_with_the_same_gradients():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    x = torch.randn(3, 4, requires_grad=True)
    deepspeed.checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True}},
                                      partition_activations=True)
    assert deepspeed.checkpointing.is_configured()
    recomputed = torch.autograd.grad(deepspeed.checkpointing.checkpoint(block, x).square().sum(), [x, *block.parameters()])
    plain = torch.autograd.grad(block(x).square().sum(), [x, *block.parameters()])
    for a, b in zip(recomputed, plain):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="model parallelism"):
        deepspeed.checkpointing.configure(object())
    deepspeed.checkpointing.configure(None)


@pytest.mark.parametrize("case", ["stage1_bf16", "stage2_fp32", "stage3_bf16"])
def test_zero_to_fp32_reads_deepspeeds_checkpoints_as_deepspeed_does(case, monkeypatch):
    from safetensors.torch import load_file

    monkeypatch.setitem(sys.modules, "deepspeed", None)
    from zero_strategy.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ours = get_fp32_state_dict_from_zero_checkpoint(DATA / case)
    reference = load_file(DATA / case / "reference.safetensors")
    theirs = {k.split("/", 1)[1]: v for k, v in reference.items() if k.startswith("zero_to_fp32/")}
    assert theirs and set(theirs) <= set(ours)
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name


# ---- on 2 ranks -------------------------------------------------------------------------------


class Regressor(nn.Module):
    """Returns its loss and the logits it came from: a direct backward of the loss must divide once."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x, y=None):
        logits = self.fc2(torch.tanh(self.fc1(x)))
        return {"loss": F.mse_loss(logits.float(), y), "logits": logits} if y is not None else logits


def config(stage: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, **extra}


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def _train(rank: int, how: str, stage: int, **extra) -> dict:
    torch.manual_seed(0)
    model = Regressor()
    engine, _, _, _ = deepspeed.initialize(model=model, config=config(stage, **extra))
    for step in range(4):
        x, y = _batch(step, rank)
        x, y = x.to(engine.device), y.to(engine.device)
        if how == "logits.backward(grad)":
            logits = engine(x)
            loss = F.mse_loss(logits.float(), y)
            (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
            logits.backward(grad)
        else:
            loss = engine(x, y)["loss"]
            loss *= 1.0  # an in-place edit of an output, as scripts make (``loss /= n``), is allowed
            {"engine.backward": engine.backward, "loss.backward": lambda l: l.backward(),
             "scale(loss).backward": lambda l: engine.scale(l).backward()}[how](loss)
        engine.step()
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {name: p.detach().float().clone() for name, p in model.named_parameters()}


def _fp16_refusal(rank: int) -> str:
    torch.manual_seed(0)
    model = Regressor()
    engine, _, _, _ = deepspeed.initialize(model=model, config=config(1, fp16={"enabled": True}))
    x, y = _batch(0, rank)
    try:
        engine(x, y)["loss"].backward()
    except RuntimeError as err:
        return str(err)
    return "no error"


def _fp16_autocast(rank: int) -> dict:
    """torch_autocast to float16: fp32 weights, an fp16 forward, the loss scaled (direct backward refused)."""
    torch.manual_seed(0)
    model = Regressor()
    before = model.fc1.weight.detach().clone()
    engine, _, _, _ = deepspeed.initialize(model=model, config=config(1, torch_autocast={"enabled": True,
                                                                                          "dtype": "fp16"}))
    x, y = _batch(0, rank)
    out = engine(x, y)
    try:
        out["loss"].backward()
        refusal = "no error"
    except RuntimeError as err:
        refusal = str(err)
    for step in range(2):
        engine.backward(engine(*_batch(step, rank))["loss"])
        engine.step()
    return {"dtypes": (out["logits"].dtype, model.fc1.weight.dtype), "refusal": refusal,
            "autocast": (engine.torch_autocast_enabled(), engine.torch_autocast_dtype(), engine.fp16_enabled()),
            "scale": engine.precision.scaler.scale, "moved": not torch.equal(before, model.fc1.weight.detach())}


class Probe(Regressor):
    """Its loss without ``.float()``: under autocast mse_loss computes in fp32 whatever the logits' dtype."""

    def forward(self, x, y):
        logits = self.fc2(torch.tanh(self.fc1(x)))
        return {"loss": F.mse_loss(logits, y), "logits": logits}


def _bf16_full(rank: int, stage: int) -> dict:
    """DeepSpeedExamples' bf16_full: bf16 weights, their own masters, bf16 optimizer state, the forward
    under autocast (fp32 inputs as given: autocast casts them for the bf16 Linear layers)."""
    from zero_strategy.memory import memory_stats

    torch.manual_seed(0)
    model = Probe()
    engine, opt, _, _ = deepspeed.initialize(model=model, config=config(
        stage, bf16={"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
        torch_autocast={"enabled": True, "dtype": "torch.bfloat16"}))
    losses, dtypes = [], set()
    for step in range(8):
        out = engine(*_batch(step % 2, rank))  # two batches over and over: the loss must fall
        dtypes.add((str(out["logits"].dtype), str(out["loss"].dtype)))
        engine.backward(out["loss"])
        engine.step()
        losses.append(out["loss"].item())
    return {"losses": losses, "dtypes": sorted(dtypes), "weights": str(model.fc1.weight.dtype),
            "state": sorted({str(t.dtype) for t in opt.step_backend.stored_tensors()}),
            "masters": memory_stats(model, [opt])["master_params"]}


def _zero_init(rank: int, folder: str) -> dict:
    cfg = config(3, bf16={"enabled": True})
    with pytest.raises(ValueError, match="only stage 3 builds the model sharded"):
        deepspeed.zero.Init(config_dict_or_path=config(2))
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = Regressor()
    on_meta = all(p.is_meta for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg)
    torch.manual_seed(0)
    eager = Regressor().to(torch.bfloat16).state_dict()  # what the same seed builds whole
    built = _gathered(model)
    for step in range(2):
        engine.backward(engine(*_batch(step, rank))["loss"])
        engine.step()
    with deepspeed.zero.GatheredParameters(model.fc1.weight):
        whole = model.fc1.weight.detach().clone()
    gathered = {n: p.detach().clone() for n, p in _gathered(model).items()}
    saved = engine.save_16bit_model(folder, "model16.bin")
    engine.save_checkpoint(folder)
    return {"on_meta": on_meta, "whole": whole, "gathered": gathered, "saved": saved,
            "as_eager": built.keys() == eager.keys() and all(torch.equal(built[k], eager[k]) for k in eager)}


def _gathered(model: nn.Module) -> dict:
    with deepspeed.zero.GatheredParameters(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _comm(rank: int, world_size: int, folder: str) -> dict:
    import os

    dist = deepspeed.comm
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed.init_distributed()  # the pool's group: used as it is
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total, op=dist.ReduceOp.SUM, prof=True, log_name="sum")  # DeepSpeed's logger keywords
    shared = torch.tensor([float(rank)])
    dist.broadcast(shared, src=1)
    parts = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(parts, torch.tensor([10.0 * rank]))
    flat = torch.zeros(world_size)
    dist.allgather_fn(flat, torch.tensor([float(rank)]))
    dist.barrier()
    # the command-line route: the config from --deepspeed_config, args.local_rank set to the launcher's
    path = Path(folder) / "ds.json"
    if rank == 0:
        path.write_text(json.dumps(config(2)))
    dist.barrier()
    args = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args(["--deepspeed_config", str(path)])
    args.local_rank = -1
    engine, _, _, _ = deepspeed.initialize(args=args, model=Regressor())
    return {"queries": (dist.is_initialized(), dist.get_rank(), dist.get_world_size(), dist.get_local_rank()),
            "values": (total.item(), shared.item(), [p.item() for p in parts], flat.tolist()),
            "args": (args.local_rank, engine.local_rank, engine.zero_optimization_stage())}


def _leaves(rank: int, flagged: bool) -> dict:
    """Experts chosen without a router (tests/routed.py), through ``initialize`` at stage 3: their layers
    flagged with ``deepspeed.utils.set_z3_leaf_modules`` before it, or learned in the first passes."""
    from .routed import MoELayer, MoENet, batch

    torch.manual_seed(0)
    model = MoENet(top_k=1, gate="hash")
    flags = deepspeed.utils.set_z3_leaf_modules(model, [MoELayer]) if flagged else []
    engine, _, _, _ = deepspeed.initialize(model=model, config=config(3))
    for step in range(4):
        for micro in range(2):  # gradient_accumulation_steps: 2
            x, y, _ = batch(step, rank, micro)
            engine.backward(F.mse_loss(engine(x), y))
            engine.step()
    return {"flags": len(flags), "units": [u.name for u in engine.sharder.units],
            "learned": list(engine.sharder.learner.learned), "params": _gathered(model)}


def _door(rank: int, world_size: int, folder: str) -> dict:
    out = {"comm": _comm(rank, world_size, folder), "leaves": {flagged: _leaves(rank, flagged) for flagged in (True,
                                                                                                            False)}}
    for stage in (1, 3):
        out[f"fp32 stage {stage}"] = {how: _train(rank, how, stage) for how in (
            "engine.backward", "loss.backward", "scale(loss).backward", "logits.backward(grad)")}
    out["fp16"] = {how: _train(rank, how, 2, fp16={"enabled": True, "initial_scale_power": 8})
                   for how in ("engine.backward", "scale(loss).backward")}
    out["fp16 refusal"] = _fp16_refusal(rank)
    out["fp16 autocast"] = _fp16_autocast(rank)
    out["bf16_full"] = {stage: _bf16_full(rank, stage) for stage in (2, 3)}
    out["zero.Init"] = _zero_init(rank, folder)
    return out


@pytest.mark.timeout(200)
def test_scripts_surface_on_two_ranks(tmp_path):
    from zero_strategy.deepspeed.backward import UNSCALED_FP16
    from zero_strategy.utils.zero_to_fp32 import (get_fp32_state_dict_from_zero_checkpoint,
                                                  load_state_dict_from_zero_checkpoint)

    by_rank = run_distributed(_door, 2, str(tmp_path))
    for rank, out in enumerate(by_rank):
        assert out["comm"]["queries"] == (True, rank, 2, rank)
        assert out["comm"]["values"] == (3.0, 1.0, [0.0, 10.0], [0.0, 1.0])
        assert out["comm"]["args"] == (rank, rank, 2)
        for name in ("fp32 stage 1", "fp32 stage 3", "fp16"):
            runs = out[name]
            for how, params in runs.items():  # the same gradients, to the bit: one division per path
                for key, value in params.items():
                    assert torch.equal(value, runs["engine.backward"][key]), (name, how, key)
        assert not torch.equal(out["fp32 stage 1"]["engine.backward"]["fc1.weight"], Regressor().fc1.weight)
        assert out["fp16 refusal"] == UNSCALED_FP16
        autocast = out["fp16 autocast"]
        assert autocast["dtypes"] == (torch.float16, torch.float32) and autocast["refusal"] == UNSCALED_FP16
        assert autocast["autocast"] == (True, torch.float16, False) and autocast["scale"] == 2.0**16
        assert autocast["moved"]
        for stage, run in out["bf16_full"].items():  # bf16 weights under autocast, no fp32 copy, bf16 state
            assert run["dtypes"] == [("torch.bfloat16", "torch.float32")] and run["weights"] == "torch.bfloat16"
            assert run["state"] == ["torch.bfloat16"] and run["masters"] == 0, (stage, run)
            first, last = run["losses"][:2], run["losses"][-2:]  # the two batches, before and after 3 steps
            assert sum(last) < 0.85 * sum(first), (stage, run["losses"])  # it learns
        init = out["zero.Init"]
        assert init["on_meta"] and init["saved"] and init["whole"].shape == (16, 6)
        assert init["as_eager"]  # built inside zero.Init: the eager build's weights, bit for bit
        assert torch.equal(init["whole"], init["gathered"]["fc1.weight"])
    assert torch.equal(by_rank[0]["zero.Init"]["whole"], by_rank[1]["zero.Init"]["whole"])
    for out in by_rank:  # set_z3_leaf_modules: each flagged layer one unit from the start, nothing to learn
        flagged, learned = out["leaves"][True], out["leaves"][False]
        assert flagged["flags"] == 2 and flagged["units"] == learned["units"]  # every parameter sharded here
        assert {"blocks.0.moe", "blocks.1.moe"} <= set(flagged["units"]) and not any(
            ".experts." in name for name in flagged["units"]), flagged["units"]
        assert flagged["learned"] == [] and len(learned["learned"]) == 1
        for name, value in learned["params"].items():  # the same training either way, to the bit
            assert torch.equal(flagged["params"][name], value), name

    gathered = by_rank[0]["zero.Init"]["gathered"]
    saved16 = torch.load(tmp_path / "model16.bin", weights_only=True)
    assert saved16.keys() == gathered.keys()
    for key, value in saved16.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, gathered[key]), key
    fp32 = get_fp32_state_dict_from_zero_checkpoint(tmp_path)  # the tag `latest` names
    for key, value in fp32.items():  # the fp32 masters, which round to the bf16 weights
        assert value.dtype == torch.float32 and torch.equal(value.to(torch.bfloat16), gathered[key]), key
    fresh = load_state_dict_from_zero_checkpoint(Regressor(), tmp_path)
    assert torch.equal(fresh.fc2.bias, fp32["fc2.bias"])
