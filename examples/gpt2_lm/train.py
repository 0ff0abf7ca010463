"""A GPT-2 language model (transformers' GPT2LMHeadModel, built from a GPT2Config with random init,
input and output embeddings tied) trained with ZeRO-2 on 2 CPU processes, byte-level, on the
Python standard library's own source code.

    python examples/gpt2_lm/train.py                                   # tiny GPT-2, ~1 min on 2 CPU cores
    python examples/gpt2_lm/train.py --stage 1 --max-steps 1000
    python examples/gpt2_lm/train.py --accelerator cuda --devices 8 --n-embd 768 --layers 12 \\
        --heads 12 --seq-len 1024 --batch-size 8                        # GPT-2 small's shape

No download (bytes are the tokens, so no tokenizer). Needs `pip install "zero-strategy[models]"`.
"""

from __future__ import annotations

import argparse
import functools
import math

import lightning as L
import torch

from zero_strategy import ZeroStrategy, estimate_memory
from zero_strategy.data import StdlibDataModule
from zero_strategy.models import CausalLMModule, gpt2_lm_head, warmup_cosine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=2, help="ZeRO stage: 1, 2, or 3 (parameters below 100,000 elements stay whole)")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per device")
    parser.add_argument("--lr", type=float, default=3e-3, help="high for a tiny model; ~6e-4 for GPT-2 small")
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()

    L.seed_everything(0)
    data = StdlibDataModule(seq_len=args.seq_len, batch_size=args.batch_size)
    net = gpt2_lm_head(n_positions=args.seq_len, n_embd=args.n_embd, n_layer=args.layers, n_head=args.heads)
    model = CausalLMModule(
        net, optimizer=functools.partial(torch.optim.AdamW, lr=args.lr, betas=(0.9, 0.95)),
        scheduler=functools.partial(warmup_cosine, warmup_steps=args.max_steps // 10, total_steps=args.max_steps),
    )
    trainer = L.Trainer(
        strategy=ZeroStrategy(stage=args.stage), accelerator=args.accelerator, devices=args.devices,
        precision=args.precision, max_steps=args.max_steps, val_check_interval=100, limit_val_batches=20,
        check_val_every_n_epoch=None, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
    )
    trainer.fit(model, datamodule=data)
    final = trainer.validate(model, datamodule=data, verbose=False)[0]

    n = sum(p.numel() for p in model.parameters())  # the tied embedding counts once
    measured = trainer.strategy.memory_stats()
    expected = estimate_memory(n, stage=args.stage, world_size=trainer.world_size, precision=args.precision)
    print(f"[rank {trainer.global_rank}] {n:,} parameters; bytes on this rank, measured vs ZeRO formula:")
    for key in ("params", "grads", "optimizer_states", "master_params", "total"):
        print(f"[rank {trainer.global_rank}]   {key:<17}{measured[key]:>12,} {expected[key]:>12,}")
    if trainer.is_global_zero:
        loss = final["val/loss"]
        print(f"validation loss: {loss:.3f} nats/byte, perplexity {math.exp(loss):.2f} (uniform guess: 256)")
        sample = net.generate(torch.tensor([list(b"def ")], device=model.device), max_new_tokens=60, do_sample=True,
                              top_k=5, pad_token_id=0)
        print("sample:", bytes(sample[0].tolist()).decode("utf-8", errors="replace"))
    torch.distributed.destroy_process_group()  # gloo's threads can abort an exiting interpreter


if __name__ == "__main__":
    main()
