"""DeepSpeed configs mapped onto this package (zero_strategy/deepspeed/): pure, no process group.

The schedules are checked against DeepSpeed's formulas written out independently below and, when
deepspeed is importable (``DS_BUILD_OPS=0 pip install deepspeed==0.19.8``), against its own classes
and its own batch-size arithmetic.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import types

import pytest
import torch

from zero_strategy import ZeroPrecision, ZeroStrategy
from zero_strategy.config import ZeroConfig
from zero_strategy.deepspeed import schedulers
from zero_strategy.deepspeed.config import (DEFAULT_GRADIENT_CLIPPING, DeepSpeedConfigError, check_against_trainer,
                                            load_deepspeed_config, map_deepspeed_config, resolve_batch_sizes)

MiB = 2**20
TUTORIAL = {"train_batch_size": 8, "fp16": {"enabled": True}, "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.0001}}}


@pytest.fixture(scope="module")
def deepspeed():
    return pytest.importorskip("deepspeed", reason="compare with DeepSpeed's own code where it is installed",
                               exc_type=ImportError)


# ---- loading ------------------------------------------------------------------------------------


def test_load_dict_is_a_copy_and_file_is_read(tmp_path):
    config = {"zero_optimization": {"stage": 2}}
    loaded = load_deepspeed_config(config)
    loaded["zero_optimization"]["stage"] = 3
    assert config["zero_optimization"]["stage"] == 2
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(TUTORIAL))
    assert load_deepspeed_config(path) == TUTORIAL == load_deepspeed_config(str(path))


@pytest.mark.parametrize(("text", "message"), [
    ('{"train_batch_size": 8,\n "fp16": {"enabled": true},\n}', "line 3"),  # trailing comma
    ('{"a": 1, "a": 2}', "'a' appears twice"),
    ("[1, 2]", "holds a JSON list, not an object"),
])
def test_load_refuses_damaged_files(tmp_path, text, message):
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(DeepSpeedConfigError, match=re.escape(message)):
        load_deepspeed_config(path)


def test_load_names_missing_paths_and_wrong_types(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json.*does not exist.*as a dict"):
        load_deepspeed_config(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError, match="is a folder"):
        load_deepspeed_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="looks like JSON text"):
        load_deepspeed_config('{"train_batch_size": 8}')
    with pytest.raises(TypeError, match="42.*neither a dict nor a path"):
        load_deepspeed_config(42)
    assert load_deepspeed_config({"zero_optimization": {"offload_optimizer": {"nvme_path": tmp_path}}}) == {
        "zero_optimization": {"offload_optimizer": {"nvme_path": str(tmp_path)}}}
    with pytest.raises(DeepSpeedConfigError, match="holds .*object.* which is not JSON data"):
        load_deepspeed_config({"optimizer": {"params": {"lr": object()}}})


# ---- every mapped key ---------------------------------------------------------------------------

ZERO = "zero_optimization"
MAPPED = [  # (config, the strategy kwargs it gives)
    ({}, {"stage": 0}),  # DeepSpeed's default: no ZeRO
    ({ZERO: {"stage": 1}}, {"stage": 1}),
    ({ZERO: True}, {"stage": 1}),  # DeepSpeed's oldest form
    ({ZERO: {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}},
     {"stage": 2, "offload_optimizer": True}),
    ({ZERO: {"stage": 2, "cpu_offload": True}}, {"stage": 2, "offload_optimizer": True}),
    ({ZERO: {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True}}},
     {"stage": 3, "offload_optimizer": True, "offload_overlap": True}),
    ({ZERO: {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}, "offload_param": {
        "device": "cpu"}, "sub_group_size": 1e8}},
     {"stage": 3, "offload_optimizer": True, "offload_dir": "/nvme", "offload_params": True,
      "offload_tile_mb": 1e8 * 4 / MiB}),
    ({ZERO: {"stage": 2, "offload_optimizer": {"device": "none"}}}, {"stage": 2}),
    ({ZERO: {"stage": 2, "reduce_bucket_size": 5e8}}, {"stage": 2, "bucket_cap_mb": 5e8 * 4 / MiB}),
    ({ZERO: {"stage": 2, "reduce_bucket_size": 2e8}, "bf16": {"enabled": True}},
     {"stage": 2, "bucket_cap_mb": 2e8 * 2 / MiB}),
    ({ZERO: {"stage": 1, "allgather_bucket_size": 1000000}, "fp16": {"enabled": True}},
     {"stage": 1, "bucket_cap_mb": 1e6 * 2 / MiB}),
    ({ZERO: {"stage": 2, "reduce_bucket_size": 3e6, "allgather_bucket_size": 5e8}},
     {"stage": 2, "bucket_cap_mb": 3e6 * 4 / MiB}),
    ({ZERO: {"stage": 3, "stage3_param_persistence_threshold": 1e4, "stage3_prefetch_bucket_size": 0}},
     {"stage": 3, "param_persistence_threshold": 10000, "prefetch": False}),
    ({ZERO: {"stage": 3, "param_persistence_threshold": 7, "prefetch_bucket_size": 5e7}},
     {"stage": 3, "param_persistence_threshold": 7, "prefetch": True}),
    ({ZERO: {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"}}, {"stage": 3}),
    ({ZERO: {"stage": 2}, "zero_allow_untested_optimizer": True}, {"stage": 2, "allow_untested_optimizer": True}),
    ({ZERO: {"stage": 2}, "activation_checkpointing": {"cpu_checkpointing": True, "partition_activations": True}},
     {"stage": 2, "offload_activations": True}),
]


@pytest.mark.parametrize(("config", "strategy"), MAPPED, ids=[json.dumps(c)[:70] for c, _ in MAPPED])
def test_mapping_table(config, strategy):
    settings = map_deepspeed_config(config)
    assert dict(settings.strategy) == strategy
    if strategy["stage"] > 0:  # the names are ZeroStrategy's arguments and their values pass its checks
        assert ZeroStrategy(**settings.strategy).config == ZeroConfig(**settings.strategy)


def test_the_trainer_precision_sizes_buckets_when_the_config_has_none():
    config = {ZERO: {"stage": 2, "reduce_bucket_size": 1e6}}
    assert map_deepspeed_config(config, precision="bf16-mixed").strategy["bucket_cap_mb"] == 1e6 * 2 / MiB
    assert map_deepspeed_config(config).strategy["bucket_cap_mb"] == 1e6 * 4 / MiB


@pytest.mark.parametrize(("value", "expected"), [(1.0, 1.0), (0.5, 0.5), (0, 0.0), (0.0, 0.0), ("auto", None)])
def test_gradient_clipping(value, expected):
    assert map_deepspeed_config({"gradient_clipping": value}).gradient_clipping == expected


def test_absent_gradient_clipping_clips_at_deepspeeds_default_unless_the_trainer_says():
    absent = map_deepspeed_config({})
    assert absent.gradient_clipping is None  # not given: the Trainer may decide
    assert absent.clipping() == DEFAULT_GRADIENT_CLIPPING == 1.0  # initialize(): DeepSpeed 0.19 clips at 1.0
    assert absent.clipping(trainer_value=0.3) == 0.3
    assert map_deepspeed_config({"gradient_clipping": 0}).clipping(trainer_value=0.3) == 0.0  # the config's off
    assert map_deepspeed_config({"gradient_clipping": 2.0}).clipping() == 2.0
    with pytest.raises(DeepSpeedConfigError, match=re.escape("gradient_clipping=0.0 in the DeepSpeed config, but "
                                                             "Trainer(gradient_clip_val=0.5)")):
        check_against_trainer(map_deepspeed_config({"gradient_clipping": 0}), accumulate_grad_batches=None,
                              gradient_clip_val=0.5, precision=None, micro_batch_size=None, world_size=None)


def test_other_values_and_defaults():
    settings = map_deepspeed_config({"dataloader_drop_last": True, ZERO: {"stage": 1}})
    assert settings.dataloader_drop_last is True and settings.gradient_clipping is None
    assert settings.optimizer is None and settings.scheduler is None and settings.precision is None
    with pytest.raises(AttributeError):  # frozen
        settings.precision = "bf16-mixed"  # type: ignore[misc]
    with pytest.raises(TypeError):  # and its mappings are read-only
        settings.strategy["stage"] = 3  # type: ignore[index]


def test_harmless_keys_are_listed_once_with_their_reason():
    config = {"steps_per_print": 10, "wall_clock_breakdown": False, "tensorboard": {"enabled": True},
              "prescale_gradients": False, "zero_allow_untested_optimizer": False,
              ZERO: {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "stage3_max_live_parameters": 1e9,
                     "round_robin_gradients": True, "offload_param": {"device": "cpu", "pin_memory": False}}}
    settings = map_deepspeed_config(config)
    assert set(settings.ignored) == {"steps_per_print", "wall_clock_breakdown", "tensorboard", "prescale_gradients",
                                     "zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients",
                                     "zero_optimization.stage3_max_live_parameters",
                                     "zero_optimization.round_robin_gradients"}
    line = settings.log_summary()
    assert "\n" not in line and all(f"{key} ({reason})" in line for key, reason in settings.ignored.items())
    assert "pin_memory=false" in line  # accepted, with what this package does instead
    assert map_deepspeed_config({}).log_summary() == "DeepSpeed config: every key maps onto this package."


# ---- refused keys and typos: one error naming all -----------------------------------------------

REFUSED = [
    ({"amp": {"enabled": True}}, "amp="), ({"sparse_attention": {"mode": "fixed"}}, "sparse_attention="),
    ({"pipeline": {"stages": 2}}, "pipeline="), ({"compression_training": {}}, "compression_training="),
    ({"data_efficiency": {"enabled": True}}, "data_efficiency="), ({"curriculum_learning": {}}, "curriculum_learning="),
    ({"moe": {}}, "moe="), ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel="),
    ({"sequence_parallel_size": 2}, "sequence_parallel_size=2"), ({"elasticity": {"enabled": True}}, "elasticity="),
    ({"autotuning": {"enabled": True}}, "autotuning="), ({"gradient_predivide_factor": 2.0}, "gradient_predivide_"),
    ({"communication_data_type": "fp16"}, "communication_data_type="), ({"prescale_gradients": True}, "prescale_"),
    ({"seq_parallel_communication_data_type": "bf16"}, "seq_parallel_communication_data_type="),
    ({"torch_autocast": {"enabled": True}}, "torch_autocast (enabled): ZeroStrategy takes"), ({"gradient_allreduce_op": "sum"}, "gradient_all"),
    ({ZERO: {"stage": 2, "zero_quantized_weights": True}}, "zero_quantized_weights at stage 2"),
    ({ZERO: {"stage": 1, "zero_hpz_partition_size": 8}}, "zero_hpz_partition_size=8 at stage 1"),
    ({ZERO: {"stage": 3, "zero_quantized_nontrainable_weights": True}}, "zero_quantized_nontrainable_weights=true"),
    ({ZERO: {"stage": 2, "offload_param": {"device": "cpu"}}}, "offload_param at stage 2"),
    ({ZERO: {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}}}, "offload_param.device=\"nvme\""),
    ({ZERO: {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}}, "offload_optimizer.ratio=0.3"),
    ({ZERO: {"stage": 1, "offload_optimizer": {"device": "cpu", "super_offload": True}}}, "super_offload: the host"),
    ({"fp16": {"enabled": True, "consecutive_hysteresis": True}}, "fp16.consecutive_hysteresis=true"),
    ({"bf16": {"enabled": False, "bf16_master_weights_and_grads": True}}, "bf16_master_weights_and_grads: needs"),
    ({"fp16": {"enabled": True}, "bf16": {"bf16_optimizer_states": True}}, "bf16_optimizer_states: needs"),
    ({"optimizer": {"type": "Lamb"}}, "optimizer.type='Lamb'"), ({"optimizer": {"type": "OneBitAdam"}}, "OneBitAdam"),
    ({"optimizer": {"type": "Lion"}}, "'Lion'"), ({"optimizer": {"type": "LBFGS"}}, "not elementwise"),
    ({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}, "use the top-level gradient_clipping"),
    ({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}}, "bias_correction=false"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "optimizer.params.lr='auto'"),
    ({"train_batch_size": 8, "optimizer": {"params": {"lr": 1e-3}}}, "without optimizer.type"),
]


@pytest.mark.parametrize(("config", "named"), REFUSED, ids=[n for _, n in REFUSED])
def test_refused_keys_are_named(config, named):
    with pytest.raises(DeepSpeedConfigError, match=re.escape(named)):
        map_deepspeed_config(config)


def test_disabled_sections_are_harmless():
    settings = map_deepspeed_config({"autotuning": {"enabled": False}, "hybrid_engine": {"enabled": False},
                                     "sequence_parallel_size": 1, "gradient_predivide_factor": 1.0})
    assert set(settings.ignored) == {"autotuning", "hybrid_engine", "sequence_parallel_size",
                                     "gradient_predivide_factor"}


def test_all_problems_in_one_error():
    config = {"amp": {"enabled": True}, "pipeline": {}, "zero_optimisation": {"stage": 2},
              ZERO: {"stage": 1, "offload_param": {"device": "cpu"}, "zero_quantized_weights": True}}
    with pytest.raises(DeepSpeedConfigError) as error:
        map_deepspeed_config(config)
    lines = [line for line in str(error.value).splitlines() if line.startswith("  - ")]
    assert len(lines) == 5
    for name in ("amp=", "pipeline=", "zero_optimisation", "offload_param at stage 1", "zero_quantized_weights"):
        assert name in str(error.value)


@pytest.mark.parametrize(("config", "suggested"), [
    ({"zero_optimisation": {"stage": 2}}, "'zero_optimization'"),
    ({"train_batch_sise": 8}, "'train_batch_size'"),
    ({ZERO: {"stage": 2, "reduce_bucket_sise": 5}}, "'zero_optimization.reduce_bucket_size'"),
    ({"fp16": {"enabled": True, "loss_scale_windows": 100}}, "'fp16.loss_scale_window'"),
    ({"overlap_comm": True}, "belongs at 'zero_optimization.overlap_comm'"),
    ({"optimizer": {"type": "Adam", "adam_w_mode": False}}, "belongs at 'optimizer.params.adam_w_mode'"),
    ({"optimizer": {"type": "AdamW", "params": {"bias_corection": True}}}, "'bias_correction'"),
    ({"optimizer": {"type": "SGD", "params": {"momentun": 0.9}}}, "'momentum'"),
    ({"optimizer": {"type": "AdamWW"}}, "'AdamW'"),
    ({"scheduler": {"type": "WarmupDecayLr"}}, "'WarmupDecayLR'"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 5}}}, "'warmup_num_steps'"),
])
def test_typos_suggest_the_known_key(config, suggested):
    with pytest.raises(DeepSpeedConfigError, match=re.escape(suggested)):
        map_deepspeed_config(config)


@pytest.mark.parametrize(("config", "message"), [
    ({ZERO: {"stage": 4}}, "stage=4 must be 0, 1, 2 or 3"),
    ({ZERO: {"stage": 2, "reduce_bucket_size": 0}}, "reduce_bucket_size=0 must be an integer of at least 1"),
    ({ZERO: {"stage": 2, "offload_optimizer": {"device": "gpu"}}}, "device='gpu'"),
    ({ZERO: {"stage": 2, "offload_optimizer": {"device": "nvme"}}}, "needs nvme_path"),
    ({"train_batch_size": 0}, "train_batch_size=0"), ({"gradient_clipping": -1}, "gradient_clipping=-1"),
    ({"fp16": {"enabled": True, "min_loss_scale": 0}}, "min_loss_scale=0"),
    ({"fp16": {"enabled": "yes"}}, "fp16.enabled='yes' must be true or false"),
    ({"scheduler": {"type": "WarmupDecayLR"}}, "total_num_steps: WarmupDecayLR needs it"),
])
def test_bad_values_are_named(config, message):
    with pytest.raises(DeepSpeedConfigError, match=re.escape(message)):
        map_deepspeed_config(config)


# ---- precision ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("config", "precision"), [
    ({}, None), ({"fp16": {"enabled": True}}, "16-mixed"), ({"bf16": {"enabled": True}}, "bf16-mixed"),
    ({"bfloat16": {"enabled": True}}, "bf16-mixed"), ({"fp16": {"enabled": False}}, "32-true"),
    ({"fp16": {"enabled": False}, "bf16": {"enabled": False}}, "32-true"), ({"fp16": {"enabled": "auto"}}, None),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": False}}, "16-mixed"),
])
def test_precision_names(config, precision):
    assert map_deepspeed_config(config).precision == precision


def test_fp16_loss_scaling_knobs_reach_zero_precision():
    default = map_deepspeed_config({"fp16": {"enabled": True}})
    plugin = ZeroPrecision(default.precision, **default.precision_kwargs)
    assert (plugin.scaler.scale, plugin.scaler.dynamic, plugin.scaler.window, plugin.scaler.hysteresis,
            plugin.scaler.min_scale) == (2.0**16, True, 1000, 2, 1.0)  # DeepSpeed's defaults
    knobs = {"loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 200, "hysteresis": 3,
             "min_loss_scale": 0.5}
    custom = map_deepspeed_config({"fp16": {"enabled": True, **knobs}})
    plugin = ZeroPrecision(custom.precision, **custom.precision_kwargs)
    assert (plugin.scaler.scale, plugin.scaler.window, plugin.scaler.hysteresis, plugin.scaler.min_scale) == (
        2.0**12, 200, 3, 0.5)
    static = map_deepspeed_config({"fp16": {"enabled": True, "loss_scale": 128}})
    plugin = ZeroPrecision(static.precision, **static.precision_kwargs)
    assert (plugin.scaler.scale, plugin.scaler.dynamic) == (128.0, False)
    assert map_deepspeed_config({"bf16": {"enabled": True}}).precision_kwargs == {}
    # Hugging Face's "auto": the Trainer picks the precision; the knobs apply if it picks "16-mixed"
    auto = map_deepspeed_config({"fp16": {"enabled": "auto", "loss_scale_window": 500}})
    assert (auto.precision, auto.precision_kwargs["loss_scale_window"]) == (None, 500)
    disabled = map_deepspeed_config({"fp16": {"enabled": False, "hysteresis": 4}})
    assert disabled.precision_kwargs == {} and disabled.ignored == {"fp16.hysteresis": "fp16 is not enabled"}


def test_fp16_and_bf16_both_enabled_is_an_error():
    with pytest.raises(DeepSpeedConfigError, match="fp16.enabled and bf16.enabled are both true"):
        map_deepspeed_config({"fp16": {"enabled": True}, "bf16": {"enabled": True}})


# ---- batch sizes --------------------------------------------------------------------------------

BATCHES = [  # (train_batch_size, micro, accumulation, world_size) -> all three, as DeepSpeed derives them
    ((32, 4, 2, 4), (32, 4, 2)), ((32, 4, None, 4), (32, 4, 2)), ((32, None, 2, 4), (32, 4, 2)),
    ((None, 4, 2, 4), (32, 4, 2)), ((32, None, None, 4), (32, 8, 1)), ((None, 4, None, 4), (16, 4, 1)),
    ((8, None, None, 2), (8, 4, 1)), ((6, 1, None, 2), (6, 1, 3)),
]


@pytest.mark.parametrize(("given", "resolved"), BATCHES)
def test_batch_arithmetic(given, resolved):
    assert resolve_batch_sizes(*given) == resolved
    config = {key: value for key, value in zip(("train_batch_size", "train_micro_batch_size_per_gpu",
                                                "gradient_accumulation_steps"), given) if value is not None}
    settings = map_deepspeed_config(config, world_size=given[3])
    assert (settings.train_batch_size, settings.train_micro_batch_size_per_gpu,
            settings.gradient_accumulation_steps, settings.world_size) == (*resolved, given[3])


@pytest.mark.parametrize("given", [(32, 4, 2, 2), (10, 3, None, 1), (8, None, None, 3), (4, 8, None, 1)])
def test_inconsistent_batch_sizes_name_all_numbers(given):
    with pytest.raises(DeepSpeedConfigError, match=rf"train_batch_size={given[0]} must equal .*world_size={given[3]}"):
        resolve_batch_sizes(*given)


def test_batch_sizes_stay_as_given_without_world_size_or_batch_size():
    assert resolve_batch_sizes(32, None, 2, None) == (32, None, 2)
    assert resolve_batch_sizes(None, None, 4, 8) == (None, None, 4)  # the DataLoader decides the batch size
    settings = map_deepspeed_config({"train_batch_size": "auto", "gradient_accumulation_steps": 2}, world_size=2)
    assert (settings.train_batch_size, settings.gradient_accumulation_steps) == (None, 2)


@pytest.mark.parametrize("world_size", (1, 2, 4))
def test_batch_arithmetic_matches_deepspeed(deepspeed, monkeypatch, world_size):
    from deepspeed.runtime import config as ds_config
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)  # its world size without a process group
    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *a, **k: world_size)
    for (train, micro, steps, _), _ in BATCHES:
        given = {key: value for key, value in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro),
                                               ("gradient_accumulation_steps", steps)) if value is not None}
        try:
            theirs = ds_config.DeepSpeedConfig(dict(given))
        except AssertionError:  # DeepSpeed refuses it at this world size: so do we
            with pytest.raises(DeepSpeedConfigError):
                resolve_batch_sizes(train, micro, steps, world_size)
            continue
        assert resolve_batch_sizes(train, micro, steps, world_size) == (
            theirs.train_batch_size, theirs.train_micro_batch_size_per_gpu, theirs.gradient_accumulation_steps)


# ---- the optimizer ------------------------------------------------------------------------------

OPTIMIZERS = [  # (optimizer section, torch class, hyperparameters of its param group)
    ({"type": "AdamW", "params": {"lr": 1e-4}}, torch.optim.AdamW, {"lr": 1e-4, "weight_decay": 0.0}),
    ({"type": "Adam", "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}},
     torch.optim.AdamW, {"lr": 3e-4, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}),
    ({"type": "adam", "params": {"adam_w_mode": False, "weight_decay": 0.1, "bias_correction": True}},
     torch.optim.Adam, {"lr": 1e-3, "weight_decay": 0.1}),
    ({"type": "AdamW", "params": {"torch_adam": True, "lr": 2e-4}}, torch.optim.AdamW,
     {"lr": 2e-4, "weight_decay": 0.01}),  # torch's own AdamW, with torch's default decay
    ({"type": "AdamW", "params": {"adam_w_mode": False, "amsgrad": True}}, torch.optim.AdamW, {"amsgrad": True}),
    ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}}, torch.optim.SGD,
     {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    ({"type": "Adagrad", "params": {"lr": 0.05}}, torch.optim.Adagrad, {"lr": 0.05}),
    ({"type": "RMSprop", "params": {"lr": 0.01, "alpha": 0.9}}, torch.optim.RMSprop, {"lr": 0.01, "alpha": 0.9}),
    ({"type": "Adamax"}, torch.optim.Adamax, {}), ({"type": "NAdam"}, torch.optim.NAdam, {}),
]


@pytest.mark.parametrize(("section", "cls", "hyper"), OPTIMIZERS, ids=[json.dumps(s)[:60] for s, _, _ in OPTIMIZERS])
def test_optimizer_factory_builds_the_torch_optimizer(section, cls, hyper):
    settings = map_deepspeed_config({"optimizer": section})
    model = torch.nn.Linear(3, 2)
    optimizer = settings.optimizer(model.parameters())
    assert type(optimizer) is cls
    group = optimizer.param_groups[0]
    assert {key: group[key] for key in hyper} == hyper
    assert len(group["params"]) == 2


TORCH_ADAM = [  # sections DeepSpeed builds with torch's own classes (no compiled op): compare with its choice
    {"type": "Adam", "params": {"torch_adam": True, "lr": 3e-4, "betas": [0.8, 0.95], "weight_decay": 0.1}},
    {"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False, "eps": 1e-6}},
    {"type": "AdamW", "params": {"torch_adam": True, "adam_w_mode": False}},
    {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, {"type": "Adagrad", "params": {"lr": 0.05}},
    {"type": "RMSprop", "params": {"lr": 0.01, "alpha": 0.9}},
]


@pytest.mark.parametrize("section", TORCH_ADAM, ids=[json.dumps(s)[:60] for s in TORCH_ADAM])
def test_optimizer_equals_deepspeeds_choice(deepspeed, section):
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    from deepspeed.runtime.engine import DeepSpeedEngine
    name = section["type"].lower() if section["type"].lower() in DEEPSPEED_OPTIMIZERS else section["type"]
    engine = types.SimpleNamespace(  # what DeepSpeedEngine's optimizer choice reads of itself
        optimizer_name=lambda: name, optimizer_params=lambda: json.loads(json.dumps(section["params"])),
        zero_use_cpu_optimizer=lambda: False, has_moe_layers=False)
    engine.get_optimizer_configuration = lambda *args, **kwargs: DeepSpeedEngine.get_optimizer_configuration(
        engine, *args, **kwargs)
    theirs = DeepSpeedEngine._configure_basic_optimizer(engine, torch.nn.Linear(3, 2).parameters())
    ours = map_deepspeed_config({"optimizer": section}).optimizer(torch.nn.Linear(3, 2).parameters())
    assert type(ours) is type(theirs)
    assert ({k: v for k, v in ours.param_groups[0].items() if k != "params"} ==
            {k: v for k, v in theirs.param_groups[0].items() if k != "params"})


def test_adam_names_say_which_class_runs():
    adam = map_deepspeed_config({"optimizer": {"type": "Adam"}})
    assert adam.optimizer.optimizer_class is torch.optim.AdamW and "adam_w_mode defaults to true" in adam.log_summary()
    foreach = map_deepspeed_config({"optimizer": {"type": "Adam", "params": {"torch_adam": True, "foreach": False}}})
    assert "foreach" not in foreach.optimizer.kwargs and "optimizer.params.foreach" in foreach.ignored


# ---- the schedules: DeepSpeed's formulas, written out independently -----------------------------


def warmup_gamma(i, steps, kind):
    steps = max(2, steps)
    return 1.0 if i >= steps else (math.log(i + 1) / math.log(steps) if kind == "log" else i / steps)


def expected_warmup(i, lo, hi, steps, kind):
    return lo if i < 0 else lo + (hi - lo) * warmup_gamma(i, steps, kind)


def expected_warmup_decay(i, lo, hi, steps, total, kind):
    if i < 0 or i < max(2, steps):
        return expected_warmup(i, lo, hi, steps, kind)
    return lo + (hi - lo) * max(0.0, (total - i) / max(1, total - max(2, steps)))


def expected_cosine(i, base, steps, total, min_ratio, cos_min, kind):
    if i < 0:
        return 0.0
    if i < max(2, steps):
        return base * (min_ratio + (1 - min_ratio) * warmup_gamma(i, steps, kind))
    progress = min(1.0, (i - max(2, steps) + 1) / max(1, total - max(2, steps)))
    return base * max(0.0, cos_min + (1 - cos_min) * 0.5 * (1 + math.cos(math.pi * progress)))


def one_cycle_scale(i, first, second, stairs=0):
    position = i + 1  # DeepSpeed's iteration i has moved i + 1 steps along the triangle
    rising = position <= first
    fraction = position / first if rising else (first + second - position) / second
    return math.floor(fraction * stairs) / stairs if stairs else fraction


def expected_one_cycle(i, lo, hi, first, second, decay_rate=0.0, decay_step=0, stairs=0):
    if i < first + second:
        return lo + (hi - lo) * one_cycle_scale(i, first, second, stairs)
    return lo if not decay_rate or not decay_step else lo / (1 + decay_rate * (i - first - second + 1) / decay_step)


SCHEDULES = [  # (scheduler section, the lr DeepSpeed gives at its iteration i, for an optimizer at lr 0.1)
    ({"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.5, "warmup_num_steps": 5}},
     lambda i: expected_warmup(i, 0.01, 0.5, 5, "log")),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear"}},
     lambda i: expected_warmup(i, 0.0, 0.1, 4, "linear")),  # warmup_max_lr: the optimizer's lr
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 1}}, lambda i: expected_warmup(i, 0.0, 0.1, 1, "log")),
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": 12, "warmup_num_steps": 4}},
     lambda i: expected_warmup_decay(i, 0.0, 0.001, 4, 12, "log")),  # its own default warmup_max_lr
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_min_lr": 1e-3, "warmup_max_lr": 0.2,
                                          "warmup_num_steps": 3, "warmup_type": "linear"}},
     lambda i: expected_warmup_decay(i, 1e-3, 0.2, 3, 10, "linear")),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 12, "warmup_num_steps": 4}},
     lambda i: expected_cosine(i, 0.1, 4, 12, 0.0, 0.0001, "log")),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "warmup_num_steps": 3, "warmup_min_ratio": 0.1,
                                           "cos_min_ratio": 0.05, "warmup_type": "linear"}},
     lambda i: expected_cosine(i, 0.1, 3, 9, 0.1, 0.05, "linear")),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4}},
     lambda i: expected_one_cycle(i, 0.01, 0.1, 4, 4)),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 3,
                                     "cycle_second_step_size": 5, "decay_lr_rate": 0.5, "decay_step_size": 2}},
     lambda i: expected_one_cycle(i, 0.01, 0.1, 3, 5, 0.5, 2)),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.0, "cycle_max_lr": 0.1, "cycle_first_step_size": 6,
                                     "cycle_first_stair_count": 3}},
     lambda i: expected_one_cycle(i, 0.0, 0.1, 6, 6, stairs=3)),
    ({"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 3,
                                        "lr_range_test_step_rate": 2.0}}, lambda i: 0.01 * (1 + 2.0 * (i + 1) / 3)),
    ({"type": "LRRangeTest", "params": {"lr_range_test_step_size": 3, "lr_range_test_staircase": True}},
     lambda i: 1e-3 * (1 + math.floor((i + 1) / 3))),
]
STEPS = 20


def learning_rates(optimizer, scheduler, steps=STEPS):
    """The lr each optimizer step runs with, the scheduler stepped after each, as DeepSpeed's engine does."""
    used = []
    for _ in range(steps):
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return used


def fresh_optimizer(cls=torch.optim.AdamW):
    return cls([torch.nn.Parameter(torch.zeros(2))], lr=0.1)


@pytest.mark.parametrize(("section", "formula"), SCHEDULES, ids=[json.dumps(s)[:70] for s, _ in SCHEDULES])
def test_schedules_follow_deepspeeds_formulas(section, formula):
    settings = map_deepspeed_config({"scheduler": section})
    optimizer = fresh_optimizer()
    scheduler = settings.scheduler(optimizer)
    # see [Note: DeepSpeed's iteration count]: optimizer step n (from 0) runs at DeepSpeed's iteration n - 1
    assert learning_rates(optimizer, scheduler) == pytest.approx([formula(n - 1) for n in range(STEPS)], rel=1e-12)
    assert scheduler.get_last_lr() == [optimizer.param_groups[0]["lr"]]


@pytest.mark.parametrize(("section", "formula"), SCHEDULES, ids=[json.dumps(s)[:70] for s, _ in SCHEDULES])
def test_schedules_equal_deepspeeds_own(deepspeed, section, formula):
    from deepspeed.runtime import lr_schedules
    ours_optimizer, theirs_optimizer = fresh_optimizer(), fresh_optimizer()
    ours = map_deepspeed_config({"scheduler": section}).scheduler(ours_optimizer)
    theirs = getattr(lr_schedules, section["type"])(theirs_optimizer, **section["params"])
    assert learning_rates(ours_optimizer, ours) == learning_rates(theirs_optimizer, theirs)
    assert ours_optimizer.param_groups[0]["betas"] == theirs_optimizer.param_groups[0]["betas"]


@pytest.mark.parametrize("name", sorted(schedulers.SCHEDULERS))
def test_schedulers_take_deepspeeds_arguments_and_defaults(deepspeed, name):
    from deepspeed.runtime import lr_schedules

    def arguments(cls, resume):
        return {key: p.default for key, p in inspect.signature(cls).parameters.items()
                if key not in ("self", "optimizer", resume)}

    theirs = getattr(lr_schedules, name)
    assert arguments(schedulers.SCHEDULERS[name], "last_epoch") == arguments(theirs, "last_batch_iteration")


def test_deepspeed_defaults_the_mapping_relies_on(deepspeed):
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.runtime.config import ADAM_W_MODE_DEFAULT, get_gradient_clipping
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    assert ADAM_W_MODE_DEFAULT is True  # "Adam" means AdamW
    assert get_gradient_clipping({}) == DEFAULT_GRADIENT_CLIPPING  # a config without the key clips
    for own_adam in (FusedAdam, DeepSpeedCPUAdam):  # weight_decay 0 unless torch_adam
        assert inspect.signature(own_adam).parameters["weight_decay"].default == 0
    fp16 = DeepSpeedFP16Config(enabled=True)
    assert map_deepspeed_config({"fp16": {"enabled": True}}).precision_kwargs == {
        "loss_scale": fp16.loss_scale, "initial_scale_power": fp16.initial_scale_power,
        "loss_scale_window": fp16.loss_scale_window, "hysteresis": fp16.hysteresis,
        "min_loss_scale": fp16.min_loss_scale}
    zero = DeepSpeedZeroConfig()
    assert (zero.stage, zero.param_persistence_threshold) == (0, ZeroConfig().param_persistence_threshold)
    assert map_deepspeed_config({}).strategy["stage"] == zero.stage


def test_one_cycle_moves_beta1_and_sets_beta2():
    params = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4, "cycle_min_mom": 0.85,
              "cycle_max_mom": 0.95}
    settings = map_deepspeed_config({"optimizer": {"type": "AdamW"},
                                     "scheduler": {"type": "OneCycle", "params": params}})
    assert "sets beta2 to 0.99" in settings.log_summary()
    optimizer = fresh_optimizer()
    scheduler = settings.scheduler(optimizer)
    betas = []
    for _ in range(10):
        betas.append(optimizer.param_groups[0]["betas"])
        optimizer.step()
        scheduler.step()
    # beta1 starts at cycle_min_mom, then mirrors the lr's triangle and stays at cycle_max_mom after the cycle
    expected = [0.85] + [0.95 - 0.1 * one_cycle_scale(n - 1, 4, 4) if n - 1 < 8 else 0.95 for n in range(1, 10)]
    assert [b[1] for b in betas] == [0.99] * 10
    assert [b[0] for b in betas] == pytest.approx(expected, rel=1e-12)
    sgd = fresh_optimizer(torch.optim.SGD)  # no betas: DeepSpeed leaves the momentum alone
    one_cycle = settings.scheduler(sgd)
    sgd.step()
    one_cycle.step()
    assert "betas" not in sgd.param_groups[0]


def test_schedules_resume_from_their_state_dict():
    section = {"type": "WarmupDecayLR", "params": {"total_num_steps": 12, "warmup_num_steps": 4}}
    factory = map_deepspeed_config({"scheduler": section}).scheduler
    optimizer = fresh_optimizer()
    scheduler = factory(optimizer)
    first = learning_rates(optimizer, scheduler, 5)
    resumed_optimizer = fresh_optimizer()  # built, then restored, in the order Lightning does it
    resumed = factory(resumed_optimizer)
    resumed_optimizer.load_state_dict(optimizer.state_dict())
    resumed.load_state_dict(scheduler.state_dict())
    uninterrupted = fresh_optimizer()
    whole = learning_rates(uninterrupted, factory(uninterrupted), 10)
    assert first + learning_rates(resumed_optimizer, resumed, 5) == whole


def test_torch_schedulers_by_name_and_bad_arguments():
    settings = map_deepspeed_config({"scheduler": {"type": "StepLR", "params": {"step_size": 2, "gamma": 0.5}}})
    optimizer = fresh_optimizer()
    assert learning_rates(optimizer, settings.scheduler(optimizer), 6) == pytest.approx(
        [0.1, 0.1, 0.05, 0.05, 0.025, 0.025], rel=1e-12)
    with pytest.raises(ValueError, match="warmup_type='cosine' is not one of"):
        map_deepspeed_config({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}}
                             ).scheduler(fresh_optimizer())
    with pytest.raises(ValueError, match=r"cycle_min_lr=\[0.1, 0.2\] has 2 values but the optimizer has 1"):
        schedulers.OneCycle(fresh_optimizer(), cycle_min_lr=[0.1, 0.2], cycle_max_lr=0.3)
    with pytest.raises(DeepSpeedConfigError, match="scheduler.params.total_num_steps='auto'"):
        map_deepspeed_config({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto"}}})


# ---- the config against the Trainer -------------------------------------------------------------

AGREE = dict(accumulate_grad_batches=2, gradient_clip_val=1.0, precision="16-mixed", micro_batch_size=4, world_size=2)


def test_agreeing_and_one_sided_values_pass():
    config = {"train_batch_size": 16, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
              "fp16": {"enabled": True}}
    settings = map_deepspeed_config(config)
    check_against_trainer(settings, **AGREE)
    check_against_trainer(settings, **{**AGREE, "precision": 16})  # the short spelling of the same precision
    # the Trainer's defaults (no accumulation, no clipping, fp32) count as not given: the config's values win
    check_against_trainer(settings, accumulate_grad_batches=1, gradient_clip_val=None, precision="32-true",
                          micro_batch_size=None, world_size=2)
    check_against_trainer(map_deepspeed_config({}), **AGREE)  # nothing in the config


@pytest.mark.parametrize(("change", "named"), [
    ({"accumulate_grad_batches": 4}, "gradient_accumulation_steps=2 in the DeepSpeed config, but Trainer("
                                     "accumulate_grad_batches=4)"),
    ({"gradient_clip_val": 0.5}, "gradient_clipping=1.0 in the DeepSpeed config, but Trainer(gradient_clip_val=0.5)"),
    ({"precision": "bf16-mixed"}, "precision '16-mixed' from the DeepSpeed config's fp16/bf16 sections, but "
                                  "Trainer(precision='bf16-mixed')"),
    ({"micro_batch_size": 8}, "train_micro_batch_size_per_gpu=4 in the DeepSpeed config, but the training "
                              "DataLoader's batch_size=8"),
])
def test_conflicts_name_both_values(change, named):
    config = {"train_batch_size": 16, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
              "fp16": {"enabled": True}}
    with pytest.raises(DeepSpeedConfigError, match=re.escape(named)):
        check_against_trainer(map_deepspeed_config(config), **{**AGREE, **change})


def test_all_conflicts_in_one_error_and_world_size_checked():
    settings = map_deepspeed_config({"train_batch_size": 16, "gradient_accumulation_steps": 2,
                                     "gradient_clipping": 1.0, "bf16": {"enabled": True}})
    with pytest.raises(DeepSpeedConfigError) as error:
        check_against_trainer(settings, accumulate_grad_batches=3, gradient_clip_val=2.0, precision="16-mixed",
                              micro_batch_size=2, world_size=2)
    assert str(error.value).count("\n  - ") == 4
    with pytest.raises(DeepSpeedConfigError, match="world_size=3"):  # 16 is not 2 * n * 3
        check_against_trainer(settings, **{**AGREE, "precision": None, "world_size": 3})


def test_the_example_config_is_the_tutorials(tmp_path):
    from pathlib import Path
    example = Path(__file__).resolve().parents[1] / "examples" / "deepspeed_config" / "ds_config.json"
    assert load_deepspeed_config(example) == TUTORIAL
    settings = map_deepspeed_config(example, world_size=2)
    assert (dict(settings.strategy), settings.precision, settings.train_micro_batch_size_per_gpu) == (
        {"stage": 2}, "16-mixed", 4)
    assert settings.optimizer.optimizer_class is torch.optim.AdamW and settings.optimizer.kwargs["lr"] == 1e-4


def test_torch_autocast_section_is_read_for_initialize_only():
    section = {"enabled": True, "dtype": "bf16", "lower_precision_safe_modules": ["torch.nn.modules.linear.Linear"]}
    settings = map_deepspeed_config({"torch_autocast": section}, front_end="initialize")
    assert settings.autocast.dtype == torch.bfloat16 and settings.precision is None
    assert settings.autocast.lower_precision_safe_modules == ("torch.nn.modules.linear.Linear",)
    assert settings.strategy["low_precision_reduce_modules"] == (torch.nn.Linear,)  # reduced in bf16, the rest fp32
    assert "the gradients of Linear parameters are reduced in the autocast dtype" in settings.log_summary()
    default = map_deepspeed_config({"torch_autocast": {"enabled": True}}, front_end="initialize")
    assert default.autocast.dtype is None and default.strategy["low_precision_reduce_modules"] == (
        torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)  # DeepSpeed's default list
    none = map_deepspeed_config({"torch_autocast": {**section, "lower_precision_safe_modules": []}},
                                front_end="initialize")
    assert "low_precision_reduce_modules" not in none.strategy  # every gradient in fp32
    off = map_deepspeed_config({"torch_autocast": {"enabled": False, "dtype": "fp16"}})
    assert off.autocast is None and off.ignored["torch_autocast"] == "disabled"
    bad = {"torch_autocast": {"enabled": True, "dtype": "fp32", "lower_precision_safe_modules": ["torch.nn.Nope"]}}
    with pytest.raises(DeepSpeedConfigError) as refused:
        map_deepspeed_config(bad, front_end="initialize")
    for fragment in ("torch_autocast.dtype='fp32'", "'torch.nn.Nope' does not import"):
        assert fragment in str(refused.value)


# DeepSpeedExamples' training/bf16_master_weight/configs/bf16_full.json, as its README gives it (the batch
# and optimizer keys, which the README leaves out, as tests/test_deepspeed_scripts.py runs it)
BF16_FULL = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
             "zero_optimization": {"stage": 3}, "torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"}}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_with_torch_autocast_is_bf16_weights_under_autocast(stage):
    from zero_strategy.deepspeed.autocast import autocast_kwargs

    config = {**BF16_FULL, "zero_optimization": {"stage": stage}}
    settings = map_deepspeed_config(config, front_end="initialize")
    assert settings.precision == "bf16-mixed" and settings.autocast.dtype == torch.bfloat16
    assert dict(settings.strategy) == {"stage": stage, "master_weights_dtype": "bf16", "optimizer_state_dtype": "bf16",
                                       "optimizer_state_min_numel": 0}  # every state in bf16, as DeepSpeed keeps them
    assert "every gradient is bf16 already" in settings.log_summary()  # so lower_precision_safe_modules: no effect
    assert autocast_kwargs(settings.autocast, torch.device("cpu"), settings.precision) == {
        "autocast_dtype": torch.bfloat16}
    fp32_masters = map_deepspeed_config({**config, "bf16": {"enabled": True}}, front_end="initialize")
    assert dict(fp32_masters.strategy) == {"stage": stage} and fp32_masters.precision == "bf16-mixed"


def test_low_precision_forwards_over_other_weights_are_refused_naming_the_keys():
    from zero_strategy.deepspeed.autocast import autocast_kwargs

    with pytest.raises(DeepSpeedConfigError, match=r"torch_autocast with fp16.enabled: .*Type fp16 is not supported"):
        map_deepspeed_config({**BF16_FULL, "bf16": {"enabled": False}, "fp16": {"enabled": True}},
                             front_end="initialize")
    with pytest.raises(DeepSpeedConfigError, match=r"torch_autocast.dtype='fp16' with bf16.enabled: an fp16 forward"):
        map_deepspeed_config({**BF16_FULL, "torch_autocast": {"enabled": True, "dtype": "fp16"}},
                             front_end="initialize")
    no_dtype = map_deepspeed_config({**BF16_FULL, "torch_autocast": {"enabled": True}}, front_end="initialize")
    assert autocast_kwargs(no_dtype.autocast, torch.device("cpu"), "bf16-mixed") == {"autocast_dtype": torch.bfloat16}
    with pytest.raises(DeepSpeedConfigError, match=r"no dtype, which on cuda is torch's default, torch.float16: .*set "
                                                   r"torch_autocast.dtype to \"bfloat16\""):
        autocast_kwargs(no_dtype.autocast, torch.device("cuda"), "bf16-mixed")
    with pytest.raises(DeepSpeedConfigError, match=r"torch_autocast \(enabled\): ZeroStrategy takes its precision"):
        map_deepspeed_config(BF16_FULL)


def test_every_key_of_deepspeeds_schema_is_accounted_for(deepspeed):
    """Each key DeepSpeed 0.19's config knows maps, is harmless with its reason, or is refused with what
    to use instead (none falls through to "unknown key"): the fields (and aliases) of its pydantic
    sections, the activation checkpointing keys, and every key runtime/config.py reads by name."""
    import deepspeed.runtime.activation_checkpointing.config as act
    import deepspeed.runtime.config as ds_config
    import deepspeed.runtime.constants as constants
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig

    from zero_strategy.deepspeed.keys import MAPPED, RULES, ZERO_ALIASES

    def known(section: str) -> set[str]:
        return set(MAPPED.get(section, ())) | {path.rpartition(".")[2] for path in RULES
                                               if path.rpartition(".")[0] == section}

    def fields(model) -> set[str]:
        return {name for field_name, f in model.model_fields.items() for name in (field_name, f.alias) if name}

    normalised = {"cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory", *ZERO_ALIASES}  # read as others
    sections = {"zero_optimization": fields(DeepSpeedZeroConfig) - normalised,
                "zero_optimization.offload_param": fields(DeepSpeedZeroOffloadParamConfig),
                "zero_optimization.offload_optimizer": fields(DeepSpeedZeroOffloadOptimizerConfig),
                "fp16": fields(DeepSpeedFP16Config), "bf16": fields(DeepSpeedBF16Config),
                "activation_checkpointing": {value for name, value in vars(act).items() if name.startswith("ACT_CHKPT_")
                                             and isinstance(value, str) and not name.endswith(("_DEFAULT", "_FORMAT"))
                                             and value != "activation_checkpointing"}}
    missing = {section: sorted(keys - known(section)) for section, keys in sections.items() if keys - known(section)}
    source = inspect.getsource(ds_config)
    names = set()
    for pattern in (r"get_scalar_param\(\s*param_dict\s*,\s*([A-Z_0-9]+)", r"param_dict\.get\(\s*([A-Z_0-9]+)",
                    r"([A-Z_0-9]+) in param_dict", r"param_dict\[\s*([A-Z_0-9]+)\s*\]"):
        names |= set(re.findall(pattern, source))
    values = {**vars(constants), **vars(ds_config)}
    read_by_name = {values[n] for n in names if isinstance(values.get(n), str)}
    read_by_name |= set(re.findall(r"param_dict\.get\(\s*[\"']([a-z_0-9]+)[\"']", source))
    anywhere = set().union(*(known(section) for section in {*MAPPED, *(p.rpartition(".")[0] for p in RULES)}))
    assert len(read_by_name) >= 30  # the scan found DeepSpeed's keys (35 in 0.19.8)
    unaccounted = sorted(read_by_name - anywhere - {"bfloat16"})  # bfloat16: bf16's old name, normalised
    assert not missing and not unaccounted, (missing, unaccounted)
