"""Each option of ZeroConfig is written once, and every door follows from it (see [Note: one source
for each option] in zero_strategy/config.py). Fast: no process group, nothing launched.

A new option needs, besides its ``option(...)`` in config.py and its own tests, an entry in
DEEPSPEED_EXAMPLES below when it declares a DeepSpeed key. Nothing else names it: the front ends'
signatures are made from the fields ([Note: the front ends' signatures] in frontend/options.py)."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest

from zero_strategy.config import ZeroConfig

FIELDS = dataclasses.fields(ZeroConfig)
ARGUMENTS = [f for f in FIELDS if f.metadata["argument"]]


def test_every_option_has_its_doc_and_declarations():
    for f in FIELDS:  # the docs' options page reads metadata["doc"] of every field
        doc = f.metadata["doc"]
        assert isinstance(doc, str) and doc and doc == doc.strip(), f.name
        assert not any(line.startswith(" ") for line in doc.splitlines()), f"{f.name}: doc not dedented"
        keys = f.metadata["deepspeed"]
        assert isinstance(keys, tuple) and all(isinstance(k, str) and k for k in keys), f.name
        assert isinstance(f.metadata["argument"], bool), f.name
        assert f.default is not dataclasses.MISSING, f"{f.name}: every option has a default"
    # master_weights and low_precision_reduce_dtype follow the precision plugin (frontend/setup.py:
    # engine_config); low_precision_reduce_modules comes with initialize's torch_autocast: not arguments
    assert [f.name for f in FIELDS if f not in ARGUMENTS] == ["master_weights", "low_precision_reduce_modules",
                                                              "low_precision_reduce_dtype"]


# ---- the front ends' signatures ------------------------------------------------------------------


def _front_ends() -> list[type]:
    from zero_strategy import ZeroFabricStrategy, ZeroStrategy

    return [ZeroStrategy, ZeroFabricStrategy]


@pytest.mark.parametrize("index", [0, 1], ids=["ZeroStrategy", "ZeroFabricStrategy"])
def test_front_end_signature_is_the_fields(index):
    # made from the fields; what help(), LightningCLI, Hydra and the docs read
    front_end = _front_ends()[index]
    params = list(inspect.signature(front_end).parameters.values())
    missing = [f.name for f in ARGUMENTS if f.name not in {p.name for p in params}]
    assert not missing, f"{front_end.__name__} lacks {missing}: add them to its signature, as ZeroConfig has them"
    assert [p.name for p in params[:len(ARGUMENTS)]] == [f.name for f in ARGUMENTS], "ZeroConfig's order, first"
    assert not {f.name for f in FIELDS} & {p.name for p in params[len(ARGUMENTS):]}
    field_hints = typing.get_type_hints(ZeroConfig)
    for f, p in zip(ARGUMENTS, params):
        assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, f.name
        assert p.default == f.default and type(p.default) is type(f.default), (f.name, p.default, f.default)
        assert p.annotation == field_hints[f.name], (f.name, p.annotation, field_hints[f.name])
    from zero_strategy.frontend.options import FRONT_END_OPTIONS

    assert params[-len(FRONT_END_OPTIONS):] == list(FRONT_END_OPTIONS)
    assert front_end(3).config.stage == 3  # the first positional argument is the stage, as it always was
    with pytest.raises(TypeError, match="stag"):
        front_end(stag=3)


@pytest.mark.parametrize("index", [0, 1], ids=["ZeroStrategy", "ZeroFabricStrategy"])
def test_front_end_passes_every_option_on_by_name(index, monkeypatch):
    front_end = _front_ends()[index]
    given = {f.name: object() for f in ARGUMENTS}

    class Passed(Exception):
        pass

    def read_options(options):
        raise Passed({name: options[name] for name in given})

    monkeypatch.setattr(inspect.getmodule(front_end), "read_options", read_options)
    with pytest.raises(Passed) as passed:
        front_end(**given)
    assert passed.value.args[0] == given


def test_lightning_cli_sets_every_option_from_the_command_line(tmp_path, monkeypatch):
    """LightningCLI (jsonargparse) reads the signature: ``--trainer.strategy.<option>`` for any option."""
    pytest.importorskip("jsonargparse")
    monkeypatch.setattr("sys.argv", ["train.py"])  # the command line is args= below
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringModel

    cli = LightningCLI(BoringModel, run=False, save_config_kwargs={"overwrite": True}, args=[
        "--trainer.accelerator=cpu", "--trainer.devices=1", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.strategy=zero_strategy.ZeroStrategy", "--trainer.strategy.stage=3",
        "--trainer.strategy.shard_modules=[Linear]", "--trainer.strategy.offload_tile_mb=8",
        "--trainer.strategy.start_method=spawn"])
    strategy = cli.trainer.strategy
    assert (strategy.config.stage, strategy.config.shard_modules, strategy.config.offload_tile_mb) == (3, ("Linear",), 8.0)
    assert strategy._start_method == "spawn"


# ---- zero-train's strategy presets ----------------------------------------------------------------


def _composed_strategy(preset: str):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from zero_strategy.cli.configs import config_dir, register_resolvers

    register_resolvers()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(config_dir()), version_base="1.3"):
            return compose("train", overrides=[f"strategy={preset}"]).strategy
    finally:
        GlobalHydra.instance().clear()


def test_strategy_presets_list_only_what_they_change():
    pytest.importorskip("hydra")
    from omegaconf import OmegaConf

    from zero_strategy.cli.configs import config_dir, zero_defaults

    defaults = zero_defaults()
    assert defaults.pop("_target_") == "zero_strategy.ZeroStrategy"
    assert defaults == {f.name: list(f.default) if isinstance(f.default, tuple) else f.default for f in ARGUMENTS}
    names = {f.name for f in ARGUMENTS}
    presets = sorted(p.stem for p in (config_dir() / "strategy").glob("zero*.yaml"))
    assert presets == ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"]
    for preset in presets:
        own = OmegaConf.load(config_dir() / "strategy" / f"{preset}.yaml")
        parent = [d for d in own.defaults if d != "_self_"]
        assert len(parent) == 1, preset
        inherited = _composed_strategy(parent[0])
        assert names <= set(inherited), f"{parent[0]} lacks options: every preset builds on zero_defaults"
        for key in names & set(own):  # a default written again would be a second source
            assert own[key] != inherited[key], f"{preset}.yaml sets {key}={own[key]}, which it inherits anyway"


# ---- the DeepSpeed mapping ------------------------------------------------------------------------

_NVME = {"device": "nvme", "nvme_path": "/nvme"}
DEEPSPEED_EXAMPLES = {  # each declared key, set in a config that has it reach its option
    "zero_optimization.stage": {"zero_optimization": {"stage": 1}},
    "zero_optimization.reduce_bucket_size": {"zero_optimization": {"reduce_bucket_size": 1000}},
    "zero_optimization.allgather_bucket_size": {"zero_optimization": {"allgather_bucket_size": 1000}},
    "zero_optimization.stage3_param_persistence_threshold": {"zero_optimization": {
        "stage3_param_persistence_threshold": 10}},
    "zero_optimization.stage3_prefetch_bucket_size": {"zero_optimization": {"stage3_prefetch_bucket_size": 0}},
    "zero_allow_untested_optimizer": {"zero_allow_untested_optimizer": True},
    "zero_optimization.offload_optimizer.device": {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
    "zero_optimization.offload_param.device": {"zero_optimization": {"offload_param": {"device": "cpu"}}},
    "zero_optimization.offload_optimizer.nvme_path": {"zero_optimization": {"offload_optimizer": _NVME}},
    "zero_optimization.sub_group_size": {"zero_optimization": {"offload_optimizer": _NVME, "sub_group_size": 1000}},
    "zero_optimization.offload_optimizer.super_offload": {"zero_optimization": {"offload_optimizer": {
        "device": "cpu", "super_offload": True}}},
    "activation_checkpointing.cpu_checkpointing": {"activation_checkpointing": {"cpu_checkpointing": True}},
    "zero_optimization.zero_quantized_weights": {"zero_optimization": {"zero_quantized_weights": True}},
    "zero_optimization.zero_quantized_gradients": {"zero_optimization": {"zero_quantized_gradients": True}},
    "zero_optimization.zero_hpz_partition_size": {"zero_optimization": {"zero_hpz_partition_size": 2}},
    "bf16.bf16_optimizer_states": {"bf16": {"bf16_optimizer_states": True}},
    "bf16.bf16_master_weights_and_grads": {"bf16": {"bf16_master_weights_and_grads": True}},
    "zero_optimization.local_accumulation": {"zero_optimization": {"local_accumulation": True}},
    "data_types.grad_accum_dtype": {"data_types": {"grad_accum_dtype": "bf16"}},
    "zero_optimization.mics_shard_size": {"zero_optimization": {"mics_shard_size": 2}},
    "zero_optimization.leaf_module.classes": {"zero_optimization": {"leaf_module": {
        "classes": ["my_models.moe.SparseMoeLayer"]}}},
    "torch_autocast.lower_precision_safe_modules": {"bf16": {"enabled": False}, "torch_autocast": {
        "enabled": True, "lower_precision_safe_modules": ["torch.nn.modules.linear.Linear"]}},
}
FRONT_ENDS = {"torch_autocast.lower_precision_safe_modules": "initialize"}  # the one front end reading the section
_BASE = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}  # where every key above applies


def _merged(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _paths(config: dict, prefix: str = ""):
    for key, value in config.items():
        yield prefix + key
        if isinstance(value, dict):
            yield from _paths(value, f"{prefix}{key}.")


def test_every_deepspeed_key_reaches_its_option():
    from zero_strategy.deepspeed.config import map_deepspeed_config
    from zero_strategy.deepspeed.keys import MAPPED

    declared = [(key, f.name) for f in FIELDS for key in f.metadata["deepspeed"]]  # a key may set several
    keys = {key for key, _ in declared}
    without, stale = keys - DEEPSPEED_EXAMPLES.keys(), DEEPSPEED_EXAMPLES.keys() - keys
    assert not without, f"add an example to DEEPSPEED_EXAMPLES for {sorted(without)}"
    assert not stale, f"no option declares {sorted(stale)}: remove their examples"
    before = dict(map_deepspeed_config(_BASE).strategy)
    reached = set(before)
    for key, name in declared:
        section, _, leaf = key.rpartition(".")
        assert leaf in MAPPED.get(section, ()), f"{key} (declared by {name}) is not read by the mapping"
        example = DEEPSPEED_EXAMPLES[key]
        assert key in set(_paths(example)), key
        front_end = FRONT_ENDS.get(key, "ZeroStrategy")
        after = dict(map_deepspeed_config(_merged(_BASE, example), front_end=front_end).strategy)
        assert name in after and (name not in before or after[name] != before[name]), (key, name, after)
        reached |= set(after)
    # the mapping sets no option that does not declare its key
    assert reached <= {name for _, name in declared}, reached - {name for _, name in declared}


# ---- the estimator --------------------------------------------------------------------------------


def test_estimator_takes_options_by_their_names_and_defaults():
    from zero_strategy.memory import estimate_memory, estimated_options

    params = inspect.signature(estimate_memory).parameters
    taken = [f for f in FIELDS if f.name in params]
    assert {f.name for f in taken} >= {"stage", "offload_optimizer", "optimizer_state_dtype", "local_accumulation"}
    for f in taken:
        assert params[f.name].default == f.default, (f.name, params[f.name].default, f.default)
    assert set(estimated_options(ZeroConfig())) == {f.name for f in taken}


def test_zero_estimate_rows_count_the_configured_options():
    pytest.importorskip("hydra")
    from zero_strategy.cli.estimate import ROW_OPTIONS, estimate_rows
    from zero_strategy.memory import estimate_memory, estimated_options

    base = ZeroConfig(optimizer_state_dtype="int8", optimizer_state_block_size=64, local_accumulation=True,
                      grad_accum_dtype="working", async_save=True)
    options = {k: v for k, v in estimated_options(base).items() if k not in ROW_OPTIONS}
    rows = {(r["stage"], r["offload"]): r["estimate"] for r in estimate_rows(10**6, 8, "bf16-mixed", True, base)}
    assert rows[(0, "")] == estimate_memory(10**6, 0, 8, "bf16-mixed")  # DDP's row: none of them
    assert rows[(1, "")] == estimate_memory(10**6, 1, 8, "bf16-mixed", **{**options, "local_accumulation": False})
    for stage in (2, 3):
        assert rows[(stage, "")] == estimate_memory(10**6, stage, 8, "bf16-mixed", **options)
    assert rows[(3, "optimizer")] == estimate_memory(10**6, 3, 8, "bf16-mixed", offload_optimizer=True,
                                                     local_accumulation=True, grad_accum_dtype="working",
                                                     async_save=True)  # the offload presets' fp32 step
