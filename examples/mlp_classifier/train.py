"""An MLP classifier (Linear 128->512, ReLU, Linear 512->10) trained with ZeRO on 2 CPU processes.

    python examples/mlp_classifier/train.py                       # ZeRO-2, 2 processes, CPU
    python examples/mlp_classifier/train.py --stage 1 --max-steps 400
    python examples/mlp_classifier/train.py --accelerator cuda --devices 8

The data needs no download: inputs are Gaussian and labels come from a fixed random "teacher"
network, so a good classifier exists and accuracy climbs well above chance (10%).
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zero_strategy import ZeroStrategy, estimate_memory


def teacher_dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 128, generator=g)
    teacher = torch.randn(128, 10, generator=torch.Generator().manual_seed(1234))  # same for every split
    return TensorDataset(x, (x @ teacher).argmax(-1))


class MLPClassifier(L.LightningModule):
    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 10))
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # (B, 10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_acc(self(x), y)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=2, help="ZeRO stage (1 or 2)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    L.seed_everything(0)
    model = MLPClassifier()
    train = DataLoader(teacher_dataset(8192, seed=1), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(teacher_dataset(1024, seed=2), batch_size=256)
    trainer = L.Trainer(
        strategy=ZeroStrategy(stage=args.stage), accelerator=args.accelerator, devices=args.devices,
        max_steps=args.max_steps, val_check_interval=50, logger=False, enable_checkpointing=False,
    )
    trainer.fit(model, train, val)
    final = trainer.validate(model, val, verbose=False)[0]

    n = sum(p.numel() for p in model.parameters())
    measured = trainer.strategy.memory_stats()
    expected = estimate_memory(n, stage=args.stage, world_size=trainer.world_size)
    print(f"[rank {trainer.global_rank}] {n:,} parameters; bytes on this rank, measured vs ZeRO formula:")
    for key in ("params", "grads", "optimizer_states", "master_params", "total"):
        print(f"[rank {trainer.global_rank}]   {key:<17}{measured[key]:>12,} {expected[key]:>12,}")
    if trainer.is_global_zero:
        print(f"validation accuracy: {final['val_acc']:.3f} (chance: 0.100)")
    torch.distributed.destroy_process_group()  # gloo's threads can abort an exiting interpreter


if __name__ == "__main__":
    main()
