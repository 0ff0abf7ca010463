"""Activation checkpointing and activation offload (zero_strategy/activation.py): the same training
as without them at stages 1-3 on 2 gloo processes (fp32, within 1e-6), unchanged state_dict keys,
clear errors, and the bytes saved for backward, counted exactly, at least 3x lower for an 8-block
GPT with every block checkpointed."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zero_strategy.activation import (
    SavedActivationMeter,
    apply_activation_checkpointing,
    checkpointed_modules,
    offload_activations,
    remove_activation_checkpointing,
    saved_activation_bytes,
)
from zero_strategy.config import ZeroConfig
from zero_strategy.models import GPT
from zero_strategy.models.gpt import Block

from .distributed import run_distributed

VOCAB, SEQ = 37, 12


def tiny_gpt(dropout: float = 0.1) -> GPT:
    # dropout > 0: recomputation must replay the forward's random masks
    return GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=3, n_head=2, n_embd=16, dropout=dropout)


def lm_loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
    return F.cross_entropy(model(idx[:, :-1]).reshape(-1, VOCAB), idx[:, 1:].reshape(-1))  # (B*T, V)


# ---- parity on 2 processes, through the engine ------------------------------------------------

STEPS = 4
MODES = {  # name: (checkpoint targets, interval, offload)
    "plain": ((), 1, False),
    "checkpoint": (("Block",), 1, False),
    "checkpoint+offload": ((Block,), 1, True),  # a class, not a name,
    "every-2nd+offload": (("Block",), 2, True),
}
STAGE3 = {  # name: ZeroConfig of the units
    "block-units": ZeroConfig(stage=3, shard_modules=("Block",), param_persistence_threshold=0),
    # units inside the checkpointed modules: their hooks run again during recomputation, which
    # must not release them (FeedForward: recomputation starts inside the unit, after backward
    # reached its output and gathered it)
    "linear-units": ZeroConfig(stage=3, shard_modules=("Linear",), param_persistence_threshold=0),
    "feedforward-units": ZeroConfig(stage=3, shard_modules=("FeedForward",), param_persistence_threshold=0),
}


def _train(rank: int, config: ZeroConfig, mode: str) -> dict:
    from zero_strategy.engine import ZeroOptimizer, shard_module

    targets, interval, offload = MODES[mode]
    torch.manual_seed(0)
    model = tiny_gpt()
    keys = list(model.state_dict())
    if targets:
        apply_activation_checkpointing(model, targets, interval, offload=offload)
    user_opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sharder = shard_module(model, config) if config.stage == 3 else None
    opt = ZeroOptimizer(user_opt, config, sharder=sharder)
    losses, released = [], True
    torch.manual_seed(100 + rank)  # dropout masks: the same in every mode, different per rank
    for step in range(STEPS):
        opt.zero_grad()
        with offload_activations(enabled=offload):
            loss = lm_loss(model, step, rank)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if sharder is not None:  # every unit released, none left counted as in use
            released &= all(not u.has_full_buffers and u.users == 0 for u in sharder.units)
    state = sharder.full_state_dict() if sharder is not None else {k: v.clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "state": state, "released": released, "keys_unchanged": list(state) == keys,
            "checkpointed": checkpointed_modules(model)}


def _all_modes(rank: int, world_size: int) -> dict:
    configs = {"stage1": ZeroConfig(stage=1), "stage2": ZeroConfig(stage=2), **STAGE3}
    return {(c, m): _train(rank, config, m) for c, config in configs.items() for m in MODES}


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(_all_modes, 2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("config", ["stage1", "stage2", *STAGE3])
def test_checkpointing_with_and_without_offload_matches_plain_training(runs, config):
    for rank, results in enumerate(runs):
        plain = results[(config, "plain")]
        for mode in MODES:
            got = results[(config, mode)]
            where = f"rank {rank}, {config}, {mode}"
            assert got["keys_unchanged"], where
            assert got["released"], f"{where}: a stage-3 unit stayed gathered or in use after a step"
            want = ["blocks.0", "blocks.2"] if mode == "every-2nd+offload" else ["blocks.0", "blocks.1", "blocks.2"]
            assert got["checkpointed"] == (want if MODES[mode][0] else []), where
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(plain["losses"]), rtol=0, atol=1e-6,
                                       msg=lambda m: f"{where}: {m}")
            for key, value in plain["state"].items():
                torch.testing.assert_close(got["state"][key], value, rtol=0, atol=1e-6, msg=lambda m: f"{where} {key}: {m}")
    for key, value in runs[0][(config, "checkpoint")]["state"].items():  # the ranks agree
        assert torch.equal(value, runs[1][(config, "checkpoint")]["state"][key]), key


# ---- one process: wrapping, errors, measurement -----------------------------------------------


def test_wrapping_keeps_classes_and_state_dict_keys_and_is_idempotent():
    model = tiny_gpt()
    keys, classes = list(model.state_dict()), [type(m) for m in model.modules()]
    names = apply_activation_checkpointing(model, ["Block"])
    assert names == ["blocks.0", "blocks.1", "blocks.2"]
    wrapper = model.blocks[0].forward
    assert apply_activation_checkpointing(model, ["Block"]) == names  # again: nothing wrapped twice
    assert model.blocks[0].forward is wrapper and wrapper.own_forward is None
    assert list(model.state_dict()) == keys and [type(m) for m in model.modules()] == classes
    # stage 3 finds its units by class name, as before
    from zero_strategy.engine.params.plan import plan_units

    assert [unit.name for unit in plan_units(model, ("Block",), persist_numel=0).units] == names
    copied = copy.deepcopy(model)  # the copy's wrappers run the copy, not the original
    assert checkpointed_modules(copied) == names and copied.blocks[1].forward.module is copied.blocks[1]
    assert remove_activation_checkpointing(model) == names and checkpointed_modules(model) == []
    assert "forward" not in model.blocks[0].__dict__


def test_outermost_matches_only_and_every_nth():
    model = tiny_gpt()
    # Block contains CausalSelfAttention: only the Blocks are wrapped
    assert apply_activation_checkpointing(model, ["Block", "CausalSelfAttention"]) == [f"blocks.{i}" for i in range(3)]
    other = GPT(n_layer=5, n_embd=16, n_head=2, block_size=8)
    assert apply_activation_checkpointing(other, [Block], interval=2) == ["blocks.0", "blocks.2",
                                                                                         "blocks.4"]


def test_keyword_arguments_and_evaluation_pass_through():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, *, scale, debug=False):  # `debug` is also a checkpoint() parameter
            return self.fc(x) * scale + (1.0 if debug else 0.0)

    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(3, 4, requires_grad=True)
    scale = torch.tensor(2.0, requires_grad=True)
    want = model(x, scale=scale, debug=True)
    want.sum().backward()
    grads = (x.grad.clone(), scale.grad.clone(), model.fc.weight.grad.clone())
    x.grad = scale.grad = model.fc.weight.grad = None
    apply_activation_checkpointing(model, [Scaled])
    got = model(x, scale=scale, debug=True)
    got.sum().backward()
    assert torch.equal(got, want)
    for g, w in zip((x.grad, scale.grad, model.fc.weight.grad), grads):
        assert torch.equal(g, w)
    with torch.no_grad():
        assert torch.equal(model(x, scale=scale, debug=True), want)


def test_unknown_class_names_the_class_and_lists_the_models_classes():
    with pytest.raises(ValueError, match=r"no module of class 'Blok'.*\['Block', 'CausalSelfAttention'"):
        apply_activation_checkpointing(tiny_gpt(), ["Blok"])
    with pytest.raises(ValueError, match=r"'GRU'"):
        apply_activation_checkpointing(tiny_gpt(), ["Block", nn.GRU])
    with pytest.raises(ValueError, match=r"interval=0 must be a positive integer"):
        apply_activation_checkpointing(tiny_gpt(), ["Block"], interval=0)
    with pytest.raises(ValueError, match=r"targets=\(\) must be a non-empty"):
        apply_activation_checkpointing(tiny_gpt(), [])


def test_meter_counts_each_storage_once_and_skips_parameters():
    a = torch.randn(8, 4, requires_grad=True)
    with SavedActivationMeter() as meter:
        h = a.exp()  # exp saves its output h
        h.sin()  # sin saves its input: h again, the same storage
        nn.functional.linear(h, torch.nn.Parameter(torch.randn(5, 4)))  # saves h (again) and the weight (skipped)
    assert meter.bytes == 8 * 4 * 4 and meter.tensors == 3
    assert saved_activation_bytes(lambda: (a * 2).relu()) == 8 * 4 * 4  # relu's output


def test_offload_keeps_cpu_tensors_and_gives_the_same_gradients():
    torch.manual_seed(0)
    model = tiny_gpt(dropout=0.0)
    loss = lm_loss(model, 0, 0)
    loss.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with offload_activations(pin_memory=False) as ctx:
        got_loss = lm_loss(model, 0, 0)
    got_loss.backward()
    assert ctx.enabled and torch.equal(got_loss, loss)
    for g, w in zip((p.grad for p in model.parameters()), want):
        assert torch.equal(g, w)


def test_activation_memory_drops_at_least_3x_for_8_checkpointed_blocks():
    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=64, n_layer=8, n_head=4, n_embd=64)
    idx = torch.randint(0, 256, (4, 65))

    def step() -> torch.Tensor:
        return F.cross_entropy(model(idx[:, :-1]).reshape(-1, 256), idx[:, 1:].reshape(-1))

    plain = saved_activation_bytes(step)
    apply_activation_checkpointing(model, ["Block"])
    checkpointed = saved_activation_bytes(step)
    # what stays: each block's input (B, T, C) fp32, kept for its recomputation, plus the head's
    B, T, C = 4, 64, 64
    assert checkpointed >= 8 * B * T * C * 4
    assert plain >= 3 * checkpointed, f"{plain} bytes without checkpointing, {checkpointed} with"


# ---- through Lightning's Trainer ------------------------------------------------------------------


def _fit_with_trainer(rank: int, world_size: int) -> dict:
    import lightning as L

    from zero_strategy import ZeroStrategy

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # processes exist already, as under torchrun

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = tiny_gpt()
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            loss = lm_loss(self.net, batch_idx, self.global_rank)
            self.losses.append(loss.item())
            return loss

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.zeros(STEPS * world_size, 1), batch_size=1)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    out = {}
    for name, kwargs in {"plain": {}, "checkpoint": {"activation_checkpointing": ["Block"]},
                         "offload": {"activation_checkpointing": ["Block"], "offload_activations": True}}.items():
        module = LM()
        strategy = ZeroStrategy(stage=3, shard_modules=["Block"], param_persistence_threshold=0, **kwargs)
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_steps=STEPS, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        torch.manual_seed(100 + rank)
        trainer.fit(module)
        out[name] = {"losses": module.losses, "checkpointed": checkpointed_modules(module),
                     "state": strategy.lightning_module_state_dict()}
    return out


@pytest.mark.timeout(120)
def test_zero_strategy_applies_checkpointing_at_stage_3():
    for result in run_distributed(_fit_with_trainer, 2):
        plain = result["plain"]
        assert len(plain["losses"]) == STEPS and plain["checkpointed"] == []
        for name in ("checkpoint", "offload"):
            got = result[name]
            assert got["checkpointed"] == ["net.blocks.0", "net.blocks.1", "net.blocks.2"]
            assert list(got["state"]) == list(plain["state"])
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(plain["losses"]), rtol=0, atol=1e-6)
            for key, value in plain["state"].items():
                torch.testing.assert_close(got["state"][key], value, rtol=0, atol=1e-6)


# ---- CUDA: offload moves what is saved off the device (run on a GPU machine) ------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="activation offload moves tensors only off a CUDA device")
def test_offload_on_cuda_moves_saved_activations_off_the_device():
    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=128, n_layer=8, n_head=4, n_embd=128).cuda()
    idx = torch.randint(0, 256, (8, 129), device="cuda")

    def step(offload: bool) -> tuple[int, torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with offload_activations(enabled=offload):
            loss = F.cross_entropy(model(idx[:, :-1]).reshape(-1, 256), idx[:, 1:].reshape(-1))
        held = torch.cuda.memory_allocated() - before  # device bytes kept for backward (and the loss)
        loss.backward()
        return held, loss.detach(), [p.grad.clone() for p in model.parameters()]

    runs = {"plain": step(False), "offload": step(True)}
    apply_activation_checkpointing(model, ["Block"])
    runs["checkpoint"] = step(False)
    runs["checkpoint+offload"] = step(True)
    held = {name: run[0] for name, run in runs.items()}
    assert held["offload"] * 3 < held["plain"], held
    assert held["checkpoint"] * 3 < held["plain"] and held["checkpoint+offload"] < held["checkpoint"], held
    for name, (_, loss, grads) in runs.items():
        torch.testing.assert_close(loss, runs["plain"][1], rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
        for g, w in zip(grads, runs["plain"][2]):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    print(f"device bytes held after forward: {held}")
