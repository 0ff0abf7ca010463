"""Joining the world of processes, for the Trainer's ZeroStrategy and Fabric's ZeroFabricStrategy alike.

Both strategies start the same way in ``setup_environment``: the seed reset, this process's global
rank and the world size given to the cluster environment (``set_world_ranks``), the process group
started on gloo or NCCL and checked against the launch's layout, the engine's collectives over the
whole world, and the end-of-job checks of [Note: a failed rank fails the job] in frontend/job_end.py
(``join_world``). Lightning's connectors also call the strategies' own ``set_world_ranks`` (the
Trainer's) and ``_set_world_ranks`` (Fabric's) before that; both are this module's.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Optional, Union

from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only

from .engine import Collectives
from .frontend.job_end import watch_the_job
from .frontend.options import check_world_size, process_group_backend


def set_world_ranks(strategy: Any) -> None:
    """``strategy``'s global rank (``node_rank * num_processes + local_rank``) and world size into its
    cluster environment, and its global rank as read back from it into ``rank_zero_only`` (an
    environment's setter may do nothing: the getter is what counts)."""
    env = strategy.cluster_environment
    if env is not None:
        env.set_global_rank(strategy.node_rank * strategy.num_processes + strategy.local_rank)
        env.set_world_size(strategy.num_nodes * strategy.num_processes)
    rank_zero_only.rank = strategy.global_rank  # Lightning's rank_zero_only is this same object


def join_world(strategy: Any, backend: Optional[str], timeout: Union[timedelta, float, None], who: str,
               asks: str, children: Callable[[], list]) -> tuple[str, Collectives]:
    """Start the process group of ``strategy``'s world (a ProcessLayout strategy: ``root_device``,
    ``num_nodes``, ``num_processes``, its cluster environment) on ``backend`` (None: NCCL on CUDA,
    gloo otherwise). ``who`` (the Trainer, Fabric) and ``asks`` (what to launch) name the launch in
    the error for a process group of another size; ``children`` gives the launch's child processes
    for the end-of-job checks. Returns the backend chosen and the engine's collectives over the world."""
    reset_seed()
    set_world_ranks(strategy)
    backend = process_group_backend(backend, strategy.root_device)
    assert strategy.cluster_environment is not None
    _init_dist_connection(strategy.cluster_environment, backend, timeout=timeout)
    check_world_size(strategy.world_size, who, f"(num_nodes={strategy.num_nodes} x devices={strategy.num_processes}); "
                                               f"launch as many processes as {asks}.")
    comm = strategy._world_collectives()
    # a rank that fails fails the job: see [Note: a failed rank fails the job] in frontend/job_end.py
    watch_the_job(children, strategy.node_rank * strategy.num_processes + 1, strategy.config.collective_timeout)
    return backend, comm
