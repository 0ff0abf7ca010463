"""Ranks whose work differs, on 2 CPU processes launched by Lightning (popen): for tests/test_uneven.py.

    python uneven_run.py generate OUT   # GPT-2 generate() with per-rank lengths at stage 3: the
                                        # Trainer's validation_step and predict_step, a Fabric loop,
                                        # peft; DDP's tokens for the same weights; then rank 1 raises
                                        # after rank 0 finished (the job must fail naming it)
    python uneven_run.py rank0_only OUT # generate() on rank 0 only, in a callback, at stage 3

Each rank writes what it saw to OUT/rank{r}.json; rank 0 writes OUT/finished (the time it finished).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time

import lightning as L
import torch
from torch.utils.data import DataLoader

import zero_strategy  # noqa: F401  (registers the strategy names)
from zero_strategy import ZeroFabricStrategy, ZeroStrategy

PROMPTS = [[5, 9, 2, 7], [11, 3, 8, 1]]  # rank r's (DistributedSampler, no shuffle: item r goes to rank r)


def new_tokens(rank: int) -> int:
    return 3 + 3 * rank  # rank 0 stops after 3 tokens, rank 1 after 6: as EOS makes them differ


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, initializer_range=0.5,
                        eos_token_id=None,
                        bos_token_id=None, pad_token_id=0)
    return GPT2LMHeadModel(config).eval()


def generate(model, prompt: list[int], rank: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens(rank),
                         do_sample=False, pad_token_id=0)
    return out[0].tolist()


class Generator(L.LightningModule):
    def __init__(self, model) -> None:
        super().__init__()
        self.model = model
        self.tokens: list[list[int]] = []

    def validation_step(self, batch, batch_idx):
        self.tokens.append(generate(self.model, batch[0].tolist(), self.global_rank))

    def predict_step(self, batch, batch_idx):
        return generate(self.model, batch[0].tolist(), self.global_rank)


class GenerateOnRankZero(L.Callback):
    """The commonest mistake: generation in a callback, on rank 0 only."""

    def on_validation_epoch_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            generate(pl_module.model, PROMPTS[0], 0)


def loader() -> DataLoader:
    return DataLoader(torch.tensor(PROMPTS), batch_size=1)


def trainer(strategy, **kwargs) -> L.Trainer:
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False, **kwargs)


def run_generate(out: str) -> None:
    base = tiny_gpt2()
    results = {}
    zero = Generator(copy.deepcopy(base))
    t = trainer(ZeroStrategy(stage=3))
    t.validate(zero, loader())  # the first launch: starts rank 1
    rank = t.global_rank
    results["zero_validation"] = zero.tokens
    results["zero_predict"] = t.predict(zero, loader())

    ddp = Generator(copy.deepcopy(base))
    trainer("ddp").validate(ddp, loader())
    results["ddp_validation"] = ddp.tokens

    fabric = L.Fabric(strategy=ZeroFabricStrategy(stage=3), accelerator="cpu", devices=2)
    fabric.launch()
    model = fabric.setup_module(copy.deepcopy(base))
    model.mark_forward_method("generate")  # Fabric runs it as a forward (its precision context)
    results["fabric"] = [generate(model, PROMPTS[rank], rank)]

    from peft import LoraConfig, get_peft_model  # LoRA's B starts at zero: the base model's tokens

    lora = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    lora = fabric.setup_module(lora)
    results["peft"] = [generate(lora.module, PROMPTS[rank], rank)]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    if rank == 0:
        with open(os.path.join(out, "finished"), "w") as f:
            f.write(str(time.time()))
        return  # rank 0's script ends here: the job must still wait for rank 1, and fail with it
    time.sleep(2)
    raise RuntimeError("rank 1 broke after rank 0 had finished")


def run_rank0_only(out: str) -> None:
    t = trainer(ZeroStrategy(stage=3), callbacks=[GenerateOnRankZero()])
    with open(os.path.join(out, f"started{os.environ.get('LOCAL_RANK', '0')}"), "w") as f:
        f.write(str(time.time()))
    t.validate(Generator(tiny_gpt2()), loader())


if __name__ == "__main__":
    case, out = sys.argv[1], sys.argv[2]
    {"generate": run_generate, "rank0_only": run_rank0_only}[case](out)
