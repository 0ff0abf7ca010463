"""GPT-2 small through Lightning's Trainer, one device, every strategy a user would try, side by side:
step time, peak device memory and the losses against plain training (issue 15's head-to-head).

    python benchmarks/bench_gpt2_lightning.py                          # GPU: GPT-2 small, 16-mixed, batch 8 x 512
    python benchmarks/bench_gpt2_lightning.py --precision bf16-mixed --layers 24
    python benchmarks/bench_gpt2_lightning.py --device cpu --layers 2 --seq 64 --batch 2 --steps 8 --variants plain,zero2,zero3

Variants (``--variants``): ``plain`` (``strategy="auto"``), ``zero2``, ``zero3`` (``"zero_stage_3"``
with nothing else: units chosen by size), ``zero3_block`` (``shard_modules=["GPT2Block"]``),
``zero2_offload``, ``zero3_offload`` (optimizer and parameters), ``*_offload_overlap`` (the same with
``offload_overlap=True``), ``fsdp`` (Lightning's FSDPStrategy,
GPT2Block wrapped), ``deepspeed2`` and ``deepspeed3`` (Lightning's DeepSpeed strategies, where
``import deepspeed`` works; the model's torch AdamW, so no compiled op is needed), and ``*_compiled``
for any of them (``torch.compile`` of the network in ``configure_model``). Lightning's FSDP and
DeepSpeed strategies need CUDA; on CPU they are reported as skipped.

Each variant trains in a fresh process (``--worker``) on the same seed and the same random token
batches: transformers' GPT2LMHeadModel built from its config (124M parameters at 12 layers; dropout
off), AdamW lr 1e-4. A callback times every training batch (device synchronised at both ends); the
table gives the median of steps ``--skip`` + 1 .. ``--steps``, its ratio to plain's, the peak device
memory (``torch.cuda.max_memory_allocated``; peak RSS on CPU) and the largest difference of the
per-step losses from plain's. ``--rounds N`` runs every variant N times in turn (plain, zero2, ...,
plain, zero2, ...) and keeps each one's median over rounds, so drift of the machine falls on all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_VARIANTS = ("plain,zero2,zero3,zero3_block,zero2_offload,zero3_offload,zero2_offload_overlap,"
                    "zero3_offload_overlap,fsdp,deepspeed2,deepspeed3")


def _strategy(name: str) -> Any:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from zero_strategy import ZeroStrategy

    if name == "plain":
        return "auto"
    if name == "zero3_block":
        return ZeroStrategy(stage=3, shard_modules=["GPT2Block"])
    if name in ("zero2_offload_overlap", "zero3_offload_overlap"):  # the host step started during backward
        stage = int(name[len("zero")])
        return ZeroStrategy(stage=stage, offload_optimizer=True, offload_params=stage == 3, offload_overlap=True)
    if name in ("zero2", "zero3", "zero2_offload", "zero3_offload"):
        return "zero_stage_" + name[len("zero"):]  # the registered names: zero_stage_2, zero_stage_3_offload, ...
    if name == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        return FSDPStrategy(auto_wrap_policy={GPT2Block})
    if name in ("deepspeed2", "deepspeed3"):
        return f"deepspeed_stage_{name[-1]}"
    raise SystemExit(f"--variants: unknown variant {name!r}; choose among {DEFAULT_VARIANTS} (each also *_compiled)")


def worker(args: argparse.Namespace) -> dict:
    """One variant in this process: the per-step times and losses, and the peak memory."""
    sys.path.insert(0, ROOT)  # the working tree's package
    import lightning as L
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    name = args.worker
    compiled = name.endswith("_compiled")
    base = name.removesuffix("_compiled")
    cuda = args.device == "cuda"

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = GPT2Config(n_layer=args.layers, n_positions=max(1024, args.seq), resid_pdrop=0.0,
                                embd_pdrop=0.0, attn_pdrop=0.0)
            torch.manual_seed(0)
            self.net = GPT2LMHeadModel(config)
            self.losses: list[float] = []

        def configure_model(self) -> None:
            if compiled and not hasattr(self, "_compiled"):
                self._compiled = True
                self.net = torch.compile(self.net)

        def training_step(self, batch, batch_idx):
            loss = self.net(input_ids=batch, labels=batch).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._t0 = 0.0

        def on_train_batch_start(self, *a) -> None:
            if cuda:
                torch.cuda.synchronize()
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, *a) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._t0)

    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 50257, (args.batch, args.seq), generator=g) for _ in range(args.steps)]
    timer = Timer()
    trainer = L.Trainer(strategy=_strategy(base), accelerator=args.device, devices=1, precision=args.precision,
                        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[timer], num_sanity_val_steps=0,
                        use_distributed_sampler=False)  # the same batch order for every strategy
    model = LM()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(model, torch.utils.data.DataLoader(batches, batch_size=None))
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        with open("/proc/self/status") as f:
            peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    return {"times": timer.times, "losses": model.losses, "peak_bytes": peak}


def run_variant(name: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--device", args.device, "--precision",
           args.precision, "--layers", str(args.layers), "--batch", str(args.batch), "--seq", str(args.seq),
           "--steps", str(args.steps)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-1500:]
        return {"error": f"exit {proc.returncode}: {tail.strip().splitlines()[-1] if tail.strip() else ''}",
                "log": tail}
    return json.loads(lines[-1][len("RESULT "):])


def unavailable(name: str, device: str) -> str:
    """Why a variant cannot run here ('' when it can)."""
    base = name.removesuffix("_compiled")
    if base in ("fsdp", "deepspeed2", "deepspeed3") and device != "cuda":
        return "Lightning's FSDP and DeepSpeed strategies need CUDA"
    if base.startswith("deepspeed"):
        try:
            __import__("deepspeed")
        except Exception as err:  # noqa: BLE001 - not installed, or no usable accelerator
            return f"import deepspeed failed ({type(err).__name__})"
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--precision", default="16-mixed")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5, help="steps left out of the median (warm-up, compilation)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per variant's process")
    parser.add_argument("--out", help="write every figure here (JSON)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    if "plain" not in names:
        names.insert(0, "plain")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for _ in range(args.rounds):
        for name in names:
            why = unavailable(name, args.device)
            runs[name].append({"error": "skipped: " + why} if why else run_variant(name, args))
    plain = _summary(runs["plain"], args.skip)
    if plain is None:
        print(f"plain training failed: {runs['plain'][-1].get('log', runs['plain'][-1]['error'])}")
        return 1
    print(f"GPT-2 ({args.layers} layers), {args.precision}, batch {args.batch} x {args.seq}, {args.device}, "
          f"median step of steps {args.skip + 1}-{args.steps}, {args.rounds} round(s), a fresh process per run")
    print(f"{'variant':<22} {'step ms':>9} {'vs plain':>9} {'peak MiB':>10} {'max |dloss|':>12}")
    table = {}
    for name in names:
        s = _summary(runs[name], args.skip)
        if s is None:
            print(f"{name:<22} {runs[name][-1]['error']}")
            table[name] = {"error": runs[name][-1]["error"]}
            continue
        dloss = max(abs(a - b) for a, b in zip(s["losses"], plain["losses"]))
        table[name] = {"step_ms": s["step"] * 1e3, "vs_plain": s["step"] / plain["step"],
                       "peak_MiB": s["peak"] / 2**20, "max_abs_dloss": dloss}
        print(f"{name:<22} {s['step'] * 1e3:>9.1f} {s['step'] / plain['step']:>8.2f}x {s['peak'] / 2**20:>10.0f} "
              f"{dloss:>12.2e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "table": table, "runs": runs}, f, indent=1)
    return 0


def _summary(results: list[dict], skip: int):
    good = [r for r in results if "times" in r]
    if not good:
        return None
    return {"step": statistics.median(statistics.median(r["times"][skip:] or r["times"]) for r in good),
            "peak": max(r["peak_bytes"] for r in good), "losses": good[0]["losses"]}


if __name__ == "__main__":
    sys.exit(main())
