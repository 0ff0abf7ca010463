"""ZeRO++'s options on 4 CPU ranks laid out as 2 nodes of 2: step time, bytes per step and loss next
to plain stage 3; a GPT trained with each option next to the unquantized run; and the
communication model's prediction for a 7B model on 64 GPUs (8 nodes x 8) next to the ZeRO++ paper.

    python benchmarks/bench_comm.py                                   # full size (about half an hour on 2 cores)
    python benchmarks/bench_comm.py --params-millions 0.3 --steps 3 --gpt-steps 10 --gpt-layers 1 --gpt-embd 32
    python benchmarks/bench_comm.py --parts estimate                  # the 7B prediction only (seconds)

Parts (``--parts``, comma-separated):

- ``step``: the stage benchmark's model (benchmarks/stages_variants.py: residual Linear blocks, one
  stage-3 unit each) trained by plain stage 3 and by stage 3 with each option, taking turns step by
  step; the median step time (barrier to barrier), the bytes each rank sent in the last step
  (``comm_stats()``), intra- and inter-node, checked against ``predict_step_bytes`` (equal, or the
  run stops), and the final loss next to plain stage 3's.
- ``gpt``: zero_strategy.models.GPT on the Python standard library's source (the main job's model and
  data), ``--gpt-steps`` steps (200) per option, the same batches for all; the final validation loss
  relative to the unquantized run's (the issue asks within 1%). tests/test_comm_training.py runs a
  small version of the same function in the suite.
- ``estimate``: ``predict_step_bytes`` for a 7B-class GPT (32 layers, width 4096, 32k vocabulary;
  bf16 weights) on 8 nodes of 8 GPUs, beside the volumes ZeRO++ publishes (Wang et al., "ZeRO++:
  Extremely Efficient Collective Communication for Giant Model Training", arXiv:2306.10209: ZeRO-3
  moves 3M across nodes per step, ZeRO++ 0.75M, M the model's fp16 bytes).

CPU timings on 2 shared cores say how much the quantization work costs here, not what a cluster
gains: the bytes, and the model's time on real links, are the transferable figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

if not __package__:  # run as a script: the repository root on sys.path (see bench_stages.py)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.stages_variants import ResidualBlock, ResidualMLP, make_batches, model_shape  # noqa: E402
from zero_strategy.comm_model import CLUSTERS, links, predict_step_bytes, variant_rows  # noqa: E402
from zero_strategy.config import ZeroConfig  # noqa: E402
from zero_strategy.engine import Collectives, ZeroOptimizer, shard_module  # noqa: E402

WORLD, PER_NODE = 4, 2
OPTIONS: dict[str, dict[str, Any]] = {
    "zero3": {},
    "zero3+qwZ": {"quantized_weights": True},
    "zero3+hpZ": {"secondary_partition_size": PER_NODE},
    "zero3+qgZ-int8": {"quantized_gradients": "int8"},
    "zero3+qgZ-int4": {"quantized_gradients": "int4"},
    "zero3+all": {"quantized_weights": True, "secondary_partition_size": PER_NODE, "quantized_gradients": "int4"},
}


# ---- part "step": the stage benchmark's model ---------------------------------------------------

def _step_config(options: dict, bucket_cap_mb: float) -> ZeroConfig:
    return ZeroConfig(stage=3, bucket_cap_mb=bucket_cap_mb, shard_modules=(ResidualBlock.__name__,), **options)


def step_rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    width = model_shape(args.params_millions, args.layers)
    comm = Collectives(ranks_per_node=PER_NODE)
    runs = {}
    for name, options in OPTIONS.items():
        torch.manual_seed(args.seed)
        model = ResidualMLP(width, args.layers)
        config = _step_config(options, args.bucket_cap_mb)
        opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), config,
                            sharder=shard_module(model, config, comm))
        runs[name] = {"model": model, "opt": opt, "times": [], "losses": []}
    names = list(OPTIONS)
    for step, (x, y) in enumerate(make_batches(args.warmup + args.steps, 32, width, rank)):
        k = step % len(names)  # rotate who goes first, as bench_stages.py does
        for name in names[k:] + names[:k]:
            run = runs[name]
            dist.barrier()
            t0 = time.perf_counter()
            loss = F.mse_loss(run["model"](x), y)
            loss.backward()
            run["opt"].step()
            run["opt"].zero_grad()
            dist.barrier()
            if step >= args.warmup:
                run["times"].append(time.perf_counter() - t0)
                run["losses"].append(loss.item())
            run["stats"] = run["opt"].comm_stats()
            run["checked"] = run["opt"].sharder.guard.active  # did the order guard check this step's pass?
    return {name: {"median_s": statistics.median(r["times"]), "final_loss": r["losses"][-1], "stats": r["stats"],
                   "order_checked": r["checked"]} for name, r in runs.items()}


def predicted_step(args: argparse.Namespace, name: str, order_checked: bool) -> dict[str, int]:
    width = model_shape(args.params_millions, args.layers)
    with torch.device("meta"):
        model = ResidualMLP(width, args.layers)
    return predict_step_bytes(model, _step_config(OPTIONS[name], args.bucket_cap_mb), WORLD, PER_NODE,
                              order_checked=order_checked, backend="gloo")


# ---- part "gpt": convergence on the standard library --------------------------------------------

@functools.lru_cache(maxsize=None)
def _stdlib_split(max_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) bytes of the standard library's ``.py`` files, read once per process: every
    option's run (``gpt_rank``, tests/test_comm_training.py) trains on the same bytes, and reading
    them (walking the whole standard library) cost each rank about 0.1 s per run (4 processes on 2
    cores), 16 times in the test. The runs share the tensors: ``train_gpt`` only reads them."""
    from zero_strategy.data.byte_corpus import read_split, stdlib_dir

    return read_split(stdlib_dir(), "*.py", 5.0, max_bytes=max_bytes)


def train_gpt(rank: int, world: int, stage: int, options: dict, sizes: dict, per_node: int = PER_NODE) -> dict:
    """``sizes["steps"]`` steps of a GPT on stdlib bytes (every rank its own batches, the same for
    every option), then the validation loss over ``sizes["val_batches"]`` fixed batches, the ranks
    taken as nodes of ``per_node`` ranks each. Returns the
    final validation loss, the training losses, the seconds per step and the last step's bytes."""
    from zero_strategy import gathered_parameters
    from zero_strategy.models.gpt import GPT
    from zero_strategy.models.optim import param_groups, warmup_cosine

    seq, batch = sizes["seq_len"], sizes["batch"]
    train, val = _stdlib_split(sizes["max_bytes"])
    torch.manual_seed(1234)
    model = GPT(n_layer=sizes["layers"], n_embd=sizes["embd"], n_head=sizes["heads"], block_size=seq)
    config = ZeroConfig(**{"stage": stage, "shard_modules": ("Block",), "param_persistence_threshold": 1024, **options})
    comm = Collectives(ranks_per_node=per_node)
    sharder = shard_module(model, config, comm) if stage == 3 else None
    # the main job's recipe (conf/model/gpt.yaml, conf/trainer/default.yaml): AdamW, decay on matrices,
    # 10% warm-up then cosine decay, clipping at 1
    user_opt = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95))
    opt = ZeroOptimizer(user_opt, config, comm, sharder=sharder)
    schedule = warmup_cosine(opt, max(1, sizes["steps"] // 10), sizes["steps"])

    def windows(data: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.stack([data[s : s + seq + 1] for s in starts.tolist()]).long()  # (B, T + 1)
        return rows[:, :-1], rows[:, 1:]

    losses, t0 = [], time.perf_counter()
    for step in range(sizes["steps"]):
        g = torch.Generator().manual_seed(10_000 * step + rank)
        x, y = windows(train, torch.randint(0, len(train) - seq - 1, (batch,), generator=g))
        loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        schedule.step()
        opt.zero_grad()
        losses.append(loss.item())
    seconds = (time.perf_counter() - t0) / sizes["steps"]
    stats = opt.comm_stats()
    with torch.no_grad():  # every rank the same fixed windows: the same loss on every rank
        starts = torch.arange(sizes["val_batches"] * batch) * ((len(val) - seq - 1) // (sizes["val_batches"] * batch))
        val_loss = sum(F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)).item()
                       for x, y in (windows(val, chunk) for chunk in starts.split(batch))) / sizes["val_batches"]
    with gathered_parameters(model):
        digest = sum(p.double().sum().item() for p in model.parameters())
    return {"val_loss": val_loss, "losses": losses, "seconds_per_step": seconds, "stats": stats, "digest": digest}


GPT_RUNS: dict[str, tuple[int, dict]] = {
    "zero2": (2, {}), "zero2+qgZ-int4": (2, {"quantized_gradients": "int4"}),
    **{name: (3, options) for name, options in OPTIONS.items()},
    # a control: the same training cut into other buckets, which changes only the order floating-point
    # sums are taken in; how far it lands from zero3 is the noise floor of the comparison
    "zero3-control": (3, {"bucket_cap_mb": 0.05}),
}


def gpt_rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    sizes = {"steps": args.gpt_steps, "layers": args.gpt_layers, "embd": args.gpt_embd, "heads": args.gpt_heads,
             "seq_len": args.gpt_seq, "batch": args.gpt_batch, "val_batches": args.gpt_val_batches,
             "max_bytes": args.gpt_max_bytes}
    return {name: train_gpt(rank, world, stage, options, sizes) for name, (stage, options) in GPT_RUNS.items()}


# ---- part "estimate": 7B on 8 x 8 ---------------------------------------------------------------

def estimate_7b(cluster: str) -> list[dict]:
    """The model's bytes for a 7B-class GPT on 8 x 8 GPUs, per variant, with the inter-node bytes of
    the three collectives ZeRO++ counts (forward all-gather, backward all-gather, gradient reduction)
    in units of M, the model's fp16 bytes, as the paper counts them."""
    from zero_strategy.models.gpt import GPT

    with torch.device("meta"):
        model = GPT(vocab_size=32_000, block_size=2048, n_layer=32, n_head=32, n_embd=4096)
    base = ZeroConfig(shard_modules=("Block",))
    rows = variant_rows(model, base, 64, 8, links(cluster), dtype=torch.bfloat16, clipping=True)
    m = 2 * sum(p.numel() for p in model.parameters())
    paper = {"ZeRO-3": (1.0, 1.0, 1.0), "ZeRO++ (qwZ+hpZ+qgZ4)": (0.5, 0.0, 0.25)}
    for row in rows:
        forward, backward = row["phases"]["forward"], row["phases"]["backward"]
        hpz = row["config"].secondary_partition_size is not None
        backward_gather = 0 if hpz else backward["all_gather"]  # hpZ's stay in the node
        gradients = backward["inter_node"] - backward_gather if row["config"].stage >= 2 else \
            row["phases"]["step"]["reduce_scatter"]  # stage 1 reduces in the step
        row["inter_over_M"] = {"forward all-gather": forward["inter_node"] / m,
                               "backward all-gather": backward_gather / m, "gradients": gradients / m,
                               "step total": row["stats"]["inter_node"] / m}
        row["paper_over_M"] = paper.get(row["variant"])
        del row["config"]  # not JSON
    return rows


# ---- driver ------------------------------------------------------------------------------------

def _worker(rank: int, world: int, port: int, job: str, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = (step_rank if job == "step" else gpt_rank)(rank, world, args)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def _launch(job: str, args: argparse.Namespace) -> dict:
    import socket
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rank0.json")
        mp.start_processes(_worker, args=(WORLD, port, job, args, out), nprocs=WORLD, start_method="spawn")
        with open(out) as f:
            return json.load(f)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.3f}"


def report(results: dict, args: argparse.Namespace) -> str:
    lines = []
    if "step" in results:
        base = results["step"]["zero3"]
        lines += [f"## Step: {args.params_millions}M-parameter residual MLP, {args.layers} blocks, 4 gloo ranks "
                  "(2 nodes x 2), fp32 AdamW, batch 32 per rank", "",
                  "| variant | median step (s) | vs zero3 | all-gather MiB | reduce-scatter MiB | intra-node MiB "
                  "| inter-node MiB | total MiB | = model | final loss vs zero3 |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in results["step"].items():
            st = r["stats"]
            lines.append(f"| {name} | {r['median_s']:.4f} | {r['median_s'] / base['median_s']:.2f}x | "
                         f"{_mib(st['all_gather'])} | {_mib(st['reduce_scatter'])} | {_mib(st['intra_node'])} | "
                         f"{_mib(st['inter_node'])} | {_mib(st['total'])} | {'yes' if r['predicted_equal'] else 'NO'} "
                         f"| {r['final_loss'] / base['final_loss'] - 1:+.2%} |")
        lines.append("")
    if "gpt" in results:
        lines += [f"## GPT on the standard library: {args.gpt_layers} layers, width {args.gpt_embd}, "
                  f"{args.gpt_steps} steps, batch {args.gpt_batch} x {args.gpt_seq} bytes per rank, 4 ranks", "",
                  "| variant | final val loss | vs unquantized | s/step | inter-node MiB/step | total MiB/step |",
                  "|---|---|---|---|---|---|"]
        for name, r in results["gpt"].items():
            ref = results["gpt"]["zero2" if name.startswith("zero2") else "zero3"]["val_loss"]  # the control too
            stats = r["stats"]
            lines.append(f"| {name} | {r['val_loss']:.4f} | {r['val_loss'] / ref - 1:+.2%} | "
                         f"{r['seconds_per_step']:.3f} | {_mib(stats['inter_node'])} | {_mib(stats['total'])} |")
        lines.append("")
    if "estimate" in results:
        link = CLUSTERS[args.cluster]
        lines += [f"## Model: 7B-class GPT (32 x 4096, 32k vocabulary), bf16, 64 GPUs (8 nodes x 8), {link.source}",
                  "", "Inter-node bytes per rank per step in units of M (the model's fp16 bytes), as the ZeRO++ "
                  "paper counts them: forward all-gather / backward all-gather / gradient reduction.", "",
                  "| variant | forward AG | backward AG | gradients | whole step | ZeRO++ paper | inter-node GiB | "
                  "intra-node GiB | comm ms/step |", "|---|---|---|---|---|---|---|---|---|"]
        for row in results["estimate"]:
            st, over, paper = row["stats"], row["inter_over_M"], row["paper_over_M"]
            published = " / ".join(f"{v:g}M" for v in paper) if paper else ""
            lines.append(f"| {row['variant']} | {over['forward all-gather']:.3f}M | {over['backward all-gather']:.3f}M"
                         f" | {over['gradients']:.3f}M | {over['step total']:.3f}M | {published} | "
                         f"{st['inter_node'] / 2**30:.2f} | {st['intra_node'] / 2**30:.2f} | {row['seconds'] * 1e3:,.0f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="step,gpt,estimate")
    parser.add_argument("--params-millions", type=float, default=50.0)
    parser.add_argument("--layers", type=int, default=11)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpt-steps", type=int, default=200)
    parser.add_argument("--gpt-layers", type=int, default=4)
    parser.add_argument("--gpt-embd", type=int, default=128)
    parser.add_argument("--gpt-heads", type=int, default=4)
    parser.add_argument("--gpt-seq", type=int, default=128)
    parser.add_argument("--gpt-batch", type=int, default=16)
    parser.add_argument("--gpt-val-batches", type=int, default=20)
    parser.add_argument("--gpt-max-bytes", type=int, default=8_000_000)
    parser.add_argument("--cluster", default="dgx-a100", choices=sorted(CLUSTERS))
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - {"step", "gpt", "estimate"}
    if unknown:
        parser.error(f"--parts {sorted(unknown)}: choose among step, gpt, estimate")
    results: dict[str, Any] = {}
    if "step" in parts:
        results["step"] = _launch("step", args)
        for name, r in results["step"].items():
            r["predicted_equal"] = r["stats"] == predicted_step(args, name, r["order_checked"])
    if "gpt" in parts:
        results["gpt"] = _launch("gpt", args)
    if "estimate" in parts:
        results["estimate"] = estimate_7b(args.cluster)
    print(report(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    if "step" in results and not all(r["predicted_equal"] for r in results["step"].values()):
        raise SystemExit("comm_stats() differs from predict_step_bytes for some variant: see the '= model' column")


if __name__ == "__main__":
    main()
