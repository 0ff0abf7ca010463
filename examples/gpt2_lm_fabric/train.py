"""The GPT-2 language model of examples/gpt2_lm, trained by a hand-written Lightning Fabric loop with
ZeRO (transformers' GPT2LMHeadModel from a GPT2Config with random init, tied embeddings), byte-level,
on the Python standard library's own source code, on 2 CPU processes.

    python examples/gpt2_lm_fabric/train.py                            # tiny GPT-2, ZeRO-2, ~1 min on 2 CPU cores
    python examples/gpt2_lm_fabric/train.py --stage 3 --precision bf16-mixed --accumulate 2
    python examples/gpt2_lm_fabric/train.py --resume outputs/gpt2_lm_fabric/last.ckpt --max-steps 300
    python examples/gpt2_lm_fabric/train.py --accelerator cuda --devices 8 --n-embd 768 --layers 12 \\
        --heads 12 --seq-len 1024 --batch-size 8                         # GPT-2 small's shape

No download (bytes are the tokens, so no tokenizer). Needs `pip install "zero-strategy[models]"`.
"""

from __future__ import annotations

import argparse
import math
import os

import lightning as L
import torch
import torch.nn.functional as F

from zero_strategy import estimate_memory
from zero_strategy.data import StdlibDataModule
from zero_strategy.fabric import ZeroFabricStrategy
from zero_strategy.models import gpt2_lm_head, warmup_cosine
from zero_strategy.models.optim import param_groups


def lm_loss(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(idx).logits  # (B, T, V), fp32: Fabric's ZeRO precision hands outputs back in fp32
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


@torch.no_grad()
def validate(fabric: L.Fabric, model: torch.nn.Module, loader, batches: int) -> float:
    model.eval()
    total, count = torch.zeros(2, device=fabric.device), 0
    for idx, targets in loader:
        total += torch.stack([lm_loss(model, idx, targets) * targets.numel(), torch.tensor(targets.numel(),
                                                                                       device=fabric.device)])
        count += 1
        if count == batches:
            break
    model.train()
    total = fabric.all_reduce(total, reduce_op="sum")  # every rank's tokens
    return (total[0] / total[1]).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=2, help="ZeRO stage: 1, 2 or 3 (parameters below 100,000 "
                                                             "elements stay whole)")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=150, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per device and micro-batch")
    parser.add_argument("--lr", type=float, default=3e-3, help="high for a tiny model; ~6e-4 for GPT-2 small")
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", default="outputs/gpt2_lm_fabric", help="where last.ckpt (a sharded checkpoint) goes")
    parser.add_argument("--resume", default=None, help="a checkpoint to continue from (any world size and stage)")
    args = parser.parse_args()

    fabric = L.Fabric(strategy=ZeroFabricStrategy(stage=args.stage), accelerator=args.accelerator,
                      devices=args.devices, precision=args.precision)
    fabric.launch()
    fabric.seed_everything(0)
    data = StdlibDataModule(seq_len=args.seq_len, batch_size=args.batch_size)
    data.setup()
    train_loader, val_loader = fabric.setup_dataloaders(data.train_dataloader(), data.val_dataloader())

    # transformers' modules initialise in post_init, not in reset_parameters(), so GPT-2 is built whole
    # here and sharded in setup; a model whose modules reset themselves can be built on the meta device
    # at stage 3 with fabric.init_module(empty_init=True), never whole on a rank
    with fabric.init_module():
        net = gpt2_lm_head(n_positions=args.seq_len, n_embd=args.n_embd, n_layer=args.layers, n_head=args.heads)
    n_params = sum(p.numel() for p in net.parameters())  # the tied embedding counts once
    optimizer = torch.optim.AdamW(param_groups(net, weight_decay=0.1), lr=args.lr, betas=(0.9, 0.95))
    scheduler = warmup_cosine(optimizer, warmup_steps=args.max_steps // 10, total_steps=args.max_steps)
    model, optimizer = fabric.setup(net, optimizer)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    if args.resume:
        fabric.load(args.resume, state)  # weights, optimizer state, schedule and step
        fabric.print(f"resumed from {args.resume} at step {state['step']}")

    batches = iter(train_loader)
    while state["step"] < args.max_steps:
        for micro in range(args.accumulate):
            try:
                idx, targets = next(batches)
            except StopIteration:
                batches = iter(train_loader)
                idx, targets = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                loss = lm_loss(model, idx, targets)
                fabric.backward(loss / args.accumulate)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)  # the norm over every rank's shard
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        state["step"] += 1
        if state["step"] % 50 == 0:
            fabric.print(f"step {state['step']}: train loss {loss.item():.3f}, lr {scheduler.get_last_lr()[0]:.2e}")
    fabric.save(os.path.join(args.out, "last.ckpt"), state)  # every rank writes its own part

    val = validate(fabric, model, val_loader, batches=20)
    measured = fabric.strategy.memory_stats(net)
    expected = estimate_memory(n_params, stage=args.stage, world_size=fabric.world_size, precision=args.precision)
    print(f"[rank {fabric.global_rank}] {n_params:,} parameters; bytes on this rank, measured vs ZeRO formula:")
    for key in ("params", "grads", "optimizer_states", "master_params", "total"):
        print(f"[rank {fabric.global_rank}]   {key:<17}{measured[key]:>12,} {expected[key]:>12,}")
    fabric.print(f"validation loss: {val:.3f} nats/byte, perplexity {math.exp(val):.2f} (uniform guess: 256)")
    # every rank samples the same tokens (same weights, same seed): at stage 3 each forward gathers the shards
    torch.manual_seed(0)
    sample = net.generate(torch.tensor([list(b"def ")], device=fabric.device), max_new_tokens=60, do_sample=True,
                          top_k=5, pad_token_id=0)
    fabric.print("sample:", bytes(sample[0].tolist()).decode("utf-8", errors="replace"))
    torch.distributed.destroy_process_group()  # gloo's threads can abort an exiting interpreter


if __name__ == "__main__":
    main()
