"""Fine-tune a pretrained GPT-2 with ZeRO (stage 3 by default, --stage 1 or 2) on 2 CPU processes: ``from_pretrained`` in
``configure_model`` streams each rank's shards (stage 3) from the safetensors files, so no rank ever holds the
whole model; ``--lora`` trains peft LoRA adapters on the frozen, sharded base.

    python examples/finetune_pretrained/train.py                  # ~1 min on 2 CPU cores
    python examples/finetune_pretrained/train.py --lora           # adapters only
    python examples/finetune_pretrained/train.py --pretrained /models/gpt2 --accelerator cuda --devices 8

These machines reach no model hub, so unless ``--pretrained`` names a model directory, a small
GPT-2 is built from a config, briefly pre-trained on one process and saved there with
``save_pretrained``, as a stand-in for a downloaded checkpoint. Byte-level data (the Python standard
library's own source), so no tokenizer. Needs ``pip install "zero-strategy[models]"`` (and ``peft``
for ``--lora``).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
from pathlib import Path

import lightning as L
import torch

from zero_strategy import ZeroStrategy, estimate_memory
from zero_strategy.data import StdlibDataModule
from zero_strategy.models import CausalLMModule, gpt2_lm_head


class FineTune(CausalLMModule):
    """CausalLMModule whose network comes from ``from_pretrained`` in ``configure_model``."""

    def __init__(self, pretrained: str, lora: bool, lr: float) -> None:
        super().__init__(None, optimizer=functools.partial(torch.optim.AdamW, lr=lr), weight_decay=0.0)
        self.pretrained, self.lora = pretrained, lora

    def configure_model(self) -> None:
        if self.net is not None:  # Lightning calls it again for validate/test
            return
        from transformers import GPT2LMHeadModel

        net = GPT2LMHeadModel.from_pretrained(self.pretrained)  # at stage 3: on meta, streamed into the shards
        net.train()  # from_pretrained returns it in eval mode
        if self.lora:
            import peft

            net.gradient_checkpointing_enable()
            net.enable_input_require_grads()
            net = peft.get_peft_model(net, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_fc"],
                                                           lora_dropout=0.0, fan_in_fan_out=True))
        self.net = net


def pretrain_stand_in(path: Path, seq_len: int) -> None:
    """A small GPT-2 from a config, 100 steps on one process, saved with save_pretrained."""
    L.seed_everything(0)
    net = gpt2_lm_head(n_positions=seq_len, n_embd=128, n_layer=4, n_head=4)
    data = StdlibDataModule(seq_len=seq_len, batch_size=16)
    data.setup("fit")
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    for step, (idx, targets) in zip(range(100), data.train_dataloader()):
        logits = net(idx).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    net.save_pretrained(path)  # config.json and model.safetensors
    print(f"saved a stand-in pretrained GPT-2 (train loss {loss.item():.3f}) to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pretrained", default="pretrained_gpt2", help="a Hugging Face model directory")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters on the frozen base")
    parser.add_argument("--stage", type=int, default=3, help="ZeRO stage (1-3)")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=None, help="default: 1e-3, 1e-2 with --lora")
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()

    path = Path(args.pretrained)
    if not (path / "config.json").is_file() and "LOCAL_RANK" not in os.environ:  # the launching process only
        pretrain_stand_in(path, args.seq_len)
    L.seed_everything(1)
    model = FineTune(str(path), args.lora, args.lr or (1e-2 if args.lora else 1e-3))
    data = StdlibDataModule(seq_len=args.seq_len, batch_size=16)
    trainer = L.Trainer(strategy=ZeroStrategy(stage=args.stage, param_persistence_threshold=0),
                        accelerator=args.accelerator, devices=args.devices, precision=args.precision,
                        max_steps=args.max_steps, limit_val_batches=10, logger=False, enable_checkpointing=False,
                        enable_model_summary=False)
    before = trainer.validate(model, datamodule=data, verbose=False)[0]["val/loss"]
    trainer.fit(model, datamodule=data)
    after = trainer.validate(model, datamodule=data, verbose=False)[0]["val/loss"]

    total = sum(trainer.strategy._sharder.full_numel[p] for p in dict.fromkeys(model.parameters())) \
        if trainer.strategy._sharder is not None and args.stage == 3 else sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() if args.stage < 3 else trainer.strategy._sharder.full_numel[p]
                    for p in dict.fromkeys(model.parameters()) if p.requires_grad)
    measured = trainer.strategy.memory_stats()
    expected = estimate_memory(total, stage=args.stage, world_size=trainer.world_size, precision=args.precision,
                               trainable_params=trainable)
    rank = trainer.global_rank
    print(f"[rank {rank}] {total:,} parameters, {trainable:,} trained; bytes on this rank, measured vs formula:")
    for key in ("params", "grads", "optimizer_states", "master_params", "total"):
        print(f"[rank {rank}]   {key:<17}{measured[key]:>12,} {expected[key]:>12,}")
    if trainer.is_global_zero:
        print(f"validation loss {before:.3f} -> {after:.3f} nats/byte (perplexity {math.exp(after):.2f})")
    torch.distributed.destroy_process_group()  # gloo's threads can abort an exiting interpreter


if __name__ == "__main__":
    main()
