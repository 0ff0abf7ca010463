"""The model, data and DeepSpeed Muon configs behind tests/data/deepspeed_muon/reference.json.

``tests/scripts/make_deepspeed_muon.py`` trains ``MuonNet`` with DeepSpeed 0.19's Muon for each case
and records each rank's losses; ``tests/test_deepspeed_muon.py`` trains the same through
``zero_strategy.initialize`` and compares. Nothing here imports DeepSpeed or this package.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN = 29, 12, 20
MICRO, SEQ, GAS = 4, 9, 2
STEPS = 6  # optimizer steps, GAS micro-batches each

MUON = {"lr": 0.02, "adam_lr": 0.003, "momentum": 0.9, "weight_decay": 0.01, "betas": [0.9, 0.99], "eps": 1e-8}

# name: (ZeRO stage, built inside zero.Init, extra optimizer params, top-level extras, param groups)
# "groups": model_parameters as two groups, as transformers' Trainer makes them (no decay on 1-D ones)
CASES = {
    "stage0": (0, False, {}, {}, False),  # DeepSpeed clips the gradients here, the updates at stages 1-3
    "stage1": (1, False, {}, {"gradient_clipping": 0.0}, False),
    "stage2": (2, False, {}, {}, False),  # no gradient_clipping: DeepSpeed's default, 1.0
    "stage3": (3, False, {}, {}, False),
    "stage3_zero_init": (3, True, {}, {}, False),
    "stage2_standard_groups": (2, False, {"ns_method": "standard", "adam_w_mode": False},
                               {"gradient_clipping": 0.5}, True),
}


class MuonNet(nn.Module):
    """Matrices for Muon (tall, wide and square: every branch of the Newton-Schulz iterations) beside what
    DeepSpeed leaves to Adam: an embedding and an lm_head (by name), biases and a norm (1-D)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)  # (20, 12): tall
        self.fc2 = nn.Linear(HIDDEN, DIM)  # (12, 20): wide
        self.mix = nn.Linear(DIM, DIM, bias=False)  # square
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)  # (B, T, DIM)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        h = h + torch.tanh(self.mix(h))
        return F.cross_entropy(self.lm_head(self.norm(h)).flatten(0, 1), targets.flatten())


def batch(micro_step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro batch: inputs and next-token targets, each (MICRO, SEQ - 1)."""
    g = torch.Generator().manual_seed(1000 * micro_step + rank)
    tokens = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def config(case: str) -> dict:
    stage, _, params, extra, _ = CASES[case]
    zero = {"stage": stage}
    if stage == 3:  # DeepSpeed refuses Muon with its stage-3 reduce-scatter; every parameter sharded
        zero.update(reduce_scatter=False, stage3_param_persistence_threshold=0)
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "optimizer": {"type": "Muon", "params": {**MUON, **params}}, "zero_optimization": zero, **extra}


def model_parameters(model: nn.Module, case: str) -> list:
    if not CASES[case][4]:
        return list(model.parameters())
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    return [{"params": matrices, "weight_decay": 0.05},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
