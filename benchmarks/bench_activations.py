"""Activation memory of an 8-block GPT with and without activation checkpointing (and offload).

Counts exactly the bytes autograd keeps for backward after one forward and loss
(``zero_strategy.activation.SavedActivationMeter``: each storage once, parameters left out), for:
no checkpointing, every block checkpointed, every second block, and times one forward + backward of
each (the price of recomputation). On CUDA (``--device cuda``) it also gives the device memory
allocated by activations after the forward and the peak over the step, with and without
``offload_activations`` (which moves what is saved to pinned host memory).

    python benchmarks/bench_activations.py                      # CPU, the package's GPT at 8 blocks
    python benchmarks/bench_activations.py --n-embd 256 --seq 256 --batch 16 --device cuda
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.nn.functional as F

from zero_strategy.activation import (
    SavedActivationMeter,
    apply_activation_checkpointing,
    offload_activations,
    remove_activation_checkpointing,
)
from zero_strategy.models import GPT

VARIANTS = {  # name: (checkpoint interval or None, offload)
    "none": (None, False),
    "every block": (1, False),
    "every 2nd block": (2, False),
    "every block + offload": (1, True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per variant (the median is shown)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                dropout=args.dropout).to(device)
    idx = torch.randint(0, 256, (args.batch, args.seq + 1), device=device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"GPT: {args.n_layer} blocks, n_embd {args.n_embd}, {n_params / 1e6:.2f}M parameters; batch {args.batch} x "
          f"{args.seq} tokens, fp32, on {device}")

    def loss() -> torch.Tensor:
        return F.cross_entropy(model(idx[:, :-1]).reshape(-1, 256), idx[:, 1:].reshape(-1))  # (B*T, V)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rows = []
    for name, (interval, offload) in VARIANTS.items():
        remove_activation_checkpointing(model)
        if interval is not None:
            apply_activation_checkpointing(model, ["Block"], interval, offload=offload)
        # offload moves nothing on the CPU, and the meter sees only what the innermost hooks see:
        # count the saved bytes without offload, and give offload's effect in device memory below
        saved = None
        if not offload:
            with SavedActivationMeter() as meter:
                loss()
            saved = meter.bytes
        times, after_forward, peak = [], None, None
        for repeat in range(args.repeats + 1):  # the first is a warm-up, not timed
            model.zero_grad(set_to_none=True)
            sync()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            start = time.perf_counter()
            with offload_activations(enabled=offload) if offload else contextlib.nullcontext():
                value = loss()
            if device.type == "cuda":
                sync()
                after_forward = torch.cuda.memory_allocated(device) - base
            value.backward()
            sync()
            if repeat:
                times.append(time.perf_counter() - start)
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(device) - base
        rows.append((name, saved, sorted(times)[len(times) // 2], after_forward, peak))

    plain_saved, plain_time = rows[0][1], rows[0][2]
    print(f"\n{'checkpointing':<24}{'saved for backward':>20}{'ratio':>8}{'step (s)':>10}{'x time':>8}", end="")
    print(f"{'device after fwd':>18}{'device peak':>14}" if device.type == "cuda" else "")
    for name, saved, step, after_forward, peak in rows:
        saved_text = f"{saved / 2**20:17.2f} MiB" if saved is not None else f"{'(see device)':>21}"
        ratio = f"{plain_saved / saved:7.1f}x" if saved else f"{'':>8}"
        print(f"{name:<24}{saved_text}{ratio}{step:10.3f}{step / plain_time:7.2f}x", end="")
        print(f"{after_forward / 2**20:14.2f} MiB{peak / 2**20:10.2f} MiB" if device.type == "cuda" else "")
    print(f"\nevery block checkpointed keeps {plain_saved / rows[1][1]:.1f}x fewer activation bytes "
          f"({plain_saved:,} -> {rows[1][1]:,})")


if __name__ == "__main__":
    main()
