"""Run a function on N gloo processes and collect what each returns."""

from __future__ import annotations

import io
import os
import socket
import traceback

import torch

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        torch.set_num_threads(1)  # two ranks on two cores: more threads only contend
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = io.BytesIO()  # tensors pickled through a queue would point into a dead process
        torch.save(fn(rank, world_size, *args), result)
        queue.put((rank, result.getvalue(), None))
    except BaseException:  # noqa: BLE001 - shipped to the parent, which re-raises
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int = 2, *args):
    """``fn(rank, world_size, *args)`` on ``world_size`` processes; returns the results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    for _ in procs:
        rank, value, error = queue.get()
        results[rank] = None if value is None else torch.load(io.BytesIO(value), weights_only=True)
        if error:
            errors.append(f"rank {rank}:\n{error}")
    for p in procs:
        p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
