"""gloo's collectives on one host against other ways to run them: the engine's reduce-scatter (an
all-to-all and a sum: see [Note: reduce-scatter on gloo] in zero_strategy/engine/comm/collectives.py)
against gloo's own and an all-reduce, and gloo's all-gather against one broadcast from each rank.

    python benchmarks/bench_gloo_collectives.py [--world 2,4] [--mib 1,8,32,128] [--repeats 8]

For each world size and buffer size (MiB of fp32, the reduce-scatter's input and the all-gather's
output), the ranks time, taking turns (barrier before each call), median over ``--repeats``:

- ``reduce_scatter``: ``dist.reduce_scatter_tensor``;
- ``all_reduce+copy``: an in-place all-reduce, then a copy of this rank's chunk (the engine on gloo
  until 2026-12-02);
- ``all_to_all+sum``: an all-to-all into a receive buffer, then the sum of its rows (the engine on gloo);
- ``all_gather``: ``dist.all_gather_into_tensor``;
- ``broadcasts``: each rank's chunk broadcast from it into the output, all issued together. Faster
  here, one thread per rank, but 3-10x slower than ``all_gather`` once ranks share cores with
  compute threads (benchmarks/RESULTS.md, 2026-12-02), so the engine keeps gloo's all-gather.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank: int, world: int, port: int, numel: int, repeats: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    chunk = numel // world
    inp, out_chunk = torch.randn(numel), torch.empty(chunk)
    full, shard = torch.empty(numel), torch.randn(chunk)

    def all_reduce_copy() -> None:
        dist.all_reduce(inp)
        out_chunk.copy_(inp[rank * chunk:(rank + 1) * chunk])

    def broadcasts() -> None:
        full[rank * chunk:(rank + 1) * chunk].copy_(shard)
        works = [dist.broadcast(full[r * chunk:(r + 1) * chunk], r, async_op=True) for r in range(world)]
        for w in works:
            w.wait()

    received = torch.empty(world, chunk)

    def all_to_all_sum() -> None:
        dist.all_to_all_single(received.view(-1), inp)
        torch.sum(received, 0, out=out_chunk)

    variants = {"reduce_scatter": lambda: dist.reduce_scatter_tensor(out_chunk, inp),
                "all_reduce+copy": all_reduce_copy,
                "all_to_all+sum": all_to_all_sum,
                "all_gather": lambda: dist.all_gather_into_tensor(full, shard),
                "broadcasts": broadcasts}
    times = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    if rank == 0:
        out.put({name: statistics.median(t) for name, t in times.items()})
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", default="2,4")
    parser.add_argument("--mib", default="1,8,32,128")
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    print(f"gloo, one host, 1 thread per rank; torch {torch.__version__}; median ms of {args.repeats} calls")
    print("| ranks | MiB | reduce_scatter | all_reduce+copy | ratio | all_to_all+sum | ratio | all_gather | broadcasts | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ctx = mp.get_context("spawn")
    for world in map(int, args.world.split(",")):
        for mib in map(int, args.mib.split(",")):
            queue = ctx.SimpleQueue()
            mp.start_processes(run, args=(world, _free_port(), mib * 2**18, args.repeats, queue), nprocs=world,
                               start_method="spawn")
            t = {k: v * 1e3 for k, v in queue.get().items()}
            print(f"| {world} | {mib} | {t['reduce_scatter']:.1f} | {t['all_reduce+copy']:.1f} | "
                  f"{t['reduce_scatter'] / t['all_reduce+copy']:.2f}x | {t['all_to_all+sum']:.1f} | "
                  f"{t['all_to_all+sum'] / t['all_reduce+copy']:.2f}x | {t['all_gather']:.1f} | {t['broadcasts']:.1f} | "
                  f"{t['all_gather'] / t['broadcasts']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
