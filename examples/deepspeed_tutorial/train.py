"""DeepSpeed's tutorial loop, run by zero_strategy: the only change is the import.

    torchrun --nproc-per-node 2 examples/deepspeed_tutorial/train.py     # 2 CPU processes, gloo
    zero-launch --num_gpus 2 examples/deepspeed_tutorial/train.py        # the same, DeepSpeed's launcher line

The config, ``initialize``, ``backward``, ``step``, ``save_checkpoint`` and ``load_checkpoint`` are
DeepSpeed's; on CPU the batches go to ``model_engine.device`` (DeepSpeed's tutorials write
``model_engine.local_rank``, a CUDA device index). The data needs no download: inputs are Gaussian
and labels come from a fixed random "teacher" network, so the loss can fall well below chance's
log(10) = 2.30. Run it again and it resumes from the last epoch's checkpoint.
"""

from __future__ import annotations

import argparse
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import zero_strategy as deepspeed  # was: import deepspeed

deepspeed_config = {
    "train_batch_size": 8,
    "fp16": {"enabled": True},
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 0.0001}},
}


class Output(NamedTuple):
    loss: torch.Tensor
    logits: torch.Tensor


class MLPClassifier(nn.Module):
    """Linear(128, 512) -> ReLU -> Linear(512, 10), answering like a Hugging Face model: ``.loss``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 10))

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> Output:
        logits = self.net(inputs)  # (B, 10)
        return Output(F.cross_entropy(logits.float(), labels), logits)


def teacher_dataset(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 128, generator=g)
    teacher = torch.randn(128, 10, generator=torch.Generator().manual_seed(1234))
    return TensorDataset(x, (x @ teacher).argmax(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--checkpoint-dir", default="outputs/deepspeed_tutorial")
    parser.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by zero-launch (and DeepSpeed's launcher)")
    parser = deepspeed.add_config_arguments(parser)  # --deepspeed_config: a JSON config instead of the one below
    args = parser.parse_args()
    deepspeed_config["zero_optimization"]["stage"] = args.stage

    deepspeed.init_distributed()  # torchrun's variables (or SLURM's; or one process)
    torch.manual_seed(0)
    model = MLPClassifier()
    model_engine, optimizer, train_dataloader, _ = deepspeed.initialize(
        args=args, config=None if args.deepspeed_config else deepspeed_config, model=model, model_parameters=model.parameters(),
        training_data=teacher_dataset(args.samples))
    _, client_state = model_engine.load_checkpoint(args.checkpoint_dir)  # (None, None) on the first run
    first_epoch = client_state["epoch"] + 1 if client_state else 0

    for epoch in range(first_epoch, first_epoch + args.epochs):
        total, count = 0.0, 0
        for batch in train_dataloader:
            inputs = batch[0].to(model_engine.device)
            labels = batch[1].to(model_engine.device)
            loss = model_engine(inputs, labels=labels).loss
            model_engine.backward(loss)
            model_engine.step()
            total, count = total + loss.item(), count + 1
        model_engine.save_checkpoint(args.checkpoint_dir, client_state={"epoch": epoch})
        if model_engine.global_rank == 0:
            print(f"epoch {epoch}: mean loss {total / count:.3f} over {count} steps on rank 0, "
                  f"lr {model_engine.get_lr()[0]:g}, loss scale {optimizer.scaler.scale:g}, "
                  f"skipped steps {model_engine.skipped_steps}")


if __name__ == "__main__":
    main()
