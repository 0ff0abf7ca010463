"""What ``initialize`` assembles before the engine exists: the config, the device, the optimizer,
the LR scheduler and the training DataLoader, each accepted in the forms DeepSpeed accepts.

Every refusal names the argument of ``initialize`` it is about and what to pass instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from ..engine import Collectives
from ..optimizers import DeepSpeedMuon
from .accelerator import get_accelerator
from .arguments import config_from_arguments
from .config import DeepSpeedSettings
from .keys import DeepSpeedConfigError, is_auto, load_deepspeed_config

log = logging.getLogger(__name__)


def resolve_config(config: Any, config_params: Any, args: Any) -> dict:
    """The DeepSpeed config from ``config``, the older ``config_params``, or ``args.deepspeed_config``
    (DeepSpeed's command-line route), as a dict: see [Note: where initialize finds the config]."""
    chosen = config_from_arguments(config, config_params, args)
    if chosen is None:
        raise DeepSpeedConfigError("initialize() needs a DeepSpeed config: pass config= a dict or the path of a JSON "
                                   'file, e.g. config={"train_micro_batch_size_per_gpu": 8, "zero_optimization": '
                                   '{"stage": 2}}, or args with --deepspeed_config ds.json (add_config_arguments).')
    loaded = load_deepspeed_config(chosen)
    autos = list(_auto_keys(loaded))
    if autos:
        raise DeepSpeedConfigError(f"initialize(): {', '.join(autos)} = 'auto', which Hugging Face's Trainer fills in "
                                   "before it calls DeepSpeed; no Trainer runs here, so give each a value.")
    return loaded


def _auto_keys(section: Mapping, prefix: str = "") -> Iterable[str]:
    for key, value in section.items():
        path = f"{prefix}.{key}" if prefix else key
        if is_auto(value):
            yield path
        elif isinstance(value, Mapping):
            yield from _auto_keys(value, path)


def check_batch_sizes(settings: DeepSpeedSettings) -> None:
    """DeepSpeed refuses a config without a batch size; so does ``initialize`` (the engine reports
    them, and ``training_data`` is batched by the micro batch)."""
    if settings.train_micro_batch_size_per_gpu is None:
        raise DeepSpeedConfigError("initialize(): the config gives neither train_batch_size nor "
                                   "train_micro_batch_size_per_gpu (DeepSpeed requires one); add e.g. "
                                   '"train_micro_batch_size_per_gpu": 8.')


def engine_device(local_rank: int) -> torch.device:
    """``cuda:<local_rank>`` on the CUDA accelerator, else the CPU (see [Note: which accelerator] in
    deepspeed/accelerator.py: ``DS_ACCELERATOR=cpu`` trains on the CPU on a machine with GPUs)."""
    if get_accelerator()._name != "cuda":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(f"initialize(): this is local rank {local_rank} but the machine shows {count} CUDA "
                           "device(s); start at most one process per device (torchrun --nproc-per-node).")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def build_optimizer(module: nn.Module, optimizer: Any, model_parameters: Any,
                    settings: DeepSpeedSettings) -> Optional[torch.optim.Optimizer]:
    """The user's optimizer: ``optimizer`` itself, or ``optimizer(model_parameters)`` for a callable,
    else the config's ``"optimizer"`` section over ``model_parameters`` (all of the module's by
    default); None when neither gives one (an engine for evaluation only)."""
    params = list(module.parameters() if model_parameters is None else model_parameters)
    if not params:
        raise ValueError("initialize(model_parameters=...) holds no parameters; pass model.parameters(), or param "
                         "groups such as [{'params': [...], 'weight_decay': 0.1}].")
    if isinstance(optimizer, torch.optim.Optimizer):
        if settings.optimizer is not None:  # DeepSpeed uses the client's too, and says so
            log.warning("initialize(optimizer=%s): the config's \"optimizer\" section (%s) is not used",
                        type(optimizer).__name__, settings.optimizer.optimizer_class.__name__)
        built = optimizer
    elif optimizer is not None:
        if not callable(optimizer):
            raise TypeError(f"initialize(optimizer={optimizer!r}): give a torch.optim.Optimizer, or a callable that "
                            "takes model_parameters and returns one.")
        built = optimizer(params)
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(f"initialize(optimizer=...): the callable returned {type(built).__name__}, not a "
                            "torch.optim.Optimizer; return one built over the parameters it is given.")
    elif settings.optimizer is not None:  # Muon's clips its updates (see [Note: DeepSpeed's Muon configuration])
        built = settings.optimizer(params, module=module, gradient_clipping=muon_clipping(settings))
    else:
        return None
    if isinstance(built, DeepSpeedMuon) and built.gradient_clipping != muon_clipping(settings):
        raise ValueError(f"initialize(optimizer=DeepSpeedMuon(..., gradient_clipping={built.gradient_clipping})): at "
                         "ZeRO stages 1-3 it clips its updates itself, as DeepSpeed's Muon does, with the config's "
                         f"gradient_clipping, {settings.clipping()} here (1.0 when the config is silent; at stage 0 the "
                         "engine clips the gradients and the optimizer nothing); pass "
                         f"gradient_clipping={muon_clipping(settings)} to DeepSpeedMuon, or change the config's.")
    return built


def muon_clipping(settings: DeepSpeedSettings) -> float:
    """What ``DeepSpeedMuon`` clips its updates to: the config's ``gradient_clipping`` at ZeRO stages 1-3, as
    DeepSpeed's do; at stage 0 DeepSpeed clips the gradients (the engine here) and Muon nothing."""
    return settings.clipping() if int(settings.strategy.get("stage", 0)) >= 1 else 0.0  # over the model's own parameters: checked by setup_engine, as for every front end


def build_scheduler(lr_scheduler: Any, user_optimizer: Optional[torch.optim.Optimizer],
                    optimizer: Optional[torch.optim.Optimizer], settings: DeepSpeedSettings) -> Any:
    """The LR scheduler: ``lr_scheduler`` itself (built on the optimizer passed to ``initialize``),
    or ``lr_scheduler(optimizer)`` for a callable, else the config's ``"scheduler"`` section; None
    without an optimizer. ``optimizer`` is the engine's (sharing the user's param groups)."""
    if lr_scheduler is None:
        if settings.scheduler is None or optimizer is None:
            return None
        return settings.scheduler(optimizer)
    if optimizer is None:
        raise ValueError("initialize(lr_scheduler=...) without an optimizer: pass optimizer=, or an \"optimizer\" "
                         "section in the config, for the scheduler to drive.")
    if settings.scheduler is not None:
        log.warning("initialize(lr_scheduler=...): the config's \"scheduler\" section (%s) is not used",
                    settings.scheduler.scheduler_class.__name__)
    if hasattr(lr_scheduler, "step") and hasattr(lr_scheduler, "state_dict"):  # an object: built already
        bound = getattr(lr_scheduler, "optimizer", None)
        if bound is not user_optimizer or user_optimizer is None:
            raise ValueError("initialize(lr_scheduler=...) is a scheduler built on another optimizer than the one "
                             "passed as initialize(optimizer=...); build it on that optimizer, or pass a callable "
                             "(lr_scheduler=lambda opt: ...) that builds it on the engine's.")
        lr_scheduler.optimizer = optimizer  # the same param groups; its step check reads this one's flag
        return lr_scheduler
    if not callable(lr_scheduler):
        raise TypeError(f"initialize(lr_scheduler={lr_scheduler!r}): give an LR scheduler or a callable that takes "
                        "the optimizer and returns one.")
    return lr_scheduler(optimizer)


def build_dataloader(training_data: Any, collate_fn: Optional[Callable], settings: DeepSpeedSettings,
                     comm: Collectives, device: torch.device) -> Optional[DataLoader]:
    """``training_data`` batched by ``train_micro_batch_size_per_gpu``, each rank its own part
    (DistributedSampler, shuffled with seed 0 as DeepSpeed's; call ``loader.sampler.set_epoch(e)`` to
    draw a new order each epoch, which DeepSpeed's loader does not do)."""
    if training_data is None:
        return None
    if isinstance(training_data, IterableDataset) or not isinstance(training_data, Dataset):
        raise TypeError(f"initialize(training_data=...) is a {type(training_data).__name__}; it must be a map-style "
                        "torch Dataset (__len__ and __getitem__), which a DistributedSampler splits over the ranks. "
                        "For another kind, build your own DataLoader.")
    sampler = DistributedSampler(training_data, num_replicas=comm.world_size, rank=comm.rank)
    return DataLoader(training_data, batch_size=settings.train_micro_batch_size_per_gpu, sampler=sampler,
                      collate_fn=collate_fn, drop_last=settings.dataloader_drop_last,
                      pin_memory=device.type == "cuda")
