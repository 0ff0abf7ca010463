"""ZeroStrategy: Lightning's hooks, handing the sharding to the engine."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from .activation import offload_activations
from .checkpoint import is_deepspeed_checkpoint, is_sharded_checkpoint
from .checkpoint.background import BackgroundSaver
from .checkpoint.deepspeed import fit_to_module
from .checkpoint.sharded import masters_from_state_dict, on_every_rank
from .comm_model import predict_step_bytes
from .config import ZeroConfig
from .deepspeed.config import DeepSpeedSettings
from .deepspeed.trainer import apply_to_trainer, check_batch_size, optimizers_from_config
from .engine import Collectives, FlatParameters, ZeroOptimizer
from .names import register_names
from .engine.grads.accumulation import deferred_reduction
from .engine.params.buffer_sync import BufferBroadcast
from .engine.diagnose.rank_board import mark
from .engine.diagnose.watchdog import install_sigterm_handler
from .frontend import (EngineModel, deepspeed_optimizer_state, load_full_model, load_sharded_model,
                       load_sharded_optimizers, move_module, open_sharded, read_deepspeed, save_sharded_model,
                       setup_engine)
from .frontend.checkpoint import whole_modules_in
from .frontend.in_step import apply_layer_sync, no_sync, one_forward
from .frontend.options import ProcessLayout, barrier, broadcast_object, read_options, takes_options
from .frontend.pretrained import save_pretrained
from .frontend.setup import engine_config, reporter
from .memory import memory_stats
from .precision import ZeroPrecision, to_zero_precision
from .pretrained import sharded_init
from .step_report import Reporter, StepSummary, summarize, units_of
from .world import join_world, set_world_ranks

log = logging.getLogger(__name__)
_SHARDED = "_zero_sharded_checkpoint"  # a loaded checkpoint's reader, for the load hooks below
# what Lightning's restore requires of a checkpoint, which one that another front end wrote (Fabric's,
# initialize's) lacks: the weights, optimizer state and loss scale resume, the loops start anew
_TRAINER_DEFAULTS: dict[str, Any] = {"lr_schedulers": [], "pytorch-lightning_version": pl.__version__}


class _FullWeightsLauncher(_MultiProcessingLauncher):
    """spawn/fork/forkserver: the main process receives rank 0's weights when the workers end, and
    at stage 3 the module's own state dict holds only this rank's (empty) shards: send the whole one."""

    def _collect_rank_zero_results(self, trainer: "pl.Trainer", results: Any) -> Optional[_WorkerOutput]:
        strategy = self._strategy
        assert isinstance(strategy, ZeroStrategy)
        weights = strategy.full_state_dict()  # every rank: a collective at stage 3
        # the last collective of this worker: a gloo group left to interpreter shutdown sometimes
        # aborts the process ("terminate called without an active exception"), failing the launch
        dist.destroy_process_group()
        if strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:  # a fresh folder: several nodes may share the filesystem
            weights_path = os.path.join(tempfile.mkdtemp(), "weights.ckpt")
            strategy.checkpoint_io.save_checkpoint(weights, weights_path)
        callback = trainer.checkpoint_callback
        best = getattr(callback, "best_model_path", None) if callback is not None else None
        return _WorkerOutput(best, weights_path, trainer.state, results, self.get_extra_results(trainer))


class ZeroStrategy(ProcessLayout, ParallelStrategy):
    """ZeRO data parallelism: optimizer state (stage 1), gradients (stage 2) and parameters (stage 3)
    sharded over ranks.

    Launches like DDP (one process per device, ``accelerator="cpu", devices=2`` works too), on
    gloo for CPU and NCCL for CUDA. ``Trainer(strategy="zero_stage_2")`` after ``import
    zero_strategy`` is the same as ``Trainer(strategy=ZeroStrategy(stage=2))``.
    """

    strategy_name = "zero"
    is_distributed = True  # Lightning reads this to inject the DistributedSampler and sync logs

    @takes_options
    def __init__(
        self,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        **given: Any,  # every ZeroConfig field and FRONT_END_OPTIONS: see [Note: the front ends' signatures]
    ) -> None:
        options = read_options(given)
        self.deepspeed: Optional[DeepSpeedSettings] = options.deepspeed  # see deepspeed_config.py
        if precision_plugin is None and options.precision_from_config is not None:
            name, kwargs = options.precision_from_config
            precision_plugin = ZeroPrecision(name, **kwargs)
        self.config: ZeroConfig = options.config
        self.state_dict_type = options.state_dict_type
        self.verify_checkpoints = options.verify_checkpoints
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._num_nodes = 1
        self._process_group_backend: Optional[str] = given["process_group_backend"]
        self._timeout = options.timeout
        self._start_method = options.start_method
        self._comm: Optional[Collectives] = None  # every collective of the engine, once the process group exists
        self._sharder: Optional[FlatParameters] = None  # the model's flat groups, once set up
        self._saver: Optional[BackgroundSaver] = None  # with async_save, once set up
        self._buffer_sync: Optional[BufferBroadcast] = None  # while fitting: see [Note: buffers kept in step]
        self._layer_synced = False  # sync_batchnorm applied by this fit's setup, reverted at its teardown
        self._set_up = False  # the engine's setup of this run is done (stage 3 loads checkpoints after it)
        self._deferred_load: Optional[tuple[Mapping[str, Any], bool]] = None
        self._reporter: Optional[Reporter] = None  # while fitting with step_breakdown: see _report_step
        self._predicted: Optional[dict[str, int]] = None  # the communication model's bytes of one step

    # ---- what Lightning asks about the layout of processes ---------------------------------

    @property
    def precision_plugin(self) -> ZeroPrecision:
        return self._precision_plugin if self._precision_plugin is not None else ZeroPrecision()

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        self._precision_plugin = to_zero_precision(precision_plugin)

    # ---- processes and the process group ---------------------------------------------------

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _FullWeightsLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        super().setup_environment()
        self._setup_distributed()

    def set_world_ranks(self) -> None:
        set_world_ranks(self)  # see world.py

    def _setup_distributed(self) -> None:
        self._process_group_backend, self._comm = join_world(
            self, self._process_group_backend, self._timeout, "the Trainer",
            "Trainer(devices=..., num_nodes=...) asks for", lambda: getattr(self.launcher, "procs", []))

    @property
    def comm(self) -> Collectives:
        """The engine's collectives over the whole world (see engine/comm/collectives.py)."""
        if self._comm is None:  # a world of one without a process group (tests that skip setup_environment)
            self._comm = self._world_collectives()
        return self._comm

    # ---- model and optimizers --------------------------------------------------------------

    def setup(self, trainer: "pl.Trainer") -> None:
        # the engine's ordered setup (see [Note: the order of setup]); configure_optimizers is its step 4,
        # while parameters still have their shapes, and only when fitting
        assert self.accelerator is not None
        if self.deepspeed is not None:
            apply_to_trainer(self.deepspeed, trainer, self.world_size)
        self.accelerator.setup(trainer)
        assert self.model is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and not any(p.requires_grad for p in self.model.parameters()):
            raise ValueError(f"{type(self.lightning_module).__name__} has no trainable parameter (every requires_grad "
                             "is False), so there is nothing to fit; unfreeze the parameters to train "
                             "(requires_grad_(True)), or call trainer.validate/test/predict instead.")

        def configure_optimizers() -> list[torch.optim.Optimizer]:
            self.setup_optimizers(trainer)
            return self.optimizers

        if fitting and self._layer_sync is not None:  # sync_batchnorm=True, as Lightning's DDP applies it
            self.model = apply_layer_sync(self._layer_sync, self.model, self.root_device)
            self._layer_synced = True
        if fitting and self.config.step_breakdown:  # while the parameters have their whole shapes
            self._predicted = self._predict_step_bytes(trainer)
        engine = setup_engine(self.model, self.config, self.precision_plugin.working, self.comm, self.root_device,
                              configure_optimizers if fitting else (), sharder=self._sharder, hook_buffer_sync=False)
        self._sharder = engine.sharder
        self._saver = engine.saver
        self._buffer_sync = engine.buffer_sync if fitting else None  # the steps DDP wraps: see training_step
        if fitting:
            self.optimizers = list(engine.optimizers)
            self._reporter = reporter(engine) if self.config.step_breakdown else None
        self._set_up = True
        if self._deferred_load is not None:  # stage 3: a checkpoint's weights, into the shards just made
            deferred, self._deferred_load = self._deferred_load, None
            self.load_model_state_dict(*deferred)
        self.setup_precision_plugin()
        if fitting:
            self._point_schedulers_at_zero_optimizers()
            _optimizers_to_device(self.optimizers, self.root_device)

    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        """The module's optimizers, or the DeepSpeed config's when the module gives none."""
        assert self.lightning_module is not None
        from_config = self.deepspeed is not None and self.deepspeed.optimizer is not None
        if not from_config or is_overridden("configure_optimizers", self.lightning_module):
            super().setup_optimizers(trainer)  # without an override Lightning would warn of running with none
        if from_config:
            assert self.deepspeed is not None
            self.optimizers, self.lr_scheduler_configs = optimizers_from_config(
                self.deepspeed, self.lightning_module, self.optimizers, self.lr_scheduler_configs)

    def _point_schedulers_at_zero_optimizers(self) -> None:
        """LR schedulers were built on the user's optimizers; they change the same param groups
        through the ZeroOptimizers (see [Note: master weights]), and pointing them there lets
        Lightning pair each optimizer with its scheduler (LearningRateMonitor logs each group once)."""
        for config in self.lr_scheduler_configs:
            for opt in self._zero_optimizers:
                if config.scheduler.optimizer is opt.optim:
                    config.scheduler.optimizer = opt

    @property
    def engine_config(self) -> ZeroConfig:
        """The strategy's settings, with master weights as the precision plugin asks."""
        return engine_config(self.config, self.precision_plugin.working)

    @property
    def _engine(self) -> EngineModel:
        """The module, its sharder and optimizers as the shared checkpoint code takes them."""
        assert self.lightning_module is not None
        return EngineModel(self.lightning_module, self.engine_config, self.precision_plugin.working, self.comm,
                           self.root_device, self._sharder, self._zero_optimizers, self._saver)

    def model_to_device(self) -> None:
        assert self.model is not None
        move_module(self.model, self.root_device)  # meta tensors stay: see [Note: the order of setup]

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Stage 3: modules built in ``configure_model`` go on the meta device, so the model never
        exists whole on one rank (see [Note: init-time sharding] in engine/params/materialize.py)."""
        if self.config.stage != 3:
            yield
            return
        with sharded_init():  # recorded on meta; from_pretrained streams its files (pretrained.py)
            yield

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # before setup at every stage: Lightning 2.6 drops fit's weights_only when it restores after setup, and
        # a checkpoint whose hyper-parameters hold a module needs weights_only=False; stage 3 loads the weights
        # into the shards once setup made them (load_model_state_dict)
        return False

    # ---- a hung collective ends the job: see [Note: hang watchdog] in engine/diagnose/watchdog.py ----------

    def on_train_start(self) -> None:
        install_sigterm_handler()  # after the Trainer installed its own, which it keeps calling
        if self.deepspeed is not None and self.lightning_module is not None:
            check_batch_size(self.deepspeed, self.lightning_module.trainer, self.world_size)
        self.comm.breakdown.reset()  # the first step's time starts here, not at setup

    def on_validation_start(self) -> None:
        install_sigterm_handler()

    def on_validation_end(self) -> None:
        self.comm.begin_step()  # validation's gathers are not the next training step's bytes (comm_stats)
        mark("ended validation")  # the loops' ends: see [Note: the rank board] in engine/diagnose/rank_board.py

    def on_test_start(self) -> None:
        install_sigterm_handler()

    def on_test_end(self) -> None:
        mark("ended testing")

    def on_predict_start(self) -> None:
        install_sigterm_handler()

    def on_predict_end(self) -> None:
        mark("ended prediction")

    def on_train_end(self) -> None:
        mark("ended the training loop")
        if self._reporter is not None:  # every rank: the ranks' figures are gathered
            self._print_breakdown()

    # ---- stage 3: the root unit is held around each step, and state dicts are gathered ------

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # the training step is the step's forward phase, its batch args[0] (see [Note: the step breakdown])
        timer, output = self.comm.breakdown, None
        timer.forward_began(args[:1], self.lightning_module)
        try:
            # Lightning's DDP runs the fit's training and validation steps through DDP's forward, which
            # broadcasts the buffers: the same here (see [Note: buffers kept in step] in engine/params/buffer_sync.py)
            with one_forward(self._buffer_sync):
                if self._sharder is not None:
                    self._sharder.hold_root()  # released when backward ends
                with offload_activations(enabled=self.config.offload_activations):  # saved tensors in host memory
                    output = super().training_step(*args, **kwargs)
                    return output
        finally:
            timer.forward_ended(output)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any,
                       model: Optional[Union["pl.LightningModule", torch.nn.Module]] = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._reporter is not None:
            self._report_step()
        return out

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with one_forward(self._buffer_sync), self._root_held():
            return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._root_held():
            return super().test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._root_held():
            return super().predict_step(*args, **kwargs)

    @contextmanager
    def _root_held(self) -> Generator[None, None, None]:
        if self._sharder is None:
            yield
            return
        self._sharder.hold_root()
        try:
            yield
        finally:
            self._sharder.release_root()

    # ---- where the step's time goes: see [Note: the step breakdown] in engine/diagnose/breakdown.py --

    def _report_step(self) -> None:
        """After an optimizer step: when the Trainer writes its logs, the means of the steps since the last
        time, as ``zero/<part>_ms``, throughput and MFU (rank 0's); advice, once."""
        assert self._reporter is not None and self.lightning_module is not None
        connector = getattr(self.lightning_module.trainer, "_logger_connector", None)
        if getattr(connector, "should_update_logs", True):
            metrics = self._reporter.window()
            if metrics:
                self.lightning_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)
        for text in self._reporter.new_advice():  # see [Note: advice from the breakdown] in step_report.py
            if self.is_global_zero:
                log.warning("zero_strategy: %s", text)

    def step_breakdown(self) -> StepSummary:
        """This rank's mean training step so far, by part (see [Note: the step breakdown]), with
        throughput, FLOPs, MFU and advice; ``.table()`` is what the end of ``fit`` prints, ``.metrics()``
        what is logged. Empty with ``step_breakdown=False``."""
        report = self._reporter
        return summarize(self.comm.breakdown, self.engine_config, self.world_size,
                         report.peak if report is not None else None, units_of(self._sharder),
                         self.comm.comm_stats(), self._predicted)

    def _print_breakdown(self) -> None:
        summary = self.step_breakdown()  # its advice lines included
        summary.ranks_ms = self.comm.all_gather_object(summary.ms)
        if self.is_global_zero and summary.steps:
            print(summary.table(), flush=True)

    def _predict_step_bytes(self, trainer: "pl.Trainer") -> Optional[dict[str, int]]:
        """The communication model's bytes for one step of this fit (see [Note: the communication model]),
        shown beside the measured ones; None at stage 3 once the parameters are shards (a second fit), or
        where the model cannot lay the module out."""
        if self.config.stage == 3 and self._sharder is not None:
            return None
        assert self.model is not None
        precision = self.precision_plugin.working
        clipping = bool(trainer.gradient_clip_val) and trainer.gradient_clip_algorithm in (None, "norm")
        try:
            return predict_step_bytes(  # type: ignore[return-value]
                self.model, self.engine_config, self.world_size, self.num_processes or None, dtype=precision.dtype,
                loss_scaling=precision.scaler is not None, clipping=clipping,
                accumulation_steps=trainer.accumulate_grad_batches, backend=self.comm.backend)
        except Exception:  # noqa: BLE001 - only shown beside the measurement: never the reason a fit fails
            return None

    # ---- checkpoints: sharded directories (see [Note: checkpoint layout]) or one full file ------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Empty for sharded checkpoints (``save_checkpoint`` takes the weights from the engine, each rank
        its own pieces); else the full state dict, on every rank. Use ``full_state_dict()`` for that."""
        if self.state_dict_type == "sharded":
            return {}
        return self.full_state_dict()

    def full_state_dict(self) -> dict[str, Any]:
        """The module's whole state dict, on every rank (a collective at stage 3, gathered unit by unit)."""
        return self._engine.full_state_dict()

    def save_pretrained(self, save_directory: Any, **options: Any) -> Any:
        """Write the model in the Hugging Face layout (config.json, safetensors shards, their index; a peft
        model merged, its adapter alone in ``save_directory/adapter``) from rank 0, one tensor gathered at
        a time; options as ``zero_strategy.frontend.pretrained.save_pretrained``. A collective: call it on
        every rank (in a hook every rank runs, such as ``on_train_end``)."""
        return save_pretrained(self._engine, save_directory, **options)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self.state_dict_type == "sharded":
            return {}  # saved by save_checkpoint, each rank its own pieces
        return super().optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Sharded: every rank writes its pieces into the directory ``filepath``, atomically (see [Note: one
        checkpoint format for every front end]). Full: rank 0 writes one file through the CheckpointIO plugin."""
        if self.state_dict_type == "full":  # a module in the hyper-parameters is pickled whole: whole_modules_in
            with whole_modules_in(checkpoint, self._engine):
                return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(f"storage_options={storage_options!r} is not supported by sharded checkpoints, which are "
                            "written by the strategy, not a CheckpointIO plugin; use state_dict_type='full' for it.")
        save_sharded_model(filepath, checkpoint, self._engine)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A sharded directory (any world size and stage; also one that ZeroFabricStrategy or ``initialize``
        wrote), a DeepSpeed checkpoint directory, or a regular file, never unpickling arbitrary objects
        unless ``weights_only=False`` is passed (for a directory: the objects saved beside its state, see
        [Note: pickled objects]). A checkpoint that fails to open on any rank fails on every rank."""
        if is_deepspeed_checkpoint(checkpoint_path):  # DeepSpeed's (or Lightning's DeepSpeedStrategy's) directory
            checkpoint = read_deepspeed(checkpoint_path, self.comm)
            assert self.lightning_module is not None  # DeepSpeed trained the bare model: names may lack a prefix
            return fit_to_module(checkpoint, list(self.lightning_module.state_dict(keep_vars=True)))
        if not is_sharded_checkpoint(checkpoint_path) and Path(checkpoint_path).is_file():
            return super().load_checkpoint(checkpoint_path, weights_only=True if weights_only is None else weights_only)
        reader, checkpoint, saved = open_sharded(  # objects only pickle loads: see [Note: pickled objects]
            checkpoint_path, self.comm, self.verify_checkpoints, weights_only,
            "trainer.fit(model, ckpt_path=path, weights_only=False) (validate, test and predict take it too)")
        checkpoint["state_dict"] = {}  # loaded from the rank files by load_model_state_dict
        if saved["optimizers"] is not None:
            checkpoint["optimizer_states"] = [{} for _ in saved["optimizers"]]
        if "loops" not in checkpoint:
            rank_zero_warn(f"{checkpoint_path} was written by another front end than the Trainer (Fabric, or "
                           "initialize's save_checkpoint): the weights, optimizer state and loss scale are restored; "
                           "the loops, LR schedulers and callbacks start anew (its own keys are in the checkpoint "
                           "dict that LightningModule.on_load_checkpoint receives).")
            for key, value in _TRAINER_DEFAULTS.items():
                checkpoint.setdefault(key, value)
        checkpoint[_SHARDED] = (reader, saved)
        return checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.config.stage == 3 and not self._set_up:  # no shards yet: setup loads them
            self._deferred_load = (checkpoint, strict)
            return
        if _SHARDED in checkpoint:
            reader, saved = checkpoint[_SHARDED]
            return load_sharded_model(self._engine, reader, saved, strict)
        if self._sharder is None or self.config.stage < 3:
            return super().load_model_state_dict(checkpoint, strict=strict)
        load_full_model(self._engine, checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if _SHARDED in checkpoint:
            reader, saved = checkpoint[_SHARDED]
            return load_sharded_optimizers(self._engine, reader, saved)
        if "deepspeed" in checkpoint:  # DeepSpeed kept the trainable parameters only: numbered by name
            checkpoint = {**checkpoint, "optimizer_states": [deepspeed_optimizer_state(checkpoint, self._engine)]}
        super().load_optimizer_state_dict(checkpoint)
        assert self.lightning_module is not None  # restored before setup at stages 1-2: the masters come now
        on_every_rank(self.comm, lambda: masters_from_state_dict(checkpoint["state_dict"], self.lightning_module,
                                                                 self._zero_optimizers))

    @property
    def _zero_optimizers(self) -> list[ZeroOptimizer]:
        return [opt for opt in self.optimizers if isinstance(opt, ZeroOptimizer)]

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """The Trainer's micro-batches before an accumulation boundary: with ``local_accumulation``
        (stages 2-3) their backward adds into local buffers and the boundary's reduces once (see [Note:
        local accumulation] in engine/grads/accumulation.py); otherwise each backward reduces as usual."""
        with deferred_reduction(self._zero_optimizers), no_sync(self._buffer_sync):  # and DDP's buffer flag
            yield

    def memory_stats(self) -> dict[str, int]:
        """This rank's bytes in params, grads, optimizer_states and master_params (and total), where they
        live (device, host, disk), and the engine's reusable buffers held free (workspace, not in total)."""
        assert self.lightning_module is not None
        return memory_stats(self.lightning_module, self.optimizers)

    def wait_for_saves(self) -> None:
        """With ``async_save``: wait until the checkpoint being written in the background is committed,
        and raise what it failed with. The next save and the end of training wait by themselves."""
        if self._saver is not None:
            self._saver.wait()

    def remove_checkpoint(self, filepath: Any) -> None:
        """ModelCheckpoint's removal of a checkpoint it no longer keeps. With ``async_save`` it waits until
        the save in flight has committed, so the newest complete checkpoint is never removed before its
        successor is complete (see [Note: saving in the background])."""
        saver = self._saver
        if saver is None:
            return super().remove_checkpoint(filepath)
        saver.after_commit(lambda: super(ZeroStrategy, self).remove_checkpoint(filepath))

    def teardown(self) -> None:
        saver, self._saver = self._saver, None
        for opt in self.optimizers:
            if isinstance(opt, ZeroOptimizer):
                opt.remove_hooks()
        self._buffer_sync, self._set_up = None, False
        if self._layer_synced:  # batch norm layers as they were before the fit, as Lightning's DDP reverts them
            self._layer_synced = False
            assert self._layer_sync is not None and self.model is not None
            self.model = self._layer_sync.revert(self.model)
        module = self.lightning_module
        on_meta = module is not None and any(t.is_meta for t in (*module.parameters(), *module.buffers()))
        if on_meta:  # set-up failed before stage 3 built the weights: nothing to move, and moving would raise,
            self._lightning_module = None  # burying set-up's error under "Cannot copy out of meta tensor"
        try:
            super().teardown()  # at stage 3 the model stays sharded, ready for test or predict
        finally:
            if on_meta:
                self._lightning_module = module
        if saver is not None:
            saver.close()  # the end of training waits for the last save, and raises what it failed with

    # ---- collectives Lightning uses (logging with sync_dist, metrics, callbacks) -------------

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        barrier(self.root_device)

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return broadcast_object(obj, src)

    def reduce(self, tensor: Any, group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``zero_stage_1``, ``zero_stage_2``, ``zero_stage_3`` and the offload variants
        (``zero_strategy.STRATEGY_NAMES``) with this class; safe to call more than once. ``import
        zero_strategy`` does it already (see [Note: registering with Lightning lazily])."""
        register_names(strategy_registry, cls, cls.__name__)

