"""Stage-3 units without a process group: the default size walk, and shard_modules' errors."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from zero_strategy.engine.params.plan import MAX_UNIT_FRACTION, is_called, plan_units, routed_experts


class Block(nn.Module):
    def __init__(self, d: int = 1024) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


def _numel(params) -> int:
    return sum(p.numel() for p in params)


def _check_partition(model: nn.Module, plan) -> None:
    """Every parameter is in exactly one place: a unit, the root, or resident."""
    placed = [p for u in plan.units for p in u.params] + list(plan.root) + list(plan.resident)
    assert len(placed) == len(set(placed)) == len(set(model.parameters()))


def _transformers_models():
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):  # the real sizes, without allocating them
        return {"gpt2": transformers.GPT2LMHeadModel(transformers.GPT2Config()),
                "bert": transformers.BertForSequenceClassification(transformers.BertConfig())}


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_default_units_of_gpt2_small_and_bert_base_are_called_modules_and_small(name):
    model = _transformers_models()[name]
    plan = plan_units(model)  # the defaults ZeroStrategy(stage=3) uses
    _check_partition(model, plan)
    total = _numel(model.parameters())
    assert len(plan.units) >= 12  # at least one per layer: the root does not hold the blocks
    for unit in plan.units:
        assert unit.modules and all(is_called(m) for m in unit.modules), unit.name
        assert not any(isinstance(m, (nn.ModuleList, nn.ModuleDict)) for m in unit.modules), unit.name
        leaf_alone = len(unit.modules) == 1 and not any(True for _ in unit.modules[0].children())
        assert _numel(unit.params) <= plan.target or leaf_alone, unit.name  # only a big leaf passes the target
    assert plan.target <= -(-total // MAX_UNIT_FRACTION)
    assert plan.leaves == ()  # no block list looks like routed experts (see [Note: leaf modules])
    # the root keeps only what several units share: GPT-2's lm_head is tied to the token embedding
    tied = {model.get_input_embeddings().weight} & {model.get_output_embeddings().weight} if name == "gpt2" else set()
    assert set(plan.root) == tied


def test_default_units_of_an_mlp_with_big_blocks_split_the_blocks():
    with torch.device("meta"):
        model = nn.Sequential(*[Block() for _ in range(8)])  # 67.1M parameters, 8.4M per block
    plan = plan_units(model)
    _check_partition(model, plan)
    assert [u.name for u in plan.units[:3]] == ["0.fc1", "0.fc2", "1.fc1"]  # a block is larger than the target
    assert len(plan.units) == 16 and not plan.root


def test_consecutive_small_children_share_a_unit_up_to_the_target():
    model = nn.Sequential(*[nn.Linear(100, 100) for _ in range(10)])  # 10,100 parameters each
    plan = plan_units(model, persist_numel=1000, unit_params=25_000)
    assert [len(u.modules) for u in plan.units] == [2, 2, 2, 2, 2]
    assert [u.name for u in plan.units][:2] == ["0..1", "2..3"]
    assert all(_numel(u.params) == 20_000 for u in plan.units)  # weights; the biases (100) are resident
    assert len(plan.resident) == 10


def test_containers_that_are_never_called_are_walked_through():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(300, 300) for _ in range(4))
            self.heads = nn.ModuleDict({"a": nn.Linear(300, 300), "b": nn.Linear(300, 300)})

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.heads["a"](x) + self.heads["b"](x)

    plan = plan_units(Net(), persist_numel=1000, unit_params=10**9)  # the target would take everything
    assert [u.name for u in plan.units] == ["layers.0..layers.3", "heads.a..heads.b"]
    with pytest.raises(ValueError, match=r"matched 'layers', a ModuleList, which is a container that is never called"):
        plan_units(Net(), shard_modules=["ModuleList"], persist_numel=1000)


def test_shard_modules_that_match_nothing_name_the_model_classes():
    model = nn.Sequential(Block(8), Block(8), nn.LayerNorm(8))
    with pytest.raises(ValueError, match=r"shard_modules=\['Blok'\] matches no module of Sequential.*"
                                         r"Linear \(4\), Block \(2\), Sequential \(1\), LayerNorm \(1\)"):
        plan_units(model, shard_modules=["Blok"], persist_numel=0)


def test_shard_modules_that_match_only_in_part_say_which_did(caplog):
    model = nn.Sequential(Block(8), Block(8))
    with caplog.at_level(logging.INFO, logger="zero_strategy.engine.params.plan"):
        plan = plan_units(model, shard_modules=["Block", "GPT2Block", nn.Embedding], persist_numel=0)
    assert [u.name for u in plan.units] == ["0", "1"]
    assert "['Block'] matched" in caplog.text and "'GPT2Block', 'Embedding'" in caplog.text


def test_a_parameter_shared_by_two_units_goes_to_the_root():
    model = nn.Sequential(nn.Embedding(50, 40), nn.Linear(40, 40), nn.Linear(40, 50, bias=False))
    model[2].weight = model[0].weight  # tied, GPT-2 style
    plan = plan_units(model, persist_numel=100, unit_params=1)
    assert list(plan.root) == [model[0].weight]
    assert [u.name for u in plan.units] == ["1"]


# ---- leaves: see [Note: leaf modules] ----------------------------------------------------------------


class Expert(nn.Module):
    def __init__(self, d: int = 64, f: int = 128) -> None:
        super().__init__()
        self.up = nn.Linear(d, f)
        self.down = nn.Linear(f, d)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class MixtralStyle(nn.Module):
    """A gate Linear beside a ModuleList of experts."""

    def __init__(self, d: int = 64, n: int = 8) -> None:
        super().__init__()
        self.gate = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList(Expert(d) for _ in range(n))

    def forward(self, x):
        best = self.gate(x).argmax(-1)
        return sum(torch.where((best == e)[:, None], expert(x), 0) for e, expert in enumerate(self.experts))


class MoEGate(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, d))

    def forward(self, x):
        return x @ self.weight.t()


class DeepSeekStyle(nn.Module):
    """Experts first, then a gate module holding its own weight, and a shared expert."""

    def __init__(self, d: int = 64, n: int = 4) -> None:
        super().__init__()
        self.experts = nn.ModuleList(Expert(d) for _ in range(n))
        self.gate = MoEGate(d, n)
        self.shared_experts = Expert(d)

    def forward(self, x):
        return self.shared_experts(x) + self.experts[int(self.gate(x).argmax()) % len(self.experts)](x)


class SwitchStyle(nn.Module):
    """A ModuleDict of experts and a router module holding the classifier."""

    def __init__(self, d: int = 64, n: int = 4) -> None:
        super().__init__()
        self.router = nn.Sequential(nn.Linear(d, n))
        self.experts = nn.ModuleDict({f"expert_{i}": Expert(d) for i in range(n)})

    def forward(self, x):
        return self.experts[f"expert_{int(self.router(x).argmax()) % len(self.experts)}"](x)


class Layer(nn.Module):
    def __init__(self, moe: nn.Module, d: int = 64) -> None:
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.moe = moe

    def forward(self, x):
        return self.moe(self.attn(x))


def _moe_model(moe_class, layers: int = 3) -> nn.Sequential:
    return nn.Sequential(nn.Embedding(100, 64), *[Layer(moe_class()) for _ in range(layers)], nn.Linear(64, 100))


@pytest.mark.parametrize("moe_class", [MixtralStyle, DeepSeekStyle, SwitchStyle])
def test_routed_experts_are_one_unit_per_layer_without_any_option(moe_class):
    model = _moe_model(moe_class)
    # an expert is 16.6k parameters: without the rule a target of 20k would make each one a unit
    plan = plan_units(model, persist_numel=1000, unit_params=20_000)
    _check_partition(model, plan)
    assert [name for name, _ in plan.leaves] == ["1.moe", "2.moe", "3.moe"]
    assert "beside the router weight" in plan.leaves[0][1]
    names = [u.name for u in plan.units]
    assert {"1.moe", "2.moe", "3.moe"} <= set(names), names
    assert not any(".experts." in name for name in names), names
    moe = plan.units[names.index("2.moe")]
    assert set(moe.params) == {p for p in model[2].moe.parameters() if p.numel() >= 1000}  # the router's too
    assert "2.attn" in names  # the rest of the layer keeps its own units


def test_a_list_of_blocks_beside_a_head_of_as_many_classes_is_not_taken_for_experts():
    # a classifier with as many classes as the model has blocks looks like a router: the candidate holds the
    # whole model, so the rule leaves it (one unit for everything would gather the whole model)
    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(64) for _ in range(4))
            self.head = nn.Linear(64, 4)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    model = nn.Sequential(Classifier())
    assert routed_experts(model[0]) is not None
    plan = plan_units(model, persist_numel=1000, unit_params=40_000)
    assert plan.leaves == () and [u.name for u in plan.units] == [f"0.blocks.{i}" for i in range(4)]  # head: resident


def test_leaf_modules_and_the_deepspeed_flag_keep_a_module_whole():
    class Hashed(nn.Module):  # experts chosen by token id: no router for the rule to see
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(Expert() for _ in range(4))

        def forward(self, x):
            return self.experts[int(x.sum()) % 4](x)

    def model():
        return nn.Sequential(*[Layer(Hashed()) for _ in range(2)])

    split = plan_units(model(), persist_numel=1000, unit_params=20_000)
    assert "0.moe.experts.0" in [u.name for u in split.units] and split.leaves == ()
    for by in ("name", "class", "flag"):
        m = model()
        if by == "flag":
            for layer in m:
                layer.moe._z3_leaf = True
        plan = plan_units(m, persist_numel=1000, unit_params=20_000,
                          leaf_modules={"name": ["Hashed"], "class": [Hashed], "flag": []}[by])
        assert [u.name for u in plan.units] == ["0.attn", "0.moe", "1.attn", "1.moe"], by
        assert plan.leaves[0][0] == "0.moe", by
    # with shard_modules: a named module inside a leaf is no unit of its own, a leaf outside every one is
    plan = plan_units(model(), shard_modules=["Expert", "Linear"], persist_numel=1000, leaf_modules=["Hashed"])
    assert [u.name for u in plan.units] == ["0.attn", "0.moe", "1.attn", "1.moe"]
    flagged = nn.Sequential(Expert(), Expert())
    flagged._z3_leaf = True  # the whole model: every parameter in the root unit
    plan = plan_units(flagged, persist_numel=1000, unit_params=20_000)
    assert plan.units == () and len(plan.root) == 4


def test_leaf_modules_naming_a_container_or_nothing_say_so(caplog):
    model = _moe_model(MixtralStyle)
    with pytest.raises(ValueError, match=r"leaf_modules matched '1.moe.experts', a ModuleList, which is a container"):
        plan_units(model, persist_numel=1000, leaf_modules=["ModuleList"])
    with caplog.at_level(logging.WARNING, logger="zero_strategy.engine.params.plan"):
        plan = plan_units(model, persist_numel=1000, leaf_modules=["MixtralSparseMoeBlock"])
    assert "leaf_modules=['MixtralSparseMoeBlock'] matches no module of Sequential" in caplog.text
    assert [name for name, _ in plan.leaves] == ["1.moe", "2.moe", "3.moe"]  # the rule still finds them
