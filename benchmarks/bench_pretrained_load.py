"""Peak resident memory and time of loading a pretrained model at ZeRO stage 3, 2 ranks: today's way
(``from_pretrained`` in ``__init__``: every rank builds and loads the whole model, then shards it)
against the new one (``from_pretrained`` inside ``sharded_init``, the context the strategies open
around ``configure_model``: built on meta, each rank reads the byte ranges of its shards).

    python benchmarks/bench_pretrained_load.py                   # GPT-2 medium-sized: 355M parameters
    python benchmarks/bench_pretrained_load.py --layers 2 --width 256 --vocab 1024   # a quick try
    python benchmarks/bench_pretrained_load.py --rounds 3        # the ways interleaved, 3 rounds

The model is a GPT-2 with random weights saved once with ``save_pretrained`` (fp32 safetensors, in
shards of ``--max-shard-size``, reused from ``--dir``); each way runs in fresh processes (the peak
resident set belongs to a process). Per rank it prints the peak resident set during the load
(``VmHWM`` after ``/proc/self/clear_refs`` reset it; file-backed pages of memory-mapped files
count, as the resident set counts them), over the model's bytes; the model state held right after
(this rank's shards); the peak minus that state, against the largest stage-3 unit plus the largest
piece read at once (the read buffer); and the load time. With ``--rounds R`` the two ways alternate
R times and the last line gives the new way's load time over today's (the slower rank's of each
run), median and range over the rounds. Memory figures hold on a shared machine; times need a quiet
one.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def _gpt2_config(args):
    import transformers

    return transformers.GPT2Config(vocab_size=args.vocab, n_positions=args.positions, n_embd=args.width,
                                   n_layer=args.layers, n_head=max(1, args.width // 64), bos_token_id=0, eos_token_id=0)


def save_model(args) -> Path:
    """A GPT-2 with random weights, saved once (built on meta and filled tensor by tensor: quick)."""
    import transformers

    path = Path(args.dir) / f"gpt2-{args.layers}x{args.width}-v{args.vocab}"
    if (path / "config.json").is_file():
        return path
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(_gpt2_config(args))
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
        for name, b in model.named_buffers():
            if b.is_floating_point():
                b.zero_()
    model.tie_weights()
    model.save_pretrained(path, max_shard_size=args.max_shard_size)
    return path


def _rank(rank: int, world_size: int, port: int, way: str, path: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    import transformers

    from zero_strategy import ZeroConfig, memory_stats, sharded_init
    from zero_strategy.engine import Collectives
    from zero_strategy.frontend.precision import WorkingPrecision
    from zero_strategy.frontend.setup import setup_engine

    def load(where: str):
        if way == "new":
            with sharded_init():
                model = transformers.GPT2LMHeadModel.from_pretrained(where)
        else:
            model = transformers.GPT2LMHeadModel.from_pretrained(where)
        return model, setup_engine(model, ZeroConfig(stage=3), WorkingPrecision(), Collectives(), torch.device("cpu"))

    load(str(Path(path).parent / "tiny"))  # a warm-up: imports and first-call costs out of the figures
    gc.collect()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set starts again from the present one
    before = _kib("VmRSS:")
    start = time.perf_counter()
    model, engine = load(path)
    dist.barrier()
    seconds = time.perf_counter() - start
    peak = (_kib("VmHWM:") - before) * 1024
    held = memory_stats(model)["params"]
    units = [sum(g.layout.numel * g.params[0].element_size() for g in u.groups) for u in engine.sharder.all_units]
    pieces = [piece.numel * g.params[0].element_size() for g in engine.sharder.groups for piece in g.pieces]
    model_bytes = sum(engine.sharder.full_numel[p] * p.element_size() for p in dict.fromkeys(model.parameters()))
    with open(f"{out}/{way}-{rank}.json", "w") as f:
        json.dump({"peak": peak, "held": held, "seconds": seconds, "model_bytes": model_bytes,
                   "largest_unit": max(units), "largest_piece": max(pieces)}, f)
    dist.destroy_process_group()


def run_way(way: str, path: Path, world_size: int = 2) -> list[dict]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(world_size, port, way, str(path), out), nprocs=world_size,
                           start_method="spawn")
        return [json.load(open(f"{out}/{way}-{r}.json")) for r in range(world_size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--positions", type=int, default=1024)
    parser.add_argument("--max-shard-size", default="500MB")
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "zero_bench_pretrained"))
    parser.add_argument("--rounds", type=int, default=1, help="the two ways interleaved this many times")
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # freed buffers leave the resident set
    path = save_model(args)
    if not (Path(args.dir) / "tiny" / "config.json").is_file():  # the warm-up's model
        import transformers
        transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=8, n_layer=1, n_head=1, vocab_size=16,
                                                             n_positions=8, bos_token_id=0, eos_token_id=0)).save_pretrained(Path(args.dir) / "tiny")
    print(f"model: {path} ({sum(f.stat().st_size for f in path.glob('*.safetensors')) / 2**20:.0f} MiB of safetensors)")
    print("| way | rank | peak RSS during load (MiB) | over model bytes | state held after (MiB) | peak - held (MiB) "
          "| largest unit + piece (MiB) | load time (s) |")
    print("|---|---|---|---|---|---|---|---|")
    ratios = []
    for _ in range(args.rounds):
        seconds = {}
        for way in ("today", "new"):
            runs = run_way(way, path)
            seconds[way] = max(r["seconds"] for r in runs)
            for rank, r in enumerate(runs):
                mib = 2**20
                print(f"| {'from_pretrained in __init__' if way == 'today' else 'from_pretrained in sharded_init'} | "
                      f"{rank} | {r['peak'] / mib:.0f} | {r['peak'] / r['model_bytes']:.2f} | {r['held'] / mib:.0f} | "
                      f"{(r['peak'] - r['held']) / mib:.0f} | {(r['largest_unit'] + r['largest_piece']) / mib:.0f} | "
                      f"{r['seconds']:.1f} |")
        ratios.append(seconds["new"] / seconds["today"])
    print(f"load time new / today over {len(ratios)} round(s): median {statistics.median(ratios):.2f}x, "
          f"range {min(ratios):.2f}-{max(ratios):.2f}x")

if __name__ == "__main__":
    main()
