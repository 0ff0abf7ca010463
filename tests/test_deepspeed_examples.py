"""The ZeRO configs DeepSpeedExamples ships, through the DeepSpeed door: each one DeepSpeed 0.19 runs
on a CPU maps here (``initialize``'s reading, at 2 ranks), and each one refused is refused naming a key
that DeepSpeed itself cannot run on a CPU, or that DeepSpeed refuses too. Pure: no process group.

The configs are written out below with the keys and values of the example named beside each (a config
a script builds, such as DeepSpeed-Chat's ``get_train_ds_config``, as it builds it). Where DeepSpeed
is installed its own reader is asked the same question: it reads each config this package maps
(those with fp16 run on GPUs only: DeepSpeed's CPU accelerator refuses fp16 without AVX512-FP16), and
refuses the one this package refuses for a key DeepSpeed does not know either. The bf16_full config
also trains, against DeepSpeed's losses, in tests/test_deepspeed_scripts.py.
"""

from __future__ import annotations

import pytest

from zero_strategy.deepspeed.config import DeepSpeedConfigError, map_deepspeed_config


def _chat(offload: bool, dtype: str, stage: int, mixed_precision_lora: bool = False) -> dict:
    """applications/DeepSpeed-Chat/dschat/utils/ds_utils.py: get_train_ds_config (bf16 as "bfloat16")."""
    device = "cpu" if offload else "none"
    zero = {"stage": stage, "overlap_comm": True, "offload_param": {"device": device},
            "offload_optimizer": {"device": device}, "stage3_param_persistence_threshold": 1e4,
            "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7, "memory_efficient_linear": False}
    if mixed_precision_lora:
        zero["zero_quantized_nontrainable_weights"] = True
    precision = {"fp16": {"enabled": True, "loss_scale_window": 100}} if dtype == "fp16" else {
        "bfloat16": {"enabled": True}}
    return {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
            "zero_optimization": zero, **precision, "gradient_clipping": 1.0, "prescale_gradients": False,
            "wall_clock_breakdown": False,
            "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                              "release_inference_cache": False, "pin_parameters": True, "tp_gather_partition_size": 8},
            "tensorboard": {"enabled": False, "output_path": "/ds_tensorboard_logs/", "job_name": "_tensorboard"}}


_BF16_TRAIN = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
"""training/bf16_master_weight's README gives its configs' precision and ZeRO sections; train.py's
defaults (--batch_size 4, --learning_rate 1e-4) the rest."""

MAPPED = {  # name: (config, the precision and the ZeroConfig settings it maps to)
    "bf16_master_weight/baseline": ({**_BF16_TRAIN, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}},
                                    "bf16-mixed", {"stage": 3}),
    "bf16_master_weight/bf16_full": (
        {**_BF16_TRAIN, "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
         "zero_optimization": {"stage": 3}, "torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"}},
        "bf16-mixed", {"stage": 3, "master_weights_dtype": "bf16", "optimizer_state_dtype": "bf16",
                       "optimizer_state_min_numel": 0}),
    "alpaca-lora-zero3/ds_config": (
        {"fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 8,
                  "hysteresis": 2, "min_loss_scale": 1},
         "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
         "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False,
                               "offload_optimizer": {"device": "cpu", "pin_memory": True},
                               "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": False,
                               "contiguous_gradients": True, "sub_group_size": 1e8, "stage3_max_live_parameters": 2e8,
                               "stage3_max_reuse_distance": 2e8, "stage3_prefetch_bucket_size": 1e8,
                               "stage3_param_persistence_threshold": 1e5, "reduce_bucket_size": 1e7},
         "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                      "contiguous_memory_optimization": False, "number_checkpoints": None,
                                      "synchronize_checkpoint_boundary": False, "profile": True},
         "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
         "steps_per_print": 2000000},
        "16-mixed", {"stage": 3, "offload_optimizer": True, "offload_params": True,
                     "param_persistence_threshold": 100000}),
    "Megatron-LM-v1.1.5-ZeRO3/examples/ds_zero_stage_3_config": (
        {"train_batch_size": 64, "gradient_accumulation_steps": 1, "steps_per_print": 1,
         "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                               "stage3_prefetch_bucket_size": 1e7, "stage3_param_persistence_threshold": 1e5,
                               "reduce_bucket_size": 1e7, "contiguous_gradients": True},
         "gradient_clipping": 1.0, "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000,
                                            "hysteresis": 2, "min_loss_scale": 1},
         "wall_clock_breakdown": True, "zero_allow_untested_optimizer": False},
        "16-mixed", {"stage": 3, "param_persistence_threshold": 100000}),
    "imagenet/config/ds_fp16_z1_config": (
        {"train_batch_size": 256, "gradient_accumulation_steps": 1, "steps_per_print": 50,
         "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                  "weight_decay": 3e-7}},
         "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
         "fp16": {"enabled": True, "auto_cast": True}, "gradient_clipping": 0, "prescale_gradients": False,
         "cuda_visible_devices": 0, "wall_clock_breakdown": False},
        "16-mixed", {"stage": 1, "allow_untested_optimizer": True}),
    "DeepSpeed-Chat bf16 stage 2": (_chat(False, "bf16", 2), "bf16-mixed", {"stage": 2}),
    "DeepSpeed-Chat bf16 stage 3": (_chat(False, "bf16", 3), "bf16-mixed", {"stage": 3}),
    "DeepSpeed-Chat fp16 offload stage 3": (_chat(True, "fp16", 3), "16-mixed", {
        "stage": 3, "offload_optimizer": True, "offload_params": True}),
}

REFUSED = {  # name: (config, the key named, why: DeepSpeed cannot run it on a CPU, or refuses it too)
    "DeepSpeed-Chat --enable_mixed_precision_lora": (
        _chat(False, "bf16", 3, mixed_precision_lora=True), "zero_optimization.zero_quantized_nontrainable_weights",
        "CUDAQuantizer"),
    "cifar/ds_config": (
        {"train_batch_size": 16, "steps_per_print": 250,
         "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                  "weight_decay": 3e-7}},
         "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                      "warmup_num_steps": 1000}},
         "gradient_clipping": 1.0, "prescale_gradients": False,
         "bf16": {"enabled": True, "bf16_master_weights_and_grads": False, "loss_scale": 0, "loss_scale_window": 500,
                  "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
         "fp16": {"enabled": False, "fp16_master_weights_and_grads": False, "loss_scale": 0,
                  "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
         "wall_clock_breakdown": False,
         "zero_optimization": {"stage": 0, "allgather_partitions": True, "reduce_scatter": True,
                               "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000, "overlap_comm": True,
                               "contiguous_gradients": True, "cpu_offload": False}},
        "bf16.loss_scale", "unknown key (it belongs at 'fp16.loss_scale')"),
}


@pytest.mark.parametrize("name", sorted(MAPPED))
def test_each_example_config_maps(name):
    config, precision, expected = MAPPED[name]
    settings = map_deepspeed_config(config, world_size=2, front_end="initialize")
    assert settings.precision == precision
    assert {k: v for k, v in settings.strategy.items() if k in expected} == expected, dict(settings.strategy)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_each_refused_example_config_names_the_key_and_why(name):
    config, key, why = REFUSED[name]
    with pytest.raises(DeepSpeedConfigError) as refused:
        map_deepspeed_config(config, world_size=2, front_end="initialize")
    line = next((line for line in str(refused.value).splitlines() if key in line), "")
    assert why in line, str(refused.value)


def test_deepspeed_reads_what_maps_here_and_refuses_what_it_cannot_run(monkeypatch):
    pytest.importorskip("deepspeed", reason="compare with DeepSpeed's own reader where it is installed",
                        exc_type=ImportError)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.config import DeepSpeedConfig

    for name, (config, _, _) in MAPPED.items():
        read = DeepSpeedConfig(dict(config))  # DeepSpeed's own reading of the same dict
        assert read.zero_optimization_stage == config["zero_optimization"]["stage"], name
    _, key, _ = REFUSED["cifar/ds_config"]
    with pytest.raises(Exception, match=key.partition(".")[2]):  # pydantic: extra inputs are not permitted
        DeepSpeedConfig(dict(REFUSED["cifar/ds_config"][0]))
    lora, _, _ = REFUSED["DeepSpeed-Chat --enable_mixed_precision_lora"]
    assert DeepSpeedConfig(dict(lora)).zero_config.zero_quantized_nontrainable_weights
    accelerator = get_accelerator()  # ... which DeepSpeed quantizes with a CUDA kernel its CPU accelerator lacks
    assert accelerator.device_name() == "cpu"
    assert accelerator.get_op_builder("QuantizerBuilder").__name__ == "NotImplementedBuilder"
