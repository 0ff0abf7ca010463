"""Sharded checkpoint save and load: time and bytes written per rank, against one gathered file.

    python benchmarks/bench_checkpoint.py                       # 100M parameters, 2 ranks, stages 2 and 3
    python benchmarks/bench_checkpoint.py --params-millions 20 --stages 3 --json out.json
    python benchmarks/bench_checkpoint.py --params-millions 1 --layers 4 --repeats 1   # a quick check that it runs

A stack of square Linear layers trained one AdamW step (so the optimizer holds its moments), then:
- sharded save: ``save_sharded`` (every rank writes its pieces: weights, optimizer state);
- sharded load: a fresh model and optimizer at the same stage read their ranges back;
- full save: the whole state gathered on every rank (``full_state_dict`` + the optimizer's
  consolidated state dict) and written by rank 0 with ``torch.save``, what ``state_dict_type="full"`` does;
- what the checksums cost (see [Note: checksums]): sharded saves with and without them, interleaved
  (on, off, then off, on, ...) so that drift in the machine's load falls on both alike, each into a
  fresh directory; and loads of one checkpoint with ``verify=True`` and ``verify=False``. Medians,
  their ratio, and the median of each pair's quotient ("paired": steadier where the machine's
  writeback comes and goes).
Runs on gloo processes on CPU (the files go to --dir, by default a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from zero_strategy import ZeroConfig, ZeroOptimizer, gathered_parameters
from zero_strategy.checkpoint import CheckpointReader, load_model, load_optimizers, save_sharded
from zero_strategy.checkpoint.sharded import flat_groups
from zero_strategy.engine import Collectives, shard_module


def build(stage: int, width: int, layers: int):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    config = ZeroConfig(stage=stage, shard_modules=("Linear",))
    user_opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sharder = shard_module(model, config) if stage == 3 else None
    return model, ZeroOptimizer(user_opt, config, sharder=sharder), sharder


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def checksum_costs(rank: int, stage: int, model, opt, sharder, args: argparse.Namespace) -> dict:
    """Median save time with and without checksums, and load time with and without verifying them,
    measured in interleaved pairs."""
    times: dict[str, list[float]] = {"save_on": [], "save_off": [], "load_on": [], "load_off": []}
    checkpoint = {"global_step": 1, "optimizer_states": [{}]}
    for i in range(args.repeats):
        for checksums in ((True, False) if i % 2 == 0 else (False, True)):
            path = Path(args.dir) / f"stage{stage}-checksums-{checksums}-{i}.ckpt"
            times["save_on" if checksums else "save_off"].append(timed(lambda: save_sharded(
                path, checkpoint, model, [opt], sharder, Collectives(), stage, checksums=checksums)))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path)
    path = Path(args.dir) / f"stage{stage}.ckpt"  # written with checksums by rank_main, loaded back into the same model

    def load(verify: bool) -> None:
        reader = CheckpointReader(path, verify=verify)
        saved = reader.trainer_state()["zero_checkpoint"]
        load_model(reader, saved, model, flat_groups([opt], sharder))
        load_optimizers(reader, saved, model, [opt])

    for i in range(args.repeats):
        for verify in ((True, False) if i % 2 == 0 else (False, True)):
            times["load_on" if verify else "load_off"].append(timed(lambda: load(verify)))
    medians = {key: statistics.median(values) for key, values in times.items()}

    def paired(kind: str) -> float:  # the median of each pair's quotient: the pair shares the machine's state
        return statistics.median(a / b for a, b in zip(times[f"{kind}_on"], times[f"{kind}_off"]))

    return {**medians, "save_ratio": medians["save_on"] / medians["save_off"], "save_paired": paired("save"),
            "load_ratio": medians["load_on"] / medians["load_off"], "load_paired": paired("load")}


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = []
    for stage in args.stages:
        model, opt, sharder = build(stage, args.width, args.layers)
        model(torch.randn(4, args.width)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        path = Path(args.dir) / f"stage{stage}.ckpt"
        checkpoint = {"global_step": 1, "optimizer_states": [{}]}
        save_s = timed(lambda: save_sharded(path, checkpoint, model, [opt], sharder, Collectives(), stage))
        written = (path / f"rank_{rank:05d}.safetensors").stat().st_size
        del model, opt, sharder
        model, opt, sharder = build(stage, args.width, args.layers)

        def load():
            reader = CheckpointReader(path)
            saved = reader.trainer_state()["zero_checkpoint"]
            load_model(reader, saved, model, flat_groups([opt], sharder))
            load_optimizers(reader, saved, model, [opt])

        load_s = timed(load)
        full_file = Path(args.dir) / f"stage{stage}-full.pt"

        def full_save():
            with gathered_parameters(model):
                state = {"state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
                         "optimizer_states": [opt.state_dict()]}
            if rank == 0:
                torch.save(state, full_file)

        full_s = timed(full_save)
        costs = checksum_costs(rank, stage, model, opt, sharder, args)
        results.append({"stage": stage, "save_s": save_s, "load_s": load_s, "bytes_rank": written,
                        "full_save_s": full_s, "full_bytes": full_file.stat().st_size if rank == 0 else 0,
                        "checksums": costs})
        del model, opt, sharder
    queue.put((rank, results))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params-millions", type=float, default=100.0)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="interleaved pairs of saves (and loads) with and without checksums")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    args.width = int((args.params_millions * 1e6 / args.layers) ** 0.5)
    n_params = args.layers * (args.width * args.width + args.width)
    with tempfile.TemporaryDirectory() as tmp:
        args.dir = args.dir or tmp
        ctx = mp.get_context("spawn")
        queue = ctx.SimpleQueue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [ctx.Process(target=rank_main, args=(r, args.world_size, port, args, queue))
                 for r in range(args.world_size)]
        for p in procs:
            p.start()
        by_rank = dict(queue.get() for _ in procs)
        for p in procs:
            p.join()
    print(f"{n_params / 1e6:.1f}M parameters (fp32, AdamW: {n_params * 12 / 2**20:.0f} MiB of model and optimizer "
          f"state), {args.world_size} gloo ranks")
    print("| stage | sharded save | sharded load | MiB written per rank | full save (gather + rank 0 writes) | full file MiB |")
    print("|---|---|---|---|---|---|")
    rows = []
    for i, stage in enumerate(args.stages):
        row = by_rank[0][i]
        per_rank = [by_rank[r][i]["bytes_rank"] / 2**20 for r in range(args.world_size)]
        rows.append({**row, "mib_per_rank": per_rank})
        print(f"| {stage} | {row['save_s']:.2f} s | {row['load_s']:.2f} s | {' / '.join(f'{m:.0f}' for m in per_rank)} "
              f"| {row['full_save_s']:.2f} s | {row['full_bytes'] / 2**20:.0f} |")
    print(f"\nWhat the checksums cost: medians of {args.repeats} interleaved pairs (rank 0's time, between barriers)")
    print("| stage | save, checksums | save, none | save ratio | paired | load, verify | load, verify=False "
          "| load ratio | paired |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        c = row["checksums"]
        print(f"| {row['stage']} | {c['save_on']:.3f} s | {c['save_off']:.3f} s | {c['save_ratio']:.3f}x "
              f"| {c['save_paired']:.3f}x | {c['load_on']:.3f} s | {c['load_off']:.3f} s | {c['load_ratio']:.3f}x "
              f"| {c['load_paired']:.3f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"params": n_params, "world_size": args.world_size, "rows": rows},
                                              indent=1))


if __name__ == "__main__":
    main()
