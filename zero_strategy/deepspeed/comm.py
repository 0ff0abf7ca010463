"""``deepspeed.comm``: the collectives and queries scripts call as ``deepspeed.comm.get_rank()``,
``from deepspeed import comm as dist``, on top of torch.distributed.

[Note: deepspeed.comm on torch.distributed]
Each function is torch.distributed's of the same name, with DeepSpeed's signature: the keywords it
adds for its comms logger (``prof``, ``log_name``, ``debug``) are accepted and do nothing (this
package counts its bytes itself: ``engine.comm_stats()``), and a call before the process group
exists says to call ``init_distributed()`` first (torch's would say "Default process group has not
been initialized"). ``get_local_rank()`` is the launcher's ``$LOCAL_RANK``, as DeepSpeed reads it.
``ReduceOp`` is torch's, which has DeepSpeed's members (SUM, AVG, PRODUCT, MIN, MAX, ...).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Optional

import torch.distributed as _dist
from torch.distributed import ReduceOp  # noqa: F401 - re-exported, as deepspeed.comm.ReduceOp

from .launch import init_distributed  # noqa: F401 - re-exported

_LOGGER_KEYWORDS = ("prof", "log_name", "debug", "use_caller_info")
_QUERIES = ("get_rank", "get_world_size", "get_global_rank", "get_backend", "new_group", "destroy_process_group",
            "get_process_group_ranks")
_COLLECTIVES = ("broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                "reduce_scatter_tensor", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv",
                "isend", "irecv", "barrier", "monitored_barrier", "broadcast_object_list", "all_gather_object",
                "gather_object", "scatter_object_list", "batch_isend_irecv")

__all__ = ["ReduceOp", "allgather_fn", "get_local_rank", "get_world_group", "has_all_gather_into_tensor",
           "has_reduce_scatter_tensor", "init_distributed", "is_available", "is_initialized", "reduce_scatter_fn",
           *_QUERIES, *_COLLECTIVES]

P2POp = _dist.P2POp


def is_available() -> bool:
    return _dist.is_available()


def is_initialized() -> bool:
    return _dist.is_available() and _dist.is_initialized()


def _need_group(name: str) -> None:
    if not is_initialized():
        raise RuntimeError(f"deepspeed.comm.{name}(): no process group is running yet; call "
                           "zero_strategy.init_distributed() (deepspeed.init_distributed()) or initialize() first.")


def _torch_call(name: str) -> Callable[..., Any]:
    target = getattr(_dist, name)

    @functools.wraps(target)
    def call(*args: Any, **kwargs: Any) -> Any:
        for keyword in _LOGGER_KEYWORDS:
            kwargs.pop(keyword, None)
        _need_group(name)
        return target(*args, **kwargs)

    call.__doc__ = f"torch.distributed.{name}, with DeepSpeed's signature (see [Note: deepspeed.comm on torch.distributed])."
    return call


for _name in (*_QUERIES, *_COLLECTIVES):
    globals()[_name] = _torch_call(_name)
del _name


def get_local_rank() -> int:
    """This process's index on its machine, as the launcher set it ($LOCAL_RANK, else 0)."""
    _need_group("get_local_rank")
    from .launch import local_rank

    return local_rank(os.environ)


def get_world_group() -> Any:
    _need_group("get_world_group")
    return _dist.group.WORLD


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def allgather_fn(output_tensor: Any, input_tensor: Any, group: Optional[Any] = None, async_op: bool = False,
                 debug: Any = None) -> Any:
    """DeepSpeed's flat all-gather: ``input_tensor`` of every rank, in rank order, into ``output_tensor``."""
    _need_group("allgather_fn")
    return _dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor: Any, tensor: Any, op: Any = ReduceOp.SUM, group: Optional[Any] = None,
                      async_op: bool = False, prof: bool = False, debug: Any = None) -> Any:
    """DeepSpeed's flat reduce-scatter: ``tensor`` summed (``op``) over the ranks, this rank's part into
    ``output_tensor``."""
    _need_group("reduce_scatter_fn")
    return _dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)
