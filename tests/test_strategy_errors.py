"""Bad input to ZeroStrategy fails early, naming the bad value and what is allowed."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry

import zero_strategy
from zero_strategy import ZeroStrategy

from .distributed import free_port, run_distributed


def _trainer(**kwargs) -> L.Trainer:
    defaults = dict(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
    return L.Trainer(**{**defaults, **kwargs})


def test_registration_is_idempotent_and_names_resolve():
    ZeroStrategy.register_strategies(StrategyRegistry)  # a second import-time registration is harmless
    for stage in (1, 2):
        strategy = _trainer(strategy=f"zero_stage_{stage}").strategy
        assert isinstance(strategy, ZeroStrategy) and strategy.config.stage == stage
    assert zero_strategy.__all__ and all(hasattr(zero_strategy, name) for name in zero_strategy.__all__)


@pytest.mark.parametrize("kwargs, match", [
    ({"stage": 4}, r"stage=4 .*allowed stages are \(1, 2, 3\)"),
    ({"stage": 0}, r"stage=0"),
    ({"bucket_cap_mb": 0}, r"bucket_cap_mb=0 must be a positive"),
    ({"bucket_cap_mb": -5.0}, r"bucket_cap_mb=-5.0"),
    ({"start_method": "thread"}, r"start_method='thread' is not one of"),
    ({"stage": 3, "shard_modules": "Block"}, r"shard_modules='Block' must be a list .*shard_modules=\['Block'\]"),
    ({"activation_checkpointing": "Block"}, r"activation_checkpointing='Block' must be a list"),
    ({"timeout": "30"}, r"timeout='30' must be a datetime.timedelta or a positive number of seconds"),
    ({"timeout": -1}, r"timeout=-1 must be"),
    ({"collective_timeout": "soon"}, r"collective_timeout='soon' must be a positive number of seconds"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ZeroStrategy(**kwargs)


class OwnPrecision(Precision):
    """A precision plugin of the user's own, whose hooks ZeRO's plugin would replace."""

    precision = "32-true"


def test_unsupported_precision_is_named():
    with pytest.raises(ValueError, match=r"precision='32-true' \(OwnPrecision\); supported: 32-true, bf16-mixed"):
        _trainer(strategy=ZeroStrategy(), plugins=[OwnPrecision()])


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true", "16-true", "64-true"])
def test_supported_precision_gets_zero_precision(precision):
    plugin = _trainer(strategy=ZeroStrategy(), precision=precision).strategy.precision_plugin
    assert type(plugin).__name__ == "ZeroPrecision" and plugin.precision == precision
    assert plugin.master_weights == precision.endswith("-mixed")


def test_bad_loss_scaling_knobs():
    from zero_strategy import ZeroPrecision

    with pytest.raises(ValueError, match="hysteresis >= 1.*hysteresis=0"):
        ZeroPrecision("16-mixed", hysteresis=0)
    with pytest.raises(ValueError, match="precision='8-mixed' is not supported.*bf16-mixed"):
        ZeroPrecision("8-mixed")


def test_cuda_where_there_is_none():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(Exception, match="CUDAAccelerator` can not run on your system.*available.*cpu"):
        _trainer(strategy=ZeroStrategy(), accelerator="cuda")


def test_nccl_on_cpu_is_refused():
    with pytest.raises(ValueError, match="process_group_backend='nccl' needs CUDA devices"):
        _trainer(strategy=ZeroStrategy(process_group_backend="nccl")).fit(BoringModel())


class LBFGSModel(BoringModel):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


def test_optimizer_that_cannot_be_trained_under_zero_is_refused_saying_what_to_use():
    with pytest.raises(ValueError, match="LBFGS cannot be trained under ZeRO: .*closure.*train it with DDP"):
        _trainer(strategy=ZeroStrategy(stage=1)).fit(LBFGSModel())


def _fit_in_a_larger_world(rank, world_size):
    # the process group already spans 2 processes, but the Trainer is told devices=1
    try:
        _trainer(strategy=ZeroStrategy()).fit(BoringModel())
    except RuntimeError as err:
        return str(err)
    return "no error"


@pytest.mark.timeout(120)
def test_mismatched_world_size():
    for message in run_distributed(_fit_in_a_larger_world, 2):
        assert "the process group has 2 processes but the Trainer expects 1" in message


def test_single_device_fit_trains():
    model = BoringModel()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = _trainer(strategy="zero_stage_2")
    trainer.fit(model)
    assert trainer.global_step == 2
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_unknown_state_dict_type_is_refused():
    with pytest.raises(ValueError, match=r"state_dict_type='fsdp' is not one of \('sharded', 'full'\)"):
        ZeroStrategy(state_dict_type="fsdp")


def test_storage_options_are_refused_for_sharded_checkpoints(tmp_path):
    strategy = ZeroStrategy()
    with pytest.raises(TypeError, match="storage_options=.* is not supported by sharded checkpoints"):
        strategy.save_checkpoint({}, tmp_path / "x.ckpt", storage_options={"compress": True})


class _TwoLinears(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 2))


@pytest.mark.timeout(180)
def test_spawn_at_stage_3_hands_the_whole_weights_to_the_main_process(monkeypatch):
    # with spawn the main process gets rank 0's weights when the workers end: whole ones, not
    # rank 0's empty stage-3 shards
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # earlier in-process runs hold theirs
    model = _TwoLinears()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    strategy = ZeroStrategy(stage=3, start_method="spawn", shard_modules=("Linear",), param_persistence_threshold=0)
    _trainer(strategy=strategy, devices=2).fit(model)
    after = model.state_dict()
    assert {k: v.shape for k, v in after.items()} == {k: v.shape for k, v in before.items()}
    assert any(not torch.equal(after[k], before[k]) for k in before)  # trained


def test_a_second_fit_at_stage_3_trains_the_whole_parameters_again():
    # Lightning's teardown runs module.cpu(), which on CUDA gives every whole (resident) parameter a
    # new tensor; simulated here with clones. The next fit must train the module's parameters again.
    model = _TwoLinears()
    strategy = ZeroStrategy(stage=3, shard_modules=("Linear",), param_persistence_threshold=100)  # biases whole
    trainer = _trainer(strategy=strategy)
    trainer.fit(model)
    model._apply(lambda t: t.clone())  # what .cpu() and .to(device) do to the whole parameters
    bias = model.layer[0].bias.detach().clone()
    trainer.fit_loop.epoch_loop.max_steps = 4  # the same Trainer (and sharder): two more steps
    trainer.fit(model)
    assert trainer.global_step == 4
    assert not torch.equal(model.layer[0].bias.detach(), bias)  # trained in the second fit


def test_a_timeout_in_seconds_becomes_a_timedelta():
    from datetime import timedelta

    assert ZeroStrategy(timeout=30)._timeout == timedelta(seconds=30)
    assert ZeroStrategy(timeout=timedelta(minutes=2))._timeout == timedelta(minutes=2)


def test_a_model_with_nothing_to_train_is_refused_at_setup():
    model = _TwoLinears()
    model.requires_grad_(False)
    for stage in (2, 3):
        with pytest.raises(ValueError, match=r"_TwoLinears has no trainable parameter .*requires_grad_\(True\)"):
            _trainer(strategy=ZeroStrategy(stage=stage)).fit(model)


class _BuiltInConfigureModel(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        del self.layer  # built in configure_model, on meta at stage 3

    def configure_model(self) -> None:
        self.layer = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 2))


def test_shard_modules_that_match_nothing_list_the_model_classes():
    # a model built in configure_model is still on meta when the error comes: the teardown that follows
    # must not bury it under "Cannot copy out of meta tensor"
    for model in (_TwoLinears(), _BuiltInConfigureModel()):
        with pytest.raises(ValueError, match=rf"shard_modules=\['NoSuchBlock'\] matches no module of "
                                             rf"{type(model).__name__}.*Linear \(2\)"):
            _trainer(strategy=ZeroStrategy(stage=3, shard_modules=["NoSuchBlock"])).fit(model)


class _WithBatchNorm(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(32, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))


def test_sync_batchnorm_where_torch_cannot_sync_is_refused_before_training():
    # Lightning's DDP applies sync_batchnorm (SyncBatchNorm layers), which torch refuses on CPU at the first step
    model = _WithBatchNorm()
    trainer = _trainer(strategy=ZeroStrategy(stage=2), sync_batchnorm=True)
    with pytest.raises(ValueError, match=r"Trainer\(sync_batchnorm=True\) on a cpu device: torch's SyncBatchNorm "
                                         r".*accelerator='gpu'.*drop sync_batchnorm=True"):
        trainer.fit(model)
    assert trainer.global_step == 0
    assert type(model.layer[1]) is torch.nn.BatchNorm1d  # the model as it was
