"""ZeroStrategy: Lightning's hooks, handing the sharding to the engine."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from .activation import apply_activation_checkpointing, offload_activations
from .checkpoint import (CheckpointError, CheckpointReader, align_optimizer_state, is_deepspeed_checkpoint,
                         is_sharded_checkpoint, load_model, load_optimizers, read_deepspeed_checkpoint, save_sharded)
from .checkpoint.deepspeed import fit_to_module
from .checkpoint.sharded import masters_from_state_dict, on_every_rank, parameter_names
from .config import ZeroConfig
from .deepspeed.config import DeepSpeedSettings
from .deepspeed_config import DeepSpeedConfig, apply_to_trainer, check_batch_size, engine_settings, optimizers_from_config
from .engine import Collectives, ParameterSharder, ZeroOptimizer, shard_module
from .engine.watchdog import install_sigterm_handler
from .memory import memory_stats
from .precision import ZeroPrecision, to_zero_precision

_START_METHODS = ("popen", "spawn", "fork", "forkserver")
_STATE_DICT_TYPES = ("sharded", "full")
_SHARDED = "_zero_sharded_checkpoint"  # a loaded checkpoint's reader, for the load hooks below


def _as_timedelta(timeout: Union[timedelta, float, None]) -> Optional[timedelta]:
    """The process group's timeout: a timedelta, or a number of seconds (converted), or None."""
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        return timedelta(seconds=timeout)
    raise ValueError(f"timeout={timeout!r} must be a datetime.timedelta or a positive number of seconds (the "
                     "process group's timeout; the default is 30 minutes).")


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


class ZeroStrategy(ParallelStrategy):
    """ZeRO data parallelism: optimizer state (stage 1), gradients (stage 2) and parameters (stage 3)
    sharded over ranks.

    Launches like DDP (one process per device, ``accelerator="cpu", devices=2`` works too), on
    gloo for CPU and NCCL for CUDA. ``Trainer(strategy="zero_stage_2")`` after ``import
    zero_strategy`` is the same as ``Trainer(strategy=ZeroStrategy(stage=2))``.
    """

    strategy_name = "zero"
    is_distributed = True  # Lightning reads this to inject the DistributedSampler and sync logs

    def __init__(
        self,
        stage: int = 2,
        bucket_cap_mb: float = 25.0,
        shard_modules: Sequence[Union[str, type]] = (),
        unit_params: Optional[int] = None,
        param_persistence_threshold: int = 100_000,
        prefetch: bool = True,
        allow_untested_optimizer: bool = False,
        offload_optimizer: bool = False,
        offload_params: bool = False,
        offload_dir: Optional[str] = None,
        offload_tile_mb: float = 64.0,
        activation_checkpointing: Sequence[Union[str, type]] = (),
        activation_checkpointing_interval: int = 1,
        offload_activations: bool = False,
        check_unit_order: bool = True,
        collective_timeout: Optional[float] = 600.0,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Union[timedelta, float, None] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        state_dict_type: Literal["sharded", "full"] = "sharded",
        verify_checkpoints: bool = True,
        config: Optional[DeepSpeedConfig] = None,
    ) -> None:
        engine = dict(
            stage=stage, bucket_cap_mb=bucket_cap_mb, shard_modules=shard_modules,
            unit_params=unit_params, param_persistence_threshold=param_persistence_threshold,
            prefetch=prefetch, allow_untested_optimizer=allow_untested_optimizer,
            offload_optimizer=offload_optimizer, offload_params=offload_params, offload_dir=offload_dir,
            offload_tile_mb=offload_tile_mb, activation_checkpointing=activation_checkpointing,
            activation_checkpointing_interval=activation_checkpointing_interval,
            offload_activations=offload_activations, check_unit_order=check_unit_order,
            collective_timeout=collective_timeout,
        )
        self.deepspeed: Optional[DeepSpeedSettings] = None  # what a DeepSpeed config says: see deepspeed_config.py
        if config is not None:
            self.deepspeed, engine = engine_settings(config, engine)
            if precision_plugin is None and self.deepspeed.precision is not None:
                precision_plugin = ZeroPrecision(self.deepspeed.precision, **self.deepspeed.precision_kwargs)
        self.config = ZeroConfig(**engine)
        if state_dict_type not in _STATE_DICT_TYPES:
            raise ValueError(f"state_dict_type={state_dict_type!r} is not one of {_STATE_DICT_TYPES}: 'sharded' (the "
                             "default) saves a checkpoint directory, each rank writing what it owns; 'full' gathers "
                             "the whole state and rank 0 saves one file.")
        self.state_dict_type = state_dict_type
        if not isinstance(verify_checkpoints, bool):
            raise ValueError(f"verify_checkpoints={verify_checkpoints!r} must be True (check every part read against "
                             "its checksum) or False (load a huge checkpoint you trust without the check).")
        self.verify_checkpoints = verify_checkpoints
        if start_method not in _START_METHODS:
            raise ValueError(f"start_method={start_method!r} is not one of {_START_METHODS}; 'popen' (the default) "
                             "re-runs your script once per device, as DDP does.")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = _as_timedelta(timeout)
        self._start_method = start_method
        self._comm: Optional[Collectives] = None  # every collective of the engine, once the process group exists
        self._sharder: Optional[ParameterSharder] = None  # the model's flat groups, once set up

    # ---- what Lightning asks about the layout of processes ---------------------------------

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

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
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    def _setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        if backend == "nccl" and self.root_device.type != "cuda":
            raise ValueError(f"process_group_backend='nccl' needs CUDA devices, but this rank runs on "
                             f"{self.root_device}; use 'gloo' (the default on CPU) or accelerator='cuda'.")
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        if dist.get_world_size() != self.world_size:
            raise RuntimeError(
                f"the process group has {dist.get_world_size()} processes but the Trainer expects "
                f"{self.world_size} (num_nodes={self.num_nodes} x devices={self.num_processes}); launch as many "
                "processes as Trainer(devices=..., num_nodes=...) asks for."
            )
        self._comm = Collectives(collective_timeout=self.config.collective_timeout)

    @property
    def comm(self) -> Collectives:
        """The engine's collectives over the whole world (see engine/collectives.py)."""
        if self._comm is None:  # a world of one without a process group (tests that skip setup_environment)
            self._comm = Collectives(collective_timeout=self.config.collective_timeout)
        return self._comm

    # ---- model and optimizers --------------------------------------------------------------

    def setup(self, trainer: "pl.Trainer") -> None:
        # Order matters: configure_optimizers runs while parameters still have their shapes (code
        # that groups by p.dim() sees real ones); at stage 3 the sharding comes next, then the
        # optimizers are replaced by ZeroOptimizers over the shards.
        assert self.accelerator is not None
        if self.deepspeed is not None:
            apply_to_trainer(self.deepspeed, trainer, self.world_size)
        self.accelerator.setup(trainer)
        assert self.model is not None
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self.config.activation_checkpointing:  # instance forwards only: classes and state_dict keys stay
            apply_activation_checkpointing(self.model, self.config.activation_checkpointing,
                                           self.config.activation_checkpointing_interval,
                                           offload=self.config.offload_activations)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and not any(p.requires_grad for p in self.model.parameters()):
            raise ValueError(f"{type(self.lightning_module).__name__} has no trainable parameter (every requires_grad "
                             "is False), so there is nothing to fit; unfreeze the parameters to train "
                             "(requires_grad_(True)), or call trainer.validate/test/predict instead.")
        if fitting:
            self.setup_optimizers(trainer)
        if self.config.stage == 3:
            self._shard_model()
        else:
            _sync_module_states(self.model)  # every rank starts from rank 0's weights and buffers
            if fitting:  # the flat groups of this fit's optimizers (see [Note: one owner of the flat groups])
                self._sharder = shard_module(self.model, self.engine_config, self.comm, self.root_device,
                                             self.optimizers)
        if fitting:
            scaler = self.precision_plugin.scaler
            self.optimizers = [
                opt if isinstance(opt, ZeroOptimizer)
                else ZeroOptimizer(opt, self.engine_config, sharder=self._sharder, scaler=scaler)
                for opt in self.optimizers
            ]
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

    def _shard_model(self) -> None:
        """Stage 3: shard the parameters (once: a model stays sharded between fit and test)."""
        assert self.model is not None
        if self._sharder is None or self._sharder.module is not self.model:
            for buffer in self.model.buffers():  # parameters are broadcast unit by unit while sharding
                if not buffer.is_meta:
                    self.comm.broadcast(buffer, src=0, what=lambda: "broadcast of the module's buffers")
            self._sharder = shard_module(self.model, self.engine_config, self.comm, self.root_device,
                                         self.optimizers)
        else:  # Lightning's teardown moved the module to the CPU (on CUDA), detaching the whole parameters
            for g in self._sharder.resident:
                g.adopt_params()

    @property
    def engine_config(self) -> ZeroConfig:
        """The strategy's settings, with master weights as the precision plugin asks."""
        return dataclasses.replace(self.config, master_weights=self.precision_plugin.master_weights)

    def model_to_device(self) -> None:
        assert self.model is not None
        device = self.root_device
        # modules built under model_sharded_context stay on meta: they are materialised on the
        # device unit by unit while sharding
        self.model._apply(lambda t: t if t.is_meta else t.to(device))

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Stage 3: modules built in ``configure_model`` go on the meta device, so the model never
        exists whole on one rank (see [Note: init-time sharding])."""
        if self.config.stage != 3:
            yield
            return
        with torch.device("meta"):
            yield

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return self.config.stage == 3  # weights are loaded into the shards, which setup creates

    # ---- a hung collective ends the job: see [Note: hang watchdog] in engine/watchdog.py ----------

    def on_train_start(self) -> None:
        install_sigterm_handler()  # after the Trainer installed its own, which it keeps calling
        if self.deepspeed is not None and self.lightning_module is not None:
            check_batch_size(self.deepspeed, self.lightning_module.trainer, self.world_size)

    def on_validation_start(self) -> None:
        install_sigterm_handler()

    def on_test_start(self) -> None:
        install_sigterm_handler()

    def on_predict_start(self) -> None:
        install_sigterm_handler()

    # ---- stage 3: the root unit is held around each step, and state dicts are gathered ------

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._sharder is not None:
            self._sharder.hold_root()  # released when backward ends
        with offload_activations(enabled=self.config.offload_activations):  # saved tensors wait in host memory
            return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._root_held():
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

    # ---- checkpoints: sharded directories (see [Note: checkpoint layout]) or one full file ------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Empty for sharded checkpoints (``save_checkpoint`` takes the weights from the engine, each rank
        its own pieces); else the full state dict, on every rank. Use ``full_state_dict()`` for that."""
        if self.state_dict_type == "sharded":
            return {}
        return self.full_state_dict()

    def full_state_dict(self) -> dict[str, Any]:
        """The module's whole state dict, on every rank (a collective at stage 3, gathered unit by unit)."""
        assert self.lightning_module is not None
        if self._sharder is None or self.config.stage < 3:  # whole on every rank
            return super().lightning_module_state_dict()
        return self._sharder.full_state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self.state_dict_type == "sharded":
            return {}  # saved by save_checkpoint, each rank its own pieces
        return super().optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Sharded: every rank writes its pieces into the directory ``filepath``, atomically. Full: rank 0
        writes one file through the CheckpointIO plugin."""
        if self.state_dict_type == "full":
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(f"storage_options={storage_options!r} is not supported by sharded checkpoints, which are "
                            "written by the strategy, not a CheckpointIO plugin; use state_dict_type='full' for it.")
        assert self.lightning_module is not None
        save_sharded(filepath, checkpoint, self.lightning_module, self._zero_optimizers, self._sharder, self.comm,
                     self.config.stage)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A sharded directory (any world size and stage), a DeepSpeed checkpoint directory, or a regular
        file, never unpickling arbitrary objects unless ``weights_only=False`` is passed for a file. A
        checkpoint that fails to open on any rank fails on every rank."""
        opened: dict[str, Any] = {}
        if is_deepspeed_checkpoint(checkpoint_path):  # DeepSpeed's (or Lightning's DeepSpeedStrategy's) directory
            on_every_rank(self.comm, lambda: opened.update(checkpoint=read_deepspeed_checkpoint(checkpoint_path)))
            assert self.lightning_module is not None  # DeepSpeed trained the bare model: names may lack a prefix
            return fit_to_module(opened["checkpoint"], list(self.lightning_module.state_dict(keep_vars=True)))
        if not is_sharded_checkpoint(checkpoint_path) and Path(checkpoint_path).is_file():
            return super().load_checkpoint(checkpoint_path, weights_only=True if weights_only is None else weights_only)

        def open_sharded() -> None:  # raises, naming what is wrong, for anything that is not a checkpoint
            reader = CheckpointReader(checkpoint_path, verify=self.verify_checkpoints)
            opened.update(reader=reader, checkpoint=reader.trainer_state())

        on_every_rank(self.comm, open_sharded)
        reader, checkpoint = opened["reader"], opened["checkpoint"]
        saved = checkpoint.pop("zero_checkpoint", None)
        if saved is None:
            raise CheckpointError(f"{checkpoint_path} has no zero_checkpoint entry in its trainer state: it was not "
                                  "written by ZeroStrategy.")
        checkpoint["state_dict"] = {}  # loaded from the rank files by load_model_state_dict
        if saved["optimizers"] is not None:
            checkpoint["optimizer_states"] = [{} for _ in saved["optimizers"]]
        checkpoint[_SHARDED] = (reader, saved)
        return checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        if _SHARDED in checkpoint:
            reader, saved = checkpoint[_SHARDED]
            return on_every_rank(self.comm, lambda: load_model(
                reader, saved, self.lightning_module, self._sharder.groups if self._sharder else [], strict))
        if self._sharder is None or self.config.stage < 3:
            return super().load_model_state_dict(checkpoint, strict=strict)
        self._sharder.load_full_state_dict(checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.lightning_module is not None
        if _SHARDED in checkpoint:
            reader, saved = checkpoint[_SHARDED]
            return on_every_rank(self.comm, lambda: load_optimizers(reader, saved, self.lightning_module,
                                                                        self._zero_optimizers))
        if "deepspeed" in checkpoint:  # DeepSpeed kept the trainable parameters only: numbered by name
            if len(self.optimizers) != 1:
                raise CheckpointError(f"a DeepSpeed checkpoint holds one optimizer, configure_optimizers gives "
                                      f"{len(self.optimizers)}; load it into a module with one optimizer.")
            names = parameter_names(self.lightning_module)
            groups = [[names[p] for p in g["params"]] for g in self.optimizers[0].param_groups]
            checkpoint = {**checkpoint, "optimizer_states": [align_optimizer_state(checkpoint, groups)]}
        super().load_optimizer_state_dict(checkpoint)
        on_every_rank(self.comm, lambda: masters_from_state_dict(checkpoint["state_dict"], self.lightning_module,
                                                                 self._zero_optimizers))

    @property
    def _zero_optimizers(self) -> list[ZeroOptimizer]:
        return [opt for opt in self.optimizers if isinstance(opt, ZeroOptimizer)]

    def memory_stats(self) -> dict[str, int]:
        """This rank's bytes in params, grads, optimizer_states and master_params (and total)."""
        assert self.lightning_module is not None
        return memory_stats(self.lightning_module, self.optimizers)

    def teardown(self) -> None:
        for opt in self.optimizers:
            if isinstance(opt, ZeroOptimizer):
                opt.remove_hooks()
        super().teardown()  # at stage 3 the model stays sharded, ready for test or predict

    # ---- collectives Lightning uses (logging with sync_dist, metrics, callbacks) -------------

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src)
        return holder[0]

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
        from . import register_strategy_names

        register_strategy_names(strategy_registry, cls)
