"""Stage-3 units without a process group: the default size walk, and shard_modules' errors."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from zero_strategy.engine.params.plan import MAX_UNIT_FRACTION, is_called, plan_units


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
