"""What a script does to a model built on meta before setup (issue 50, item 4): initialised by the script
(``normal_`` on its parameters, ``model.apply(fn)``, ``reset_parameters`` partials, views, a dtype
conversion) the stage-3 model equals an eager build on the same random state, and a Fabric loop equals
Fabric's DDP from the first loss; what cannot be replayed exactly is refused at setup, naming the tensor
(see [Note: changes before setup] in zero_strategy/engine/params/edits.py)."""

from __future__ import annotations

import math
import os
from functools import partial

import pytest
import torch
from torch import nn

from zero_strategy import ZeroConfig
from zero_strategy.engine import Collectives
from zero_strategy.frontend.precision import WorkingPrecision
from zero_strategy.frontend.setup import setup_engine
from zero_strategy.pretrained import load_pretrained, sharded_init

from .distributed import run_distributed
from .test_fabric import FP32, Net, assert_same, fabric_for, train, whole, zero


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)


def normal_on_parameters(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.zero_()


def apply_init(model: nn.Module) -> None:
    def init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
    model.apply(init)


def partials(model: nn.Module) -> None:
    """litgpt's pretraining script: reset_parameters partials, called on every module (its non-FSDP path)."""
    def init_weights(module: nn.Module, std: float) -> None:
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    for m in model.modules():
        if isinstance(m, (nn.Embedding, nn.Linear)):
            m.reset_parameters = partial(init_weights, m, std=math.sqrt(2.0 / 5 / 8))
    for m in model.modules():
        if callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()


def views_and_skipping_inits(model: nn.Module) -> None:
    """``.data``, slices, torch.nn.init's trunc_normal_ and orthogonal_ (which return at once on meta), and
    a parameter replaced by one made from the model's own tensors."""
    with torch.no_grad():
        model.emb.weight.data.normal_(0, 0.5)
        model.blocks[0].weight[:2].fill_(0.25)
        nn.init.trunc_normal_(model.blocks[1].weight, std=0.02)
        nn.init.orthogonal_(model.blocks[2].weight)
        model.head.weight = nn.Parameter(model.head.weight.new_empty(4, 8).uniform_(-3, 3))


def converted_then_initialised(model: nn.Module) -> None:
    model.to(torch.bfloat16)
    normal_on_parameters(model)


def _stage3(build, change, **config) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    with sharded_init():
        model = build()
    change(model)
    engine = setup_engine(model, ZeroConfig(stage=3, param_persistence_threshold=0, shard_modules=(nn.Linear,),
                                            **config), WorkingPrecision(), Collectives(), torch.device("cpu"),
                          lambda: [torch.optim.SGD(model.parameters(), lr=0.1)])
    assert all(p.numel() == 0 for g in engine.sharder.groups if not g.resident for p in g.params)
    return engine.full_state_dict()


@pytest.mark.parametrize("change", [normal_on_parameters, apply_init, partials, views_and_skipping_inits,
                                    converted_then_initialised])
def test_changes_before_setup_give_an_eager_builds_values(change):
    torch.manual_seed(0)
    eager = Tiny()
    torch.manual_seed(0)  # DDP's init_module(empty_init=True) draws nothing before the script's changes
    change(eager)
    got = _stage3(Tiny, change)
    want = eager.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    default = _stage3(Tiny, lambda model: None)  # the construction's own values, which the changes replace
    assert not torch.equal(got["emb.weight"], default["emb.weight"])


def _refusal(change) -> str:
    try:
        _stage3(Tiny, change)
    except (ValueError, RuntimeError) as err:
        return str(err)
    return "no error"


def test_what_cannot_be_replayed_is_refused_naming_the_tensor(tmp_path):
    from safetensors.torch import save_file

    def pending(model):  # FSDP calls such partials when it materialises; neither DDP nor the replay does
        model.head.reset_parameters = partial(nn.init.normal_, model.head.weight, std=0.1)
    assert "reset_parameters was set on head (Linear)" in _refusal(pending)
    assert "call it before setup" in _refusal(pending)

    def draws_between(model):
        nn.init.normal_(model.head.weight)
        torch.randn(3)  # a real draw between two changes that draw: eager draws it in between
        nn.init.normal_(model.emb.weight)
    message = _refusal(draws_between)
    assert "random numbers were drawn" in message and "normal_ on a tensor of shape (10, 8)" in message

    def unseen(model):
        with torch.no_grad(), torch._C.DisableTorchFunction():  # the record cannot see this one
            model.head.weight.zero_()
    assert "head.weight was changed in place by a call the record did not see" in _refusal(unseen)

    def added_then_moved_to_meta(model):  # what peft's get_peft_model does after the context
        model.head.lora_b = nn.Linear(4, 4, bias=False)
        nn.init.zeros_(model.head.lora_b.weight)
        model.head.lora_b.to("meta")  # its values are gone: reset_parameters would give other ones
    message = _refusal(added_then_moved_to_meta)
    assert "['head.lora_b.weight'] are on the meta device but were made outside the model's record" in message

    save_file({k: v.contiguous() for k, v in Tiny().state_dict().items()}, str(tmp_path / "w.safetensors"))

    def loaded_then_changed(model):
        load_pretrained(model, tmp_path / "w.safetensors")
        nn.init.normal_(model.head.weight)
    message = _refusal(loaded_then_changed)
    assert "['head.weight'] were changed" in message and "after weights were loaded into them" in message

    def changed_then_loaded(model):  # the load comes last: its values are the ones to keep
        nn.init.normal_(model.head.weight)
        load_pretrained(model, tmp_path / "w.safetensors")
        model.to(torch.bfloat16)  # a conversion of the loaded values is no change to them
    assert _refusal(changed_then_loaded) == "no error"

    torch.manual_seed(0)
    with sharded_init():
        model = Tiny()
    view = model.head.weight.data
    setup_engine(model, ZeroConfig(stage=3), WorkingPrecision(), Collectives(), torch.device("cpu"))
    with pytest.raises(RuntimeError, match="normal_ on a meta tensor of a model that setup has taken over"):
        view.normal_()


# ---- Fabric, 2 ranks: stage 3 against Fabric's DDP ----------------------------------------------

CHANGES = {"normal_": normal_on_parameters, "apply": apply_init, "partials": partials}


def _fabric_runs(rank: int, world_size: int) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    out = {}
    for name, change in CHANGES.items():
        for strategy in ("ddp", "zero3"):
            fabric = fabric_for("ddp" if strategy == "ddp" else zero(3), world_size)
            torch.manual_seed(0)
            with fabric.init_module(empty_init=True):  # DDP: the modules' own init skipped; stage 3: on meta
                net = Net()
            change(net)
            model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=0.02))
            initial = whole(fabric, model)
            run = train(fabric, model, [opt], rank, steps=4)
            out[(name, strategy)] = {"initial": initial, "params": whole(fabric, model), "losses": run["losses"]}
    fabric = fabric_for(zero(3), world_size)  # an initialisation on rank 0 only, as DDP's broadcast allows
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        net = Net()
    if rank == 0:
        apply_init(net)
    try:
        fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=0.02))
        out["rank0_only"] = "no error"
    except ValueError as err:
        out["rank0_only"] = str(err)
    return out


@pytest.mark.timeout(240)
def test_a_fabric_script_that_initialises_before_setup_equals_ddp_at_stage_3():
    for out in run_distributed(_fabric_runs, 2):
        for name in CHANGES:
            ddp, got = out[(name, "ddp")], out[(name, "zero3")]
            for key, value in ddp["initial"].items():  # the very weights DDP starts from
                assert torch.equal(got["initial"][key], value), (name, key)
            assert got["losses"][0] == ddp["losses"][0], name
            assert_same(got, ddp, **FP32)
        assert "the ranks built or changed Net differently before setup" in out["rank0_only"]
        assert "if rank == 0:" in out["rank0_only"]
