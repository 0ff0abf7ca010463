"""The model, data and DeepSpeed settings behind the checkpoints in tests/data/deepspeed/.

``tests/scripts/make_deepspeed_checkpoints.py`` trains this model with DeepSpeed and saves the
checkpoints; ``tests/test_deepspeed_checkpoint.py`` rebuilds it, loads them through this package
and continues on the same data. Nothing here imports DeepSpeed: the tests run without it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN = 29, 11, 19  # 921 parameters; odd sizes, so DeepSpeed pads its partitions
BATCH, SEQ = 4, 9
SAVE_AT = 3  # DeepSpeed steps before the checkpoint
CONTINUE = 3  # steps after it, recorded as the reference a resume must reproduce
LR, BETAS, EPS, WEIGHT_DECAY = 0.01, (0.9, 0.99), 1e-8, 0.05

# case name: (ZeRO stage, precision, save tag, client state); the Lightning case saves as
# Lightning's DeepSpeedStrategy does (tag "checkpoint", Lightning's trainer state as client state)
CASES = {
    "stage1_fp32": (1, "fp32", None, None),
    "stage2_fp32": (2, "fp32", None, None),
    "stage3_fp32": (3, "fp32", None, None),
    "stage1_bf16": (1, "bf16", None, None),
    "lightning_stage2_bf16": (2, "bf16", "checkpoint", "lightning"),
    "stage3_bf16": (3, "bf16", None, None),
    "stage2_fp16": (2, "fp16", None, None),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class TiedMLP(nn.Module):
    """A tied input/output embedding (GPT-2's lm_head = wte), a frozen layer and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("mix", torch.linspace(0.5, 1.0, DIM))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)  # (B, T, DIM)
        h = h + torch.tanh(self.frozen(h)) * self.mix.to(h.dtype)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        return self.head(self.norm(h))  # (B, T, VOCAB)


def build_model(seed: int = 0) -> TiedMLP:
    torch.manual_seed(seed)
    return TiedMLP()


def param_groups(model: nn.Module) -> list[dict]:
    """Two groups, as transformers' Trainer makes them: matrices with weight decay, the rest without.
    The frozen layer is in them too (DeepSpeed users pass ``model.parameters()``)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}]


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens at ``step``: inputs and next-token targets, each (BATCH, SEQ - 1)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def batch_for(step: int, world_size: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's batch in a run of ``world_size`` ranks; a 1-rank run takes both of the 2-rank
    run's batches, so its mean loss (and gradient) is the mean of the two ranks'."""
    if world_size == 1:
        (x0, y0), (x1, y1) = batch(step, 0), batch(step, 1)
        return torch.cat([x0, x1]), torch.cat([y0, y1])
    return batch(step, rank)


def loss_of(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def deepspeed_config(stage: int, precision: str) -> dict:
    """The DeepSpeed config of a case: AdamW from the config (torch's, so it runs on CPU)."""
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "gradient_clipping": 0.0,  # DeepSpeed 0.19 clips at 1.0 unless told: resume as plain AdamW does
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                  "weight_decay": WEIGHT_DECAY, "torch_adam": True}},
        # stage 3: partition every parameter, however small (the default keeps small ones whole)
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    return config
