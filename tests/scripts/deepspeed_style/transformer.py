"""A small causal language model trained with PyTorch-style backward, as scripts for DeepSpeed
0.18 and later write it (``loss.backward()`` on the engine's output, then ``engine.step()``).

    deepspeed --num_gpus 2 transformer.py --deepspeed_config ds.json --out DIR

The config comes from ``--deepspeed_config`` (``initialize(args=args, ...)``); ``--backward``
picks ``loss.backward()`` (torch), ``engine.scale(loss).backward()`` (scale) or
``engine.backward(loss)`` (engine; DeepSpeed refuses a direct backward at stage 0). Each rank
writes its losses to ``DIR/transformer_<tag>_rank<r>.json``. See tests/test_deepspeed_scripts.py.
"""

import argparse
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import deepspeed
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator

VOCAB, WIDTH, CONTEXT = 32, 16, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, 2, WIDTH // 2).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, W / heads)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, WIDTH))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.randn(CONTEXT, WIDTH) * 0.02)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # (B, T, VOCAB)


def batch(step, rank, size):
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, VOCAB, (size, 1), generator=g)
    return (start + torch.arange(CONTEXT + 1)) % VOCAB  # counting sequences: learnable


def main():
    parser = argparse.ArgumentParser(description="tiny causal LM")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=8, help="micro-steps")
    parser.add_argument("--backward", default="torch", choices=["torch", "scale", "engine"])
    parser.add_argument("--tag", default="run")
    parser.add_argument("--out", default=".")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    seen_local_rank = args.local_rank

    deepspeed.init_distributed()
    get_accelerator().manual_seed(0)
    torch.manual_seed(0)
    model = TinyLM()
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    device = get_accelerator().device_name(engine.local_rank)
    losses, boundaries = [], []
    for step in range(args.steps):
        tokens = batch(step, dist.get_rank(), engine.train_micro_batch_size_per_gpu()).to(device)
        logits = engine(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))
        boundaries.append(engine.is_gradient_accumulation_boundary())
        if args.backward == "torch":
            loss.backward()
        elif args.backward == "scale":
            engine.scale(loss).backward()
        else:
            engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    report = {"losses": losses, "boundaries": boundaries, "steps": engine.global_steps,
              "local_rank_argument": seen_local_rank, "world_size": dist.get_world_size(),
              "memory": get_accelerator().max_memory_allocated() > 0,
              "device_count": get_accelerator().device_count()}
    with open(os.path.join(args.out, f"transformer_{args.tag}_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()


if __name__ == "__main__":
    main()
