"""Every config in conf/ composes with Hydra's compose API and instantiates into the object it
describes; every ``_target_`` accepts the arguments its node gives (zero_strategy.cli.validate)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback, RichProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import DDPStrategy, Strategy

from zero_strategy import ZeroStrategy
from zero_strategy.cli.configs import GROUPS, config_dir, group_options
from zero_strategy.cli.train import build
from zero_strategy.cli.validate import ConfigError, check_config

ALL = [(group, option) for group in GROUPS for option in group_options(group)]


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 400)  # 17,600 bytes
    return path


def composed(tmp_path, *overrides: str, config_name: str = "train"):
    """The config zero-train would run, with its output folder (a Hydra run-time value) set."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        return compose(config_name, overrides=[*overrides, f"paths.output_dir={tmp_path}"])


def test_every_group_has_options():
    options = {group: group_options(group) for group in GROUPS}
    assert options["strategy"] == ["ddp", "deepspeed_config", "zero1", "zero2", "zero2_offload", "zero3",
                                   "zero3_offload"]
    assert {"gpt", "gpt2", "bert", "mlp"} <= set(options["model"])
    assert {"stdlib", "text", "synthetic", "gaussian", "corrupted_source"} <= set(options["data"])
    assert {"default", "cpu", "gpu", "multi_node"} <= set(options["trainer"])
    assert "csv" in options["logger"] and "default" in options["callbacks"] and options["experiment"]


@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")  # a training step outside a Trainer
@pytest.mark.parametrize(("group", "option"), ALL, ids=[f"{g}={o}" for g, o in ALL])
def test_compose_and_instantiate(tmp_path, text_file, group, option):
    extra = [f"data.path={text_file}"] if (group, option) == ("data", "text") else []
    cfg = composed(tmp_path, f"{group}={option}", *extra)
    # every _target_ takes the arguments its node gives, with fitting types (a data set alone may not
    # fit the default GPT: that pairing is the model presets' business, checked under model=...)
    check_config(cfg, sections=("data",) if group == "data" else None)
    if group == "model":
        model = instantiate(cfg.model)
        data = instantiate(cfg.data)  # the data set this model is paired with (model/*.yaml)
        data.setup("fit")
        x, y = next(iter(data.train_dataloader()))
        logits = model(x)
        assert isinstance(model, L.LightningModule)
        # a language model predicts every next token; a classifier one label per sample
        expected = (*y.shape, 256) if y.dim() == 2 else (len(y), model.hparams.num_classes)
        assert tuple(logits.shape) == expected
        assert torch.isfinite(model.training_step((x, y), 0))
    elif group == "data":
        data = instantiate(cfg.data)
        assert isinstance(data, L.LightningDataModule)
        data.setup("fit")
        x, y = next(iter(data.train_dataloader()))
        assert len(x) == cfg.data.batch_size and len(data.val_dataloader()) > 0
    elif group == "strategy":
        strategy = instantiate(cfg.strategy)
        assert isinstance(strategy, Strategy)
        if option.startswith("zero"):
            assert isinstance(strategy, ZeroStrategy) and strategy.config.stage == int(option[4])
            assert strategy.config.offload_optimizer == option.endswith("_offload")
            assert strategy.config.offload_params == (option == "zero3_offload")
        elif option == "deepspeed_config":  # and with the tutorial's config file: its stage and fp16
            assert isinstance(strategy, ZeroStrategy) and strategy.deepspeed is None
            example = Path(__file__).parents[1] / "examples" / "deepspeed_config" / "ds_config.json"
            strategy = instantiate(composed(tmp_path, f"strategy={option}", f"strategy.config={example}").strategy)
            assert strategy.config.stage == 2 and strategy.precision_plugin.precision == "16-mixed"
        else:
            assert isinstance(strategy, DDPStrategy)
    elif group == "trainer":
        if option == "gpu" and not torch.cuda.is_available():
            assert cfg.trainer.accelerator == "gpu" and cfg.trainer.devices == -1
            with pytest.raises(InstantiationException, match="(?i)gpu"):  # Lightning: only the GPU is missing
                instantiate(cfg.trainer, strategy=instantiate(cfg.strategy), logger=False)
            return
        trainer = instantiate(cfg.trainer, strategy=instantiate(cfg.strategy), logger=False)
        assert isinstance(trainer, L.Trainer) and trainer.max_steps == cfg.trainer.max_steps
        assert trainer.num_nodes == cfg.trainer.num_nodes
    elif group == "callbacks":
        callbacks = [instantiate(c) for c in cfg.callbacks.values()]
        assert callbacks and all(isinstance(c, Callback) for c in callbacks)
        bars = [c for c in callbacks if isinstance(c, (TQDMProgressBar, RichProgressBar))]
        if option in ("default", "rich"):
            assert len(bars) == 1 and isinstance(bars[0], RichProgressBar if option == "rich" else TQDMProgressBar)
    elif group == "logger":
        loggers = [instantiate(c) for c in cfg.logger.values()]
        assert loggers and all(isinstance(lg, Logger) for lg in loggers)
    elif group == "experiment":
        if cfg.trainer.accelerator == "gpu" and not torch.cuda.is_available():
            pytest.skip("a GPU experiment")
        objects = build(cfg)  # exactly what zero-train instantiates
        assert isinstance(objects["trainer"].strategy, ZeroStrategy)
        assert isinstance(objects["model"], L.LightningModule)
    else:
        raise AssertionError(f"untested group {group}")


def test_default_run_is_the_documented_one(tmp_path):
    cfg = composed(tmp_path)
    objects = build(cfg)
    trainer = objects["trainer"]
    assert isinstance(trainer.strategy, ZeroStrategy) and trainer.strategy.config.stage == 2
    assert cfg.model.net._target_ == "zero_strategy.models.GPT"
    assert cfg.data._target_ == "zero_strategy.data.StdlibDataModule"
    expected_devices = torch.cuda.device_count() if torch.cuda.is_available() else 2
    assert trainer.num_devices == expected_devices
    assert cfg.trainer.max_steps <= 300  # the default run stays short (README: ~1.5 minutes on 2 cores)
    assert trainer.precision == "32-true"


def test_precision_key_sets_the_trainer_field(tmp_path):
    assert composed(tmp_path, "precision=bf16-mixed").trainer.precision == "bf16-mixed"
    assert composed(tmp_path, "trainer.precision=16-mixed").trainer.precision == "16-mixed"


def test_a_classifier_model_brings_its_data_and_data_still_wins(tmp_path, text_file):
    assert composed(tmp_path, "model=mlp").data._target_.endswith("GaussianClassificationDataModule")
    assert composed(tmp_path, "model=bert").data._target_.endswith("CorruptedSourceDataModule")
    cfg = composed(tmp_path, "model=bert", "data=text", f"data.path={text_file}")
    assert cfg.data._target_.endswith("TextDataModule")


def test_check_config_names_the_bad_value(tmp_path):
    with pytest.raises(ConfigError) as err:
        check_config(composed(tmp_path, "trainer.max_steps=ten", "data=text", "+strategy.stag=2"))
    text = str(err.value)
    assert "trainer.max_steps='ten' (str) does not fit lightning.pytorch.Trainer's max_steps: int" in text
    assert "data.path is required" in text
    assert "strategy.stag is not an argument of zero_strategy.ZeroStrategy" in text and "strategy.stage?" in text


def test_estimate_config_composes(tmp_path):
    cfg = composed(tmp_path, "world_size=64", config_name="estimate")
    assert cfg.world_size == 64 and cfg.offload is False and "model" in cfg
