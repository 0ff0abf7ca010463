"""Trainer.fit(ckpt_path=<a DeepSpeed checkpoint>) with ZeroStrategy on 2 CPU processes (popen: this
script runs once per rank), continuing on the data DeepSpeed continued on after its save
(tests/deepspeed_model.py). Each rank writes its losses and whole weights to OUT/rank{r}.pt.

    python deepspeed_resume_run.py --case stage2_fp32 --stage 3 --out DIR
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/, for deepspeed_model
import deepspeed_model as dm  # noqa: E402

from zero_strategy import ZeroStrategy  # noqa: E402

DATA = Path(__file__).parents[1] / "data" / "deepspeed"


class Resumed(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = dm.build_model()  # fresh weights: everything must come from the checkpoint
        self.losses: list[float] = []

    def train_dataloader(self):
        steps = range(dm.SAVE_AT, dm.SAVE_AT + dm.CONTINUE)  # DeepSpeed's continuation, this rank's batches
        return DataLoader([dm.batch(step, self.global_rank) for step in steps], batch_size=None)

    def training_step(self, batch, batch_idx):
        loss = dm.loss_of(self.model, *batch)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):  # as DeepSpeed's config says; the frozen layer included, as users do
        return torch.optim.AdamW(dm.param_groups(self.model), lr=dm.LR, betas=dm.BETAS, eps=dm.EPS)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True)
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    module = Resumed()
    strategy = ZeroStrategy(stage=args.stage, param_persistence_threshold=0)  # stage 3: every tensor sharded
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=dm.CONTINUE, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    trainer.fit(module, ckpt_path=str(DATA / args.case))
    weights = {k.removeprefix("model."): v for k, v in trainer.strategy.full_state_dict().items()}
    torch.save({"losses": module.losses, "weights": weights},
               os.path.join(args.out, f"rank{trainer.global_rank}.pt"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
