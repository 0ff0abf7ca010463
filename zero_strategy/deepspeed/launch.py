"""``init_distributed``: the process group started as ``deepspeed.init_distributed`` starts it.

[Note: where the ranks come from]
In this order: a process group that already exists (started by the user, Lightning or an earlier
call) is used as it is; torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT: all five, or an error naming the missing ones); SLURM's (SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID, the first host of SLURM_NODELIST as the address, MASTER_PORT or ``distributed_port``),
unless the job is an interactive allocation (job name ``bash`` or ``interactive``, as Lightning reads
it: there the user starts the processes); and with none of these, a world of one process, which
needs no address or port. DeepSpeed's other route, MPI discovery through mpi4py, is not taken: a
process started by mpirun without torchrun's variables is told to use torchrun or srun.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

__all__ = ["DEFAULT_PORT", "Launch", "default_backend", "discover_launch", "init_distributed", "local_rank"]

log = logging.getLogger(__name__)

DEFAULT_PORT = 29500  # DeepSpeed's TORCH_DISTRIBUTED_DEFAULT_PORT
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_MPI_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_LOCALNRANKS")
_INTERACTIVE_SLURM_JOBS = ("bash", "interactive")


@dataclass(frozen=True)
class Launch:
    """Who this process is, as the launcher said (see [Note: where the ranks come from])."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: Optional[str]  # None: a world of one, which needs no rendezvous
    master_port: Optional[int]
    launcher: str  # "torchrun", "slurm" or "none"


def _integer(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"init_distributed(): ${name}={value!r} is not an integer; the launcher sets it (torchrun or "
                         "srun), so unset it or fix it.") from None
    if number < 0:
        raise ValueError(f"init_distributed(): ${name}={number} must not be negative.")
    return number


def discover_launch(environ: Mapping[str, str] = os.environ, distributed_port: int = DEFAULT_PORT) -> Launch:
    """Ranks and rendezvous from the launcher's variables (see [Note: where the ranks come from]).
    Pure: reads ``environ`` only."""
    given = [name for name in TORCHRUN_VARIABLES if name in environ]
    if given:
        missing = [name for name in TORCHRUN_VARIABLES if name not in environ]
        if missing:
            raise RuntimeError(f"init_distributed(): the environment sets {', '.join('$' + n for n in given)} but not "
                               f"{', '.join('$' + n for n in missing)}; launch with torchrun (which sets all of "
                               f"{', '.join(TORCHRUN_VARIABLES)}), or set the missing ones.")
        rank, world_size = _integer(environ, "RANK"), _integer(environ, "WORLD_SIZE")
        launch = Launch(rank, world_size, _integer(environ, "LOCAL_RANK"), environ["MASTER_ADDR"],
                        _integer(environ, "MASTER_PORT"), "torchrun")
    elif "SLURM_NTASKS" in environ and environ.get("SLURM_JOB_NAME") not in _INTERACTIVE_SLURM_JOBS:
        from lightning.fabric.plugins.environments import SLURMEnvironment

        nodes = environ.get("SLURM_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        address = environ.get("MASTER_ADDR") or (SLURMEnvironment.resolve_root_node_address(nodes) if nodes else None)
        if address is None:
            raise RuntimeError("init_distributed(): SLURM sets $SLURM_NTASKS but neither $SLURM_NODELIST nor "
                               "$MASTER_ADDR, so the first node's address is unknown; set $MASTER_ADDR.")
        port = _integer(environ, "MASTER_PORT") if "MASTER_PORT" in environ else distributed_port
        launch = Launch(_integer(environ, "SLURM_PROCID"), _integer(environ, "SLURM_NTASKS"),
                        _integer(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0, address, port,
                        "slurm")
        rank, world_size = launch.rank, launch.world_size
    else:
        mpi = [name for name in _MPI_VARIABLES if name in environ]
        if mpi and int(environ.get(mpi[0], "1") or 1) > 1:
            raise RuntimeError(f"init_distributed(): this process was started by MPI (${mpi[0]}={environ[mpi[0]]}) "
                               "without torchrun's variables; MPI discovery is not supported. Launch with torchrun "
                               "--nproc-per-node N script.py (or srun on SLURM).")
        return Launch(0, 1, 0, None, None, "none")
    if not 0 <= rank < world_size:
        raise ValueError(f"init_distributed(): rank {rank} is outside the world of {world_size} processes the "
                         f"{launch.launcher} variables give; check the launcher's settings.")
    return launch


def local_rank(environ: Mapping[str, str] = os.environ) -> int:
    """This process's index on its machine: $LOCAL_RANK (torchrun), else $SLURM_LOCALID, else 0."""
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        if name in environ:
            return _integer(environ, name)
    return 0


def default_backend() -> str:
    """The accelerator's: NCCL on CUDA, gloo on the CPU (see [Note: which accelerator] in deepspeed/accelerator.py)."""
    from .accelerator import get_accelerator

    return get_accelerator().communication_backend_name()


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = DEFAULT_PORT, verbose: bool = True,
                     timeout: Union[timedelta, float] = timedelta(minutes=30), init_method: Optional[str] = None,
                     dist_init_required: Optional[bool] = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Start torch.distributed's default process group, as ``deepspeed.init_distributed`` does.

    A no-op when one exists already (a different ``dist_backend`` than the running group's is an
    error). Otherwise the ranks come from torchrun's or SLURM's variables, or make a world of one
    (see [Note: where the ranks come from]); ``rank`` and ``world_size`` (when >= 0) override
    them, as with DeepSpeed. ``dist_backend`` defaults to NCCL with CUDA and gloo without.
    ``timeout`` is the process group's (a timedelta or seconds; DeepSpeed's default, 30 minutes).
    ``auto_mpi_discovery`` and ``config`` are accepted for DeepSpeed's signature; MPI discovery is
    not done (an MPI launch without torchrun's variables is an error saying what to use).
    """
    if dist.is_available() and dist.is_initialized():
        running = dist.get_backend()
        if dist_backend is not None and dist_backend != running:
            raise ValueError(f"init_distributed(dist_backend={dist_backend!r}): the process group is already running "
                             f"on {running!r}; drop dist_backend, or start no group before this call.")
        return
    if dist_init_required is False:
        raise RuntimeError("init_distributed(dist_init_required=False): no process group is running, so there is "
                           "nothing to use; start one first (torch.distributed.init_process_group), or pass "
                           "dist_init_required=None to start it here.")
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        timeout = timedelta(seconds=timeout)
    if not isinstance(timeout, timedelta):
        raise ValueError(f"init_distributed(timeout={timeout!r}): give a datetime.timedelta or a positive number of "
                         "seconds.")
    launch = discover_launch(os.environ, distributed_port)
    rank = launch.rank if rank < 0 else rank
    world_size = launch.world_size if world_size < 0 else world_size
    backend = dist_backend or default_backend()
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("init_distributed(dist_backend='nccl') needs CUDA, which this machine lacks; use 'gloo' "
                             "(the default without CUDA).")
        torch.cuda.set_device(launch.local_rank)
    if launch.master_addr is None and world_size == 1 and init_method is None:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        if launch.master_addr is not None:  # SLURM's, for init_method env:// (torchrun's are there already)
            os.environ.update(MASTER_ADDR=launch.master_addr, MASTER_PORT=str(launch.master_port), RANK=str(rank),
                              WORLD_SIZE=str(world_size), LOCAL_RANK=str(launch.local_rank))
        elif init_method is None:
            raise RuntimeError(f"init_distributed(world_size={world_size}): no launcher variables say where rank 0 "
                               "listens; launch with torchrun, or pass init_method (e.g. 'tcp://host:29500').")
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    if verbose and rank == 0:
        log.info("init_distributed: %d process(es) on %s (%s)", world_size, backend, launch.launcher)
