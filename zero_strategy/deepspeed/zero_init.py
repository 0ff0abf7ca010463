"""``deepspeed.zero``: ``Init`` (a model built sharded) and ``GatheredParameters``.

[Note: zero.Init on the meta device]
DeepSpeed's ``zero.Init`` partitions each parameter as its module is built. Here the same effect
comes from the init context the strategies open around ``configure_model``, ``sharded_init``
(pretrained.py): inside ``with zero.Init():`` the construction is recorded on the meta device (no
storage; see [Note: recorded construction] in engine/params/deferred_init.py) and ``from_pretrained``
attaches its files instead of reading them, and ``initialize`` at stage 3 materialises the model
unit by unit into the shards, so the whole model never exists on any rank. A model built inside
gets the weights an eager build on the same seed draws (the recorded construction is replayed);
one loaded with ``from_pretrained`` gets the files' weights, each rank reading its own ranges.
DeepSpeed draws at construction and broadcasts rank 0's, so the weights equal its run only where
the ranks' seeds agree. Only stage 3 builds on the meta device: a config of another stage given to
``Init`` is an error, and ``initialize`` at stages 0-2 names the meta tensors of a model built
inside it.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterable, Optional, Union

import torch
from torch import nn

from ..engine.params.flat_parameters import gathered_parameters
from ..pretrained import sharded_init

__all__ = ["GatheredParameters", "Init"]

log = logging.getLogger(__name__)


def _stage_of(config: Any) -> Optional[int]:
    if config is None:
        return None
    from .keys import load_deepspeed_config

    loaded = load_deepspeed_config(config)
    zero = loaded.get("zero_optimization") or {}
    return int(zero.get("stage", 0)) if isinstance(zero, dict) else None


class Init(contextlib.ContextDecorator):
    """Record the model built inside this block on the meta device (``from_pretrained`` included), for
    ``initialize`` at stage 3 to materialise sharded (see [Note: zero.Init on the meta device]). ``enabled=False`` builds it as
    usual. DeepSpeed's other arguments (groups, ``mem_efficient_linear``, ``pin_memory``, ``dtype``,
    ...) are accepted; ``remote_device`` other than None / "none" is refused (offload is the config's
    ``zero_optimization.offload_param``), and so are ``mpu`` and parameter-parallel groups."""

    def __init__(self, module: Optional[nn.Module] = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: Optional[str] = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: Optional[torch.dtype] = None, mpu: Any = None, zero_param_parallel_group: Any = None,
                 **other: Any) -> None:
        if remote_device not in (None, "none"):
            raise ValueError(f"zero.Init(remote_device={remote_device!r}): parameters are offloaded by the config here; "
                             'set "zero_optimization": {"offload_param": {"device": "cpu"}} and drop remote_device.')
        if mpu is not None or zero_param_parallel_group is not None:
            raise ValueError("zero.Init(mpu=..., zero_param_parallel_group=...): model parallelism and parameter-"
                             "parallel groups are not supported; this package is data parallel (ZeRO) only.")
        stage = _stage_of(config_dict_or_path if config_dict_or_path is not None else config)
        if enabled and stage is not None and stage != 3:
            raise ValueError(f"zero.Init(): the config is ZeRO stage {stage}, but only stage 3 builds the model "
                             "sharded; pass enabled=(stage == 3), as DeepSpeed's examples do.")
        self.enabled = enabled
        self._context: Optional[contextlib.AbstractContextManager] = None
        if module is not None and enabled:
            log.warning("zero.Init(module=...): the model exists already and is not re-built; initialize() at stage 3 "
                        "shards it as it is (build it inside `with zero.Init():` to never hold it whole).")
            self.enabled = False

    def __enter__(self) -> "Init":
        if self.enabled:
            self._context = sharded_init()
            self._context.__enter__()
        return self

    def __exit__(self, *exc: Any) -> bool:
        if self._context is not None:
            context, self._context = self._context, None
            context.__exit__(*exc)
        return False


@contextlib.contextmanager
def GatheredParameters(params: Union[nn.Parameter, Iterable[nn.Parameter], nn.Module],  # noqa: N802 - DeepSpeed's name
                       modifier_rank: Optional[int] = None, fwd_module: Optional[nn.Module] = None,
                       enabled: bool = True) -> Any:
    """The parameters whole inside the block, on every rank (a collective): ``zero_strategy.
    gathered_parameters``. With ``modifier_rank``, that rank's edits become everyone's when the block
    ends; without it, edits are dropped. A single parameter, a list of them or a module."""
    if not enabled:
        yield
        return
    if isinstance(params, torch.Tensor):
        params = [params]
    with gathered_parameters(params, modifier_rank=modifier_rank):
        yield
