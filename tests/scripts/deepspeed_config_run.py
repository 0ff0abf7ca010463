"""A DeepSpeed config given to ZeroStrategy against the same settings spelled out for Lightning, on 2
CPU processes (popen: this script runs once per rank). Both fits run in the same processes; each
rank writes what it saw to OUT/rank{r}.pt.

    python deepspeed_config_run.py --out DIR
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zero_strategy import ZeroStrategy
from zero_strategy.deepspeed.schedulers import WarmupLR

CONFIG = {  # the tutorial's config, with DeepSpeed's batch arithmetic, clipping and a schedule
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 4,  # x 2 ranks x 2 accumulation steps
    "gradient_clipping": 0.05,
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 500},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear"}},
    "steps_per_print": 10,
}


class Regressor(L.LightningModule):
    def __init__(self, own_optimizer: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(9, 32), nn.Tanh(), nn.Linear(32, 1))
        self.own_optimizer = own_optimizer
        self.losses: list[float] = []
        self.lrs: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss

    def configure_optimizers(self):
        if not self.own_optimizer:
            return None  # the strategy builds the config's
        opt = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.01)
        sched = WarmupLR(opt, warmup_num_steps=4, warmup_type="linear")
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def fit(strategy, own_optimizer: bool, **trainer_kwargs) -> dict:
    L.seed_everything(0)
    model = Regressor(own_optimizer)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(128, 9, generator=g), torch.randn(128, 1, generator=g))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=6, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        **trainer_kwargs)
    trainer.fit(model, DataLoader(data, batch_size=4))
    return {"losses": model.losses, "lrs": model.lrs, "params": trainer.strategy.full_state_dict(),
            "accumulate": trainer.accumulate_grad_batches, "clip": trainer.gradient_clip_val,
            "rank": trainer.global_rank}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from_config = fit(ZeroStrategy(config=CONFIG), own_optimizer=False)
    spelled_out = fit(ZeroStrategy(stage=2, bucket_cap_mb=500 * 4 / 2**20), own_optimizer=True,
                      accumulate_grad_batches=2, gradient_clip_val=0.05)
    torch.save({"config": from_config, "spelled_out": spelled_out},
               os.path.join(args.out, f"rank{from_config['rank']}.pt"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
