"""Host memory of ``zero-consolidate --hf``: peak resident set against one output shard and the read buffer.

    python benchmarks/bench_hf_export.py                                  # GPT-2 medium (355M), 2 ranks
    python benchmarks/bench_hf_export.py --layers 2 --width 256 --vocab 1024 --shard-sizes 1MB   # a quick check

A GPT-2 (built from a config, random weights, fp32) is sharded over 2 gloo ranks at stage 3 and
saved as a sharded checkpoint (weights only: the export reads no optimizer state). Each export then
runs in a fresh process (``zero-consolidate CKPT --hf OUT --max-shard-size S``), which reports its
peak resident set (VmHWM: anonymous memory and the file-backed, memory-mapped pages of the rank
files it reads, all counted) over its resident set just before the export began (Python, torch and
transformers imported). The goal is at most one output shard file plus the read buffer. The read
buffer is the largest tensor (the reader assembles one whole tensor from its parts, and the writer
writes it out) and, while a part of it is read, that part's copy checked against its checksum and
its memory-mapped pages: about twice the largest tensor, whatever the shard size, since the writer
streams each tensor into its file (see [Note: streaming safetensors]). For contrast the same is
measured for ``zero-consolidate CKPT model.ckpt``, which builds the whole state dict in memory.
Memory figures only: the times printed are not benchmarks on a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_CHILD = r"""
import json, sys, time
from zero_strategy.cli.consolidate import main
import transformers  # imported before the baseline, as the export imports nothing heavier

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
before = status("VmRSS:")
start = time.perf_counter()
code = main(sys.argv[1:])
print(json.dumps({"code": code, "before": before, "peak": status("VmHWM:"), "seconds": time.perf_counter() - start}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _save(rank: int, world_size: int, port: int, args: argparse.Namespace, ckpt: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    import transformers
    from zero_strategy import ZeroConfig
    from zero_strategy.checkpoint import save_sharded
    from zero_strategy.engine import Collectives, shard_module

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=args.vocab, n_positions=1024, n_embd=args.width, n_layer=args.layers,
                                     n_head=max(1, args.width // 64))
    with torch.no_grad():
        model = transformers.GPT2LMHeadModel(config)
    sharder = shard_module(model, ZeroConfig(stage=3, shard_modules=("GPT2Block",)))
    save_sharded(ckpt, {}, model, [], sharder, Collectives(), 3)  # weights only
    dist.destroy_process_group()


def _run_export(cli_args: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, *cli_args], capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines or json.loads(lines[-1])["code"]:
        raise RuntimeError(f"the export failed:\n{out.stdout}\n{out.stderr}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--shard-sizes", nargs="+", default=["5GB", "500MB", "100MB"])
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--no-full", action="store_true", help="skip the whole-state-dict consolidation")
    parser.add_argument("--reuse", action="store_true", help="export the checkpoint already in --dir, if any")
    args = parser.parse_args()
    folder = Path(args.dir or tempfile.mkdtemp(prefix="bench_hf_export_"))
    ckpt = folder / "ckpt"
    start = time.perf_counter()
    if not (args.reuse and (ckpt / "index.json").is_file()):
        mp.spawn(_save, args=(2, _free_port(), args, str(ckpt)), nprocs=2, join=True)
    index = json.loads((ckpt / "index.json").read_text())
    numels = [torch.Size(t["shape"]).numel() for name, t in index["tensors"].items() if name.startswith("model/")]
    model_bytes, largest = sum(numels) * 4, max(numels) * 4
    buffer = 2 * largest  # the tensor assembled, and one part of it read, checked and mapped
    print(f"GPT-2 {args.layers} layers x {args.width}, vocab {args.vocab}: {sum(numels) / 1e6:.0f}M parameters, "
          f"{model_bytes / 2**20:.0f} MiB fp32 (checkpoint saved in {time.perf_counter() - start:.0f} s); largest "
          f"tensor {largest / 2**20:.0f} MiB")
    rows = []
    for size in args.shard_sizes:
        out = folder / f"hf_{size}"
        result = _run_export([str(ckpt), "--hf", str(out), "--max-shard-size", size])
        shard = max(p.stat().st_size for p in out.glob("model*.safetensors"))
        grown = result["peak"] - result["before"]
        rows.append({"what": f"--hf --max-shard-size {size}", "peak_over_baseline": grown, "largest_shard": shard,
                     "largest_tensor": largest, "read_buffer": buffer, "model_bytes": model_bytes,
                     "seconds": result["seconds"]})
        print(f"--hf --max-shard-size {size:>6}: peak RSS - baseline {grown / 2**20:5.0f} MiB = "
              f"{grown / largest:.2f} x "
              f"the largest tensor, {grown / model_bytes:.2f} x the model; goal: largest shard file "
              f"{shard / 2**20:5.0f} MiB + read buffer {buffer / 2**20:4.0f} MiB = {(shard + buffer) / 2**20:5.0f} MiB "
              f"(ratio {grown / (shard + buffer):.2f}; {result['seconds']:.0f} s)")
    if not args.no_full:
        result = _run_export([str(ckpt), str(folder / "model.ckpt"), "--weights-only"])
        grown = result["peak"] - result["before"]
        rows.append({"what": "whole state dict (zero-consolidate CKPT model.ckpt)", "peak_over_baseline": grown,
                     "model_bytes": model_bytes, "seconds": result["seconds"]})
        print(f"zero-consolidate CKPT model.ckpt (the whole state dict): peak RSS - baseline {grown / 2**20:.0f} MiB; "
              f"over the model {grown / model_bytes:.2f} ({result['seconds']:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
