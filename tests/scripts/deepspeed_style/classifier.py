"""An image classifier written as DeepSpeed's CIFAR-10 tutorial writes one, for DeepSpeed itself.

    deepspeed --num_gpus 2 classifier.py --stages 0 1 2 3 --out DIR

tests/test_deepspeed_scripts.py runs this file unchanged with DeepSpeed 0.19, and again with the
import swapped (``import zero_strategy as deepspeed``) and with every ``deepspeed`` renamed, DeepSpeed
blocked from import, and compares the losses. Synthetic 8x8 RGB images (nothing to download), a
small conv net, the config built in the script from the command line (``--stages``, ``--dtype``),
``initialize(args=args, ..., training_data=trainset, config=ds_config)``, ``engine.backward(loss)``,
``engine.step()``. Each rank writes its losses per stage to ``DIR/classifier_rank<r>.json``.
"""

import argparse
import json
import os

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F


def add_argument():
    parser = argparse.ArgumentParser(description="tiny image classifier")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--stages", type=int, nargs="+", default=[0], help="ZeRO stages to train at, in turn")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--out", default=".")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 2 * 2, 24)
        self.fc2 = nn.Linear(24, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)  # (B, 6, 4, 4)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # (B, 8, 2, 2)
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


def synthetic_images(n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, 8, 8, generator=g)
    labels = (images.mean(dim=(2, 3)) @ torch.randn(3, 4, generator=g)).argmax(-1)  # learnable from the colours
    return torch.utils.data.TensorDataset(images, labels)


def make_config(stage, dtype):
    return {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01,
                                                     "warmup_num_steps": 2}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16", "initial_scale_power": 8},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": stage, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": True, "contiguous_gradients": True},
    }


def train(args, stage):
    torch.manual_seed(1)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=synthetic_images(),
        config=make_config(stage, args.dtype))
    local_device = deepspeed.get_accelerator().device_name(model_engine.local_rank)
    target_dtype = torch.bfloat16 if model_engine.bfloat16_enabled() else (
        torch.half if model_engine.fp16_enabled() else None)
    losses = []
    for epoch in range(args.epochs):
        for inputs, labels in trainloader:
            inputs, labels = inputs.to(local_device), labels.to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            loss = F.cross_entropy(model_engine(inputs).float(), labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
    return {"losses": losses, "steps": model_engine.global_steps, "lr": model_engine.get_lr()[0],
            "stage": model_engine.zero_optimization_stage(), "local_rank": model_engine.local_rank}


def main():
    args = add_argument()
    deepspeed.init_distributed()
    deepspeed.get_accelerator().set_device(max(args.local_rank, 0))
    seen_local_rank = args.local_rank  # what the launcher passed, before initialize sets it
    results = {str(stage): train(args, stage) for stage in args.stages}
    rank, world_size = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    results["launch"] = {"local_rank_argument": seen_local_rank, "world_size": world_size,
                         "accelerator": deepspeed.get_accelerator().device_name()}
    with open(os.path.join(args.out, f"classifier_rank{rank}.json"), "w") as f:
        json.dump(results, f)
    deepspeed.comm.barrier()


if __name__ == "__main__":
    main()
