"""Training quality of low-precision optimizer state and bf16 master weights: the main job's GPT
(conf/model/gpt.yaml: 4 layers x 128, 0.84M parameters, AdamW lr 3e-3 betas (0.9, 0.95), weight
decay 0.1 on matrices, warm-up then cosine) on its corpus (the Python standard library's source,
bytes, 128 per sequence, 16 sequences per step) for ``--steps`` steps, each combination on the same
seeds, data order and initial weights.

    python benchmarks/bench_lowp_quality.py                     # 1000 steps, seeds 0 and 1
    python benchmarks/bench_lowp_quality.py --steps 20 --eval-batches 2 --seeds 0   # a quick check
    python benchmarks/bench_lowp_quality.py --lr 1e-4 --combos bf16    # fine-tuning's small updates

Two comparisons, each against its own reference:
- fp32 weights: the optimizer state stored as fp32 (the reference), bf16 (stochastic rounding) or
  int8 (block-wise codes);
- bf16 weights: fp32 master copies (the reference, "bf16-mixed"), bf16 masters with stochastic
  rounding (``master_weights_dtype="bf16"``), and bf16 masters rounded to nearest
  (``stochastic_rounding=False``).
The combinations run interleaved (for each seed, every combination in turn), in one process on one
thread through ``ZeroOptimizer`` at stage 1 (what is stored and how it is rounded does not depend
on the stage or the world size: the tests show stage and world-size parity bit for bit). It prints
each run's final validation loss (``--eval-batches`` fixed batches of the validation split), the
mean over seeds against the reference's, and writes the curves (JSON and a PNG plot) next to
``--out``. A quality benchmark: the numbers do not depend on the machine's load.

``--lr`` sets the peak learning rate (3e-3, the main job's, by default). Rounding the masters
matters where an update is small against the weight it changes: below half a bf16 step (2^-9 to 2^-8 of
the weight), round to nearest drops it. At 3e-3 most updates are larger than that; at a
fine-tuning rate (1e-4 and below) most are not, which is the case stochastic rounding is for.
``--combos bf16`` (or ``fp32``) runs only the combinations with those weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name: (weights dtype, ZeroConfig options, the name of the run it is compared with)
COMBOS = {
    "fp32 weights, fp32 state": (torch.float32, {}, None),
    "fp32 weights, bf16 state": (torch.float32, {"optimizer_state_dtype": "bf16"}, "fp32 weights, fp32 state"),
    "fp32 weights, int8 state": (torch.float32, {"optimizer_state_dtype": "int8"}, "fp32 weights, fp32 state"),
    "bf16 weights, fp32 masters": (torch.bfloat16, {}, None),
    "bf16 weights, bf16 masters (stochastic)": (torch.bfloat16, {"master_weights_dtype": "bf16"},
                                                "bf16 weights, fp32 masters"),
    "bf16 weights, bf16 masters (nearest)": (torch.bfloat16, {"master_weights_dtype": "bf16",
                                                               "stochastic_rounding": False},
                                             "bf16 weights, fp32 masters"),
}


def _data(seq_len: int):
    from zero_strategy.data import StdlibDataModule

    data = StdlibDataModule(seq_len=seq_len)
    data.setup()
    return data.train_set, data.val_set


def _batches(dataset, batch: int, steps: int, seed: int):
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))
    for step in range(steps):
        rows = [dataset[int(i)] for i in order[(step * batch) % len(order):][:batch]]
        yield torch.stack([x for x, _ in rows]), torch.stack([y for _, y in rows])


def _loss(model, x, y) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


@torch.no_grad()
def _evaluate(model, val_batches) -> float:
    model.eval()
    loss = statistics.fmean(_loss(model, x, y).item() for x, y in val_batches)
    model.train()
    return loss


def run(name: str, seed: int, args, train_set, val_batches) -> dict:
    from zero_strategy import ZeroConfig
    from zero_strategy.engine.optim.optimizer import ZeroOptimizer
    from zero_strategy.models import GPT
    from zero_strategy.models.optim import param_groups, warmup_cosine

    dtype, options, _ = COMBOS[name]
    torch.manual_seed(seed)
    model = GPT(block_size=args.seq_len).to(dtype)
    inner = torch.optim.AdamW(param_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95))
    opt = ZeroOptimizer(inner, ZeroConfig(stage=1, stochastic_rounding_seed=seed, **options))
    schedule = warmup_cosine(opt, warmup_steps=max(1, args.steps // 10), total_steps=args.steps)
    curve, start = [], time.perf_counter()
    for step, (x, y) in enumerate(_batches(train_set, args.batch_size, args.steps, seed), 1):
        loss = _loss(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
        if step % args.eval_every == 0 or step == args.steps:
            curve.append((step, loss.item(), _evaluate(model, val_batches)))
    return {"name": name, "seed": seed, "curve": curve, "final": curve[-1][2], "seconds": time.perf_counter() - start}


def _plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = [d for d in (torch.float32, torch.bfloat16) if any(COMBOS[r["name"]][0] is d for r in runs)]
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, dtype in zip(axes, dtypes):
        for r in runs:
            if COMBOS[r["name"]][0] is dtype:
                steps, _, val = zip(*r["curve"])
                ax.plot(steps, val, label=f"{r['name'].split(', ', 1)[1]}, seed {r['seed']}")
        ax.set_title(f"{'fp32' if dtype is torch.float32 else 'bf16'} weights")
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("validation loss")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (the main job's: 3e-3)")
    parser.add_argument("--combos", choices=("all", "fp32", "bf16"), default="all",
                        help="which combinations: all, or those with fp32 or bf16 weights")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--eval-batches", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results_cpu" / "lowp_quality"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    train_set, val_set = _data(args.seq_len)
    val_batches = list(_batches(val_set, args.batch_size, args.eval_batches, seed=12345))
    weights = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(args.combos)
    combos = [name for name, (dtype, _, _) in COMBOS.items() if weights in (None, dtype)]
    runs = []
    for seed in args.seeds:  # interleaved: every combination on one seed before the next seed
        for name in combos:
            runs.append(run(name, seed, args, train_set, val_batches))
            print(f"  {name}, seed {seed}: final validation loss {runs[-1]['final']:.4f} "
                  f"({runs[-1]['seconds']:.0f} s)", flush=True)
    mean = {name: statistics.fmean(r["final"] for r in runs if r["name"] == name) for name in combos}
    print(f"\n{args.steps} steps at peak lr {args.lr:g}, seeds {args.seeds}, validation on {args.eval_batches} "
          f"batches of {args.batch_size} x {args.seq_len} bytes\n")
    print("| combination | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean | vs its reference |")
    print("|---|" + "---|" * len(args.seeds) + "---|---|")
    for name in combos:
        reference = COMBOS[name][2]
        finals = [f"{r['final']:.4f}" for r in runs if r["name"] == name]
        against = f"{(mean[name] / mean[reference] - 1) * 100:+.2f}%" if reference else "(reference)"
        print(f"| {name} | " + " | ".join(finals) + f" | {mean[name]:.4f} | {against} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    _plot(runs, out.with_suffix(".png"))
    print(f"\ncurves: {out.with_suffix('.json')}, {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
