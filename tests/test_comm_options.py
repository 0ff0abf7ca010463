"""The communication options' settings: validation without a process group, the checks that need the
world (4 gloo ranks), the quantized reduce-scatter's error bound, DeepSpeed's ZeRO++ keys, and
zero-estimate's communication table."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zero_strategy.config import ZeroConfig
from zero_strategy.engine import Collectives, shard_module
from zero_strategy.engine.comm.volume import NodeLayout, sent_bytes
from zero_strategy.engine.comm.quantize import QuantSpec
from zero_strategy.memory import estimate_memory

from .distributed import run_distributed


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(stage=2, quantized_weights=True), "quantized_weights=True quantizes stage 3's"),
    (dict(stage=3, quantized_weights="yes"), "quantized_weights='yes' must be True or False"),
    (dict(quantized_gradients="int2"), "quantized_gradients='int2' is not one of"),
    (dict(quantized_gradients=4), "quantized_gradients=4 is not one of"),
    (dict(quantization_block_size=1), "quantization_block_size=1 must be an integer of at least 2"),
    (dict(stage=3, secondary_partition_size=1), "1 would mean no secondary partition: use None"),
    (dict(stage=3, secondary_partition_size=2.0), "secondary_partition_size=2.0 must be an integer"),
    (dict(stage=2, secondary_partition_size=2), "secondary_partition_size=2 keeps a secondary shard of stage 3"),
])
def test_settings_that_make_no_sense_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ZeroConfig(**kwargs)


def test_settings_are_normalised():
    assert ZeroConfig(quantized_gradients=True).quantized_gradients == "int8"
    assert ZeroConfig(quantized_gradients=False).quantized_gradients is None
    config = ZeroConfig(stage=3, quantized_weights=True, quantized_gradients="int4", quantization_block_size=128)
    assert config.weight_quantization == QuantSpec(8, 128) and config.gradient_quantization == QuantSpec(4, 128)
    assert ZeroConfig().weight_quantization is None and ZeroConfig().gradient_quantization is None


def test_node_layout_and_the_definition_of_bytes_sent(monkeypatch):
    with pytest.raises(ValueError, match="must hold each of the 1 ranks once"):
        Collectives().split([[0], [0]])
    with pytest.raises(ValueError, match="ranks_per_node=3 does not divide the world size 4"):
        NodeLayout(4, 3)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    layout = NodeLayout(8)
    assert layout.num_nodes == 4 and layout.spans_nodes([2, 3]) is False and layout.spans_nodes([1, 2]) is True
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    with pytest.raises(ValueError, match=r"\$LOCAL_WORLD_SIZE='x' must be a positive integer"):
        NodeLayout(8)
    with pytest.raises(ValueError, match="ranks_per_node=0 must be a positive integer"):
        NodeLayout(8, 0)
    assert sent_bytes("all_gather", 1000, 4) == 750 and sent_bytes("all_reduce", 1000, 4) == 1500
    assert sent_bytes("all_reduce", 7, 4) == 10 and sent_bytes("broadcast", 1000, 1) == 0  # whole bytes; nothing alone


# ---- on 4 ranks -----------------------------------------------------------------------------------

def _model():
    return nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))


def _checks_that_need_the_world(rank: int, world_size: int) -> dict:
    errors = {}
    for name, per_node, size in (("not dividing the world", 4, 3), ("one rank per node", 1, 2),
                                 ("not dividing the node", 2, 4)):
        config = ZeroConfig(stage=3, shard_modules=("Linear",), param_persistence_threshold=0,
                            secondary_partition_size=size)
        try:
            shard_module(_model(), config, Collectives(ranks_per_node=per_node))
            errors[name] = None
        except ValueError as error:
            errors[name] = str(error)
    try:
        Collectives(ranks_per_node=3)
    except ValueError as error:
        errors["layout"] = str(error)

    # the quantized reduce-scatter against the exact sum, one hop (one node, or a rank per node) and two
    bounds = {}
    for per_node in (4, 1, 2):
        comm = Collectives(ranks_per_node=per_node)
        for bits in (8, 4):
            spec = QuantSpec(bits, 64)
            g = torch.Generator().manual_seed(rank)
            x = torch.randn(world_size * 640, generator=g) * (1 + torch.arange(world_size * 640) % 7)
            exact = x.clone()
            dist.all_reduce(exact)
            want = exact.view(world_size, -1)[rank]
            largest = x.abs().max()
            dist.all_reduce(largest, op=dist.ReduceOp.MAX)
            got = torch.empty(640)
            noise = torch.Generator().manual_seed(rank)
            comm.quantized_reduce_scatter(got, x, spec, noise=noise).wait()
            step = largest / spec.qmax  # the coarsest block's step; stochastic rounding errs by less than one
            if per_node in (1, world_size):  # each rank's chunk rounded once
                bound = world_size * step
            else:  # rounded in each node (2 ranks each), then each node's partial sum rounded again
                partial = 2 * largest + 2 * step  # at most, in the second hop's coarsest block
                bound = 4 * step + 2 * partial / spec.qmax
            bounds[(per_node, bits)] = ((got - want).abs().max().item(), bound.item(), (got - want).abs().mean().item())
    return {"errors": errors, "bounds": bounds}


@pytest.mark.timeout(120)
def test_on_four_ranks_the_world_is_checked_and_quantized_reductions_stay_in_bounds():
    for result in run_distributed(_checks_that_need_the_world, 4):
        errors = result["errors"]
        assert "secondary_partition_size=3 does not divide the world size 4" in errors["not dividing the world"]
        assert "secondary_partition_size=2 with one rank per node" in errors["one rank per node"]
        assert "secondary_partition_size=4 does not divide the 2 ranks per node" in errors["not dividing the node"]
        assert "ranks_per_node=3 does not divide the world size 4" in errors["layout"]
        for (per_node, bits), (worst, bound, mean) in result["bounds"].items():
            assert worst <= bound, f"{per_node} ranks per node, int{bits}: error {worst} above {bound}"
            assert mean < bound / 4  # most elements far inside the bound: a real sum, not noise


# ---- DeepSpeed's keys and zero-estimate ---------------------------------------------------------

def test_deepspeeds_zero_plus_plus_keys_map_onto_the_options():
    from zero_strategy.deepspeed.config import DeepSpeedConfigError, map_deepspeed_config

    zero = {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 8, "zero_quantized_gradients": True}
    settings = map_deepspeed_config({"zero_optimization": zero})
    assert {k: settings.strategy[k] for k in ("quantized_weights", "secondary_partition_size", "quantized_gradients")} \
        == {"quantized_weights": True, "secondary_partition_size": 8, "quantized_gradients": "int4"}
    ZeroConfig(**settings.strategy)  # valid settings
    off = map_deepspeed_config({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1,
                                                      "zero_quantized_weights": False}})
    assert not {"quantized_weights", "secondary_partition_size", "quantized_gradients"} & set(off.strategy)
    with pytest.raises(DeepSpeedConfigError, match="zero_quantized_weights at stage 2"):
        map_deepspeed_config({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}})


def test_zero_estimate_prints_the_models_bytes_for_every_variant(capsys):
    pytest.importorskip("hydra")
    from zero_strategy.cli.estimate import main as zero_estimate
    from zero_strategy.cli.report import format_bytes
    from zero_strategy.comm_model import links, variant_rows
    from zero_strategy.models.gpt import GPT

    assert zero_estimate(["world_size=8", "comm.devices_per_node=2", "comm.inter_node_gbps=10", "strategy=zero3",
                          "model.net.n_layer=2"]) == 0
    printed = capsys.readouterr().out
    assert "8 ranks (4 nodes x 2)" in printed and "10 GB/s between nodes" in printed
    with torch.device("meta"):
        net = GPT(n_layer=2, n_head=4, n_embd=128, block_size=128)  # conf/model/gpt.yaml with n_layer=2
    base = ZeroConfig(shard_modules=("Block", "GPT2Block", "BertLayer"), param_persistence_threshold=1024)
    rows = variant_rows(net, base, 8, 2, links(inter_node_gbps=10), clipping=True)  # the default trainer clips
    assert len(rows) == 13  # every variant: hpZ and HSDP have several nodes of several ranks here
    lines = {line.split("│")[1].strip(): line for line in printed.splitlines() if line.count("│") > 5}
    for row in rows:
        line = lines[row["variant"]]
        for key in ("all_gather", "reduce_scatter", "intra_node", "inter_node", "total"):
            assert format_bytes(row["stats"][key]) in line, (row["variant"], key)
        assert f"{row['seconds'] * 1e3:,.2f}" in line
    assert zero_estimate(["world_size=8", "comm.devices_per_node=3"]) == 2
    assert "comm.devices_per_node=3 must be a positive integer dividing world_size=8" in capsys.readouterr().err
    # a stage-3 option in the configured strategy is read with its stage, not against the default stage 2
    assert zero_estimate(["world_size=4", "strategy=zero3", "strategy.quantized_weights=true",
                          "model.net.n_layer=2"]) == 0
    assert "ZeRO-3 + qwZ" in capsys.readouterr().out
    # hybrid sharding: the model state of a shard group of 2, as estimate_memory gives it for 2 ranks
    assert zero_estimate(["world_size=8", "comm.devices_per_node=2", "strategy=zero3", "model.net.n_layer=2",
                          "strategy.shard_group_size=node"]) == 0
    printed = capsys.readouterr().out
    assert "sharded over shard groups of 2 ranks (shard_group_size), 4 replicas" in " ".join(printed.split())
    stage3 = next(line for line in printed.splitlines() if line.startswith("│ 3 *"))
    numel = sum(p.numel() for p in net.parameters())
    assert format_bytes(estimate_memory(numel, 3, 2)["total"]) in stage3


def test_the_apps_comm_stats_callback_refuses_an_unknown_key_at_construction():
    pytest.importorskip("lightning")
    from zero_strategy.cli.callbacks import CommStats

    assert CommStats(["total", "inter_node"]).keys == ("total", "inter_node")
    with pytest.raises(ValueError, match=r"\['inter_nodes'\] are not keys of comm_stats\(\); choose among"):
        CommStats(["total", "inter_nodes"])


# ---- gradients of some modules reduced in bf16 (DeepSpeed's lower_precision_safe_modules) ----------


class _Mixed(nn.Module):
    """Linear layers (reduced in bf16), a LayerNorm and a bare parameter (in fp32); a Linear subclass,
    which an exact class match leaves in fp32, as DeepSpeed's does."""

    class Wider(nn.Linear):
        pass

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 32), nn.LayerNorm(32), _Mixed.Wider(32, 4)
        self.fc3 = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.fc2(torch.tanh(self.norm(self.fc1(x))))) * self.scale


def _reduced_in_bf16(rank: int, world_size: int) -> dict:
    from zero_strategy import gathered_parameters
    from zero_strategy.engine import ZeroOptimizer

    g = torch.Generator().manual_seed(10 + rank)
    x, y = torch.randn(16, 8, generator=g) * 3, torch.randn(16, 4, generator=g)
    out = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        reference, model = _Mixed(), _Mixed()
        model.load_state_dict(reference.state_dict())
        # every rank's own gradient, then the sum each reduction should give (SGD with lr 1: the update is it)
        torch.nn.functional.mse_loss(reference(x), y).backward()
        grads = {n: p.grad for n, p in reference.named_parameters()}
        every = {n: [torch.empty_like(t) for _ in range(world_size)] for n, t in grads.items()}
        for n, t in grads.items():
            dist.all_gather(every[n], t)
        low = {"fc1.weight", "fc1.bias", "fc3.weight", "fc3.bias"}
        want = {}
        for n, parts in every.items():
            if n in low:  # each divided and rounded to bf16, their sum rounded again
                total = sum(p.div(world_size).bfloat16().float() for p in parts).bfloat16().float()
            else:
                total = sum(p.div(world_size) for p in parts)
            want[n] = dict(reference.named_parameters())[n].detach() - total
        config = ZeroConfig(stage=stage, shard_modules=("Linear",), param_persistence_threshold=0, bucket_cap_mb=1e-3,
                            low_precision_reduce_modules=(nn.Linear,), low_precision_reduce_dtype=torch.bfloat16)
        user = torch.optim.SGD(model.parameters(), lr=1.0)
        opt = ZeroOptimizer(user, config, sharder=shard_module(model, config, optimizers=[user]))  # the front ends' way
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        with gathered_parameters(model):
            got = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[stage] = {"equal": sorted(n for n in want if torch.equal(got[n], want[n])),
                      "reduce_dtypes": sorted({str(grp.reduce_dtype) for grp in opt.groups})}
    return out


@pytest.mark.timeout(120)
def test_the_named_modules_gradients_are_reduced_in_bf16_and_the_rest_in_fp32():
    names = sorted(n for n, _ in _Mixed().named_parameters())
    for result in run_distributed(_reduced_in_bf16, 2):
        for stage, got in result.items():
            assert got["equal"] == names, (stage, sorted(set(names) - set(got["equal"])))  # each param bit for bit
            assert got["reduce_dtypes"] == ["None", "torch.bfloat16"], stage


def test_low_precision_reductions_are_refused_where_they_cannot_apply():
    from zero_strategy.engine import FlatParameters

    with pytest.raises(ValueError, match=r"low_precision_reduce_dtype=torch.float32 must be torch.bfloat16"):
        ZeroConfig(low_precision_reduce_modules=("Linear",), low_precision_reduce_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"low_precision_reduce_modules holds \[3\]"):
        ZeroConfig(low_precision_reduce_modules=(3,))
    config = ZeroConfig(stage=2, low_precision_reduce_modules=("Linear",))
    with pytest.raises(ValueError, match=r"without low_precision_reduce_dtype: give the dtype"):
        shard_module(_model(), config)
    model = _model()
    with pytest.raises(ValueError, match=r"names module classes: build the flat groups over the module"):
        FlatParameters(list(model.parameters()), ZeroConfig(stage=2, low_precision_reduce_modules=("Linear",),
                                                            low_precision_reduce_dtype=torch.bfloat16), Collectives())
