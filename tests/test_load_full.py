"""Full weights into a model on the engine (issue 50, item 5): torch's ``load_state_dict`` on the module, a
submodule or a wrapper, at every stage, as torch loads a plain model (values, strict's missing and
unexpected keys, shape errors with the real shapes) with the fp32 masters exact; and in a Fabric loop
at stage 3, through ``model.load_state_dict`` and ``fabric.load_raw``, training as Fabric's DDP does
from the same file, ``load_raw`` reading each rank's slices only (see [Note: loading a full state dict]
in zero_strategy/engine/params/whole_state.py)."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from torch import nn

from zero_strategy import ZeroConfig
from zero_strategy.engine import Collectives
from zero_strategy.frontend.precision import WorkingPrecision
from zero_strategy.frontend.setup import setup_engine

from .distributed import run_distributed
from .test_fabric import FP32, Net, assert_same, fabric_for, train, whole, zero


class Wrapper(nn.Module):
    """A LightningModule's shape: the model as an attribute, its keys under ``model.``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Net()


def _on_engine(stage: int, precision: str = "32-true") -> tuple[Wrapper, object]:
    torch.manual_seed(0)
    wrapper = Wrapper()
    config = ZeroConfig(stage=stage, shard_modules=("Block",), param_persistence_threshold=0, bucket_cap_mb=0.001)
    engine = setup_engine(wrapper, config, WorkingPrecision(precision), Collectives(), torch.device("cpu"),
                          lambda: [torch.optim.SGD(wrapper.parameters(), lr=0.1)])
    return wrapper, engine


def _error(call) -> str:
    try:
        call()
    except RuntimeError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_load_state_dict_on_the_engine_loads_as_torch_does(stage):
    torch.manual_seed(5)
    plain = Wrapper()  # the checkpoint's model, and torch's own behaviour to compare with
    full = plain.state_dict()
    wrapper, engine = _on_engine(stage, "bf16-mixed")
    assert str(wrapper.load_state_dict(full)) == "<All keys matched successfully>"
    got = engine.full_state_dict()
    for key, value in full.items():  # bf16 working weights, rounded from the checkpoint's
        assert torch.equal(got[key], value.to(got[key].dtype)), key
    names = {p: n for n, p in wrapper.named_parameters()}
    for g in engine.optimizers[0].groups:  # the fp32 masters hold the checkpoint's values, not the rounded ones
        for piece in g.pieces:
            want = full[names[g.params[piece.param]]].reshape(-1)[piece.param_start:piece.param_end]
            assert torch.equal(g.stepped(piece), want)

    wrapper, engine = _on_engine(stage)
    sub = {k[len("model.blocks.1."):]: v * 2 for k, v in full.items() if k.startswith("model.blocks.1.")}
    assert str(wrapper.model.blocks[1].load_state_dict(sub)) == "<All keys matched successfully>"  # a submodule
    assert torch.equal(engine.full_state_dict()["model.blocks.1.fc2.weight"], full["model.blocks.1.fc2.weight"] * 2)
    partial = {k: v for k, v in full.items() if not k.startswith("model.head.")} | {"model.extra": torch.ones(1)}
    assert _error(lambda: wrapper.load_state_dict(partial)) == _error(lambda: Wrapper().load_state_dict(partial))
    assert wrapper.load_state_dict(partial, strict=False) == Wrapper().load_state_dict(partial, strict=False)
    wrong = dict(full, **{"model.head.weight": torch.zeros(5, 16)})
    message = _error(lambda: wrapper.load_state_dict(wrong))
    assert message == _error(lambda: Wrapper().load_state_dict(wrong))  # torch's words, the real shapes
    assert ("size mismatch for model.head.weight: copying a param with shape torch.Size([5, 16]) from checkpoint, "
            "the shape in current model is torch.Size([3, 16]).") in message
    assert str(wrapper.load_state_dict(full, assign=True)) == "<All keys matched successfully>"
    got = engine.full_state_dict()
    assert all(torch.equal(got[key], value) for key, value in full.items())
    if stage == 3:
        assert all(p.numel() == 0 for u in engine.sharder.units for g in u.groups for p in g.params)  # still sharded


# ---- Fabric, 2 ranks, stage 3 ---------------------------------------------------------------------


class Wide(nn.Module):
    """About 63 MB of fp32 weights, each Linear's weight over glibc's 4 MiB mmap threshold (so a tensor
    read whole would show in the resident set)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(1024, 1536) if i % 2 == 0 else nn.Linear(1536, 1024)
                                      for i in range(10)))


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def _fabric_loads(rank: int, world_size: int, small: str, wide: str) -> dict:
    from zero_strategy import gathered_parameters
    from zero_strategy.fabric import ZeroFabricStrategy

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    out = {}
    # load_raw of a 63 MB file at stage 3, the defaults: the peak over the load, less the resident set before it
    fabric = fabric_for(ZeroFabricStrategy(stage=3), world_size)
    with fabric.init_module(empty_init=True):
        wide_model = Wide()
    out["model_bytes"] = sum(p.numel() * 4 for p in wide_model.parameters())
    model = fabric.setup(wide_model)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set starts from the resident set now
    before = _rss_kib("VmRSS:")
    fabric.load_raw(wide, model)
    out["peak"] = (_rss_kib("VmHWM:") - before) * 1024
    file = torch.load(wide, weights_only=True, mmap=True)
    last = wide_model.layers[9]
    with gathered_parameters(last):  # the last layer whole (the small model below checks every tensor)
        out["wide_equal"] = all(torch.equal(p, file[f"layers.9.{n}"]) for n, p in last.named_parameters())
    del model, wide_model, last, file
    # a consolidated checkpoint, then training: through model.load_state_dict and fabric.load_raw, against DDP
    state = torch.load(small, weights_only=True)
    for name in ("ddp", "load_state_dict", "load_raw"):
        fabric = fabric_for("ddp" if name == "ddp" else zero(3), world_size)
        net = Net()
        model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=0.02))
        if name == "load_raw":
            fabric.load_raw(small, model)
        else:
            model.load_state_dict(state)  # _FabricModule's, which calls Net's
        initial = whole(fabric, model)
        run = train(fabric, model, [opt], rank, steps=4)
        out[name] = {"initial": initial, "losses": run["losses"], "params": whole(fabric, model)}
    wrong = {**state, "head.weight": torch.zeros(4, 16)}
    out["wrong"] = _error(lambda: model.load_state_dict(wrong))
    return out


@pytest.mark.timeout(240)
def test_a_consolidated_checkpoint_loads_into_stage_3_and_trains_as_ddp(tmp_path):
    torch.manual_seed(3)
    state = Net().state_dict()
    torch.save(state, tmp_path / "consolidated.pt")
    torch.manual_seed(4)
    torch.save(Wide().state_dict(), tmp_path / "wide.pt")
    for out in run_distributed(_fabric_loads, 2, str(tmp_path / "consolidated.pt"), str(tmp_path / "wide.pt")):
        assert out["wide_equal"]
        # each rank read its slices, half the file (a whole read, as torch.load without mmap, peaks at all of it)
        assert out["peak"] < 0.75 * out["model_bytes"], (out["peak"], out["model_bytes"])
        for name in ("load_state_dict", "load_raw"):
            for key, value in state.items():
                assert torch.equal(out[name]["initial"][key], value), (name, key)
            assert_same(out[name], out["ddp"], **FP32)
        assert ("size mismatch for head.weight: copying a param with shape torch.Size([4, 16]) from checkpoint, the "
                "shape in current model is torch.Size([3, 16]).") in out["wrong"]
