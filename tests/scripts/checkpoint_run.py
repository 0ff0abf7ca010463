"""Checkpoints through Lightning on 2 CPU processes (popen: this script runs once per rank).

    python checkpoint_run.py --strategy zero3 --out DIR [--resume CKPT] [--async-save]

Trains a tiny language model (tied input/output embedding, a frozen layer) for 2 epochs of 4 steps,
with two ModelCheckpoints: one per epoch (kept) and the best by training loss (top-1, so older
ones are removed), both with ``last``. With ``--resume`` the run starts from CKPT and trains the
second epoch only. Each rank writes what it saw to OUT/rank{r}.pt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from zero_strategy import ZeroStrategy

VOCAB, DIM, SEQ = 23, 16, 6


class TinyLM(L.LightningModule):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, dim)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.block = nn.Sequential(nn.Linear(dim, 2 * dim), nn.Tanh(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as GPT-2's lm_head
        self.losses: list[float] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)  # (B, T, C)
        h = h + self.block(torch.tanh(self.frozen(h)))
        return self.head(h)  # (B, T, vocab)

    def training_step(self, batch, batch_idx):
        logits = self(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.1)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}


def strategy(name: str, async_save: bool = False):
    if name == "ddp":
        return "ddp"
    stage = {"zero1": 1, "zero2": 2, "zero3": 3}[name]
    units = dict(shard_modules=("Linear", "Embedding"), param_persistence_threshold=0) if stage == 3 else {}
    return ZeroStrategy(stage=stage, async_save=async_save, **units)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True, choices=["ddp", "zero1", "zero2", "zero3"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume", default=None, help="a checkpoint to start the second epoch from")
    parser.add_argument("--async-save", action="store_true", help="ZeroStrategy(async_save=True)")
    parser.add_argument("--cases", help="JSON: case name -> extra arguments, run in turn; each writes OUT/<case>/")
    args = parser.parse_args()
    if args.cases is None:
        run(args)
    else:  # as tests/scripts/lightning_run.py's --cases: a case may resume from an earlier case's checkpoint
        for name, extra in json.loads(args.cases).items():
            case = parser.parse_args([*sys.argv[1:], *extra])
            case.out = os.path.join(args.out, name)
            run(case)
    torch.distributed.destroy_process_group()


def run(args: argparse.Namespace) -> None:
    L.seed_everything(0)
    model = TinyLM()
    tokens = torch.randint(0, VOCAB, (32, SEQ + 1), generator=torch.Generator().manual_seed(1))
    callbacks = [
        ModelCheckpoint(dirpath=os.path.join(args.out, "epochs"), filename="{epoch}", every_n_epochs=1,
                        save_top_k=-1, save_last=True),
        ModelCheckpoint(dirpath=os.path.join(args.out, "best"), filename="best-{step}", monitor="train_loss",
                        every_n_train_steps=1, save_top_k=1, mode="min"),
    ]
    trainer = L.Trainer(strategy=strategy(args.strategy, args.async_save), accelerator="cpu", devices=2, max_epochs=2, logger=False,
                        callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(tokens, batch_size=4), ckpt_path=args.resume)
    state = trainer.strategy.full_state_dict() if args.strategy != "ddp" else trainer.strategy.lightning_module_state_dict()
    os.makedirs(args.out, exist_ok=True)
    torch.save({"losses": model.losses, "params": state, "best": callbacks[1].best_model_path,
                "scheduler_on": trainer.lr_scheduler_configs[0].scheduler.optimizer is trainer.optimizers[0],
                "optimizer_name": type(trainer.lr_scheduler_configs[0].scheduler.optimizer).__name__,
                "optim": trainer.optimizers[0].state_dict()},
               os.path.join(args.out, f"rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main()
