"""Optimizers that read a whole parameter (torch's Muon beside AdamW, Adafactor) under ZeRO stages 1-3,
against DDP on the same seed and data: losses, weights and the optimizer state dict (see [Note:
whole-parameter step] in engine/optim/step/whole.py). Parameters are cut into pieces across the ranks
(a small bucket), so every update needs the pieces put together on the owner."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from zero_strategy.config import ZeroConfig
from zero_strategy.engine import ZeroOptimizer, shard_module

from .distributed import run_distributed

STEPS = 10
BUCKET_MB = 300 * 4 / 2**20  # about 300 fp32 elements: parameters cut across ranks and segments


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 24)
        self.fc1 = nn.Linear(24, 40)
        self.fc2 = nn.Linear(40, 24)
        self.head = nn.Linear(24, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(h + self.fc2(torch.tanh(self.fc1(h))))


def _optimizers(model: nn.Module, kind: str) -> list[torch.optim.Optimizer]:
    if kind == "adafactor":
        return [torch.optim.Adafactor(model.parameters(), lr=1e-2)]
    hidden = [model.fc1.weight, model.fc2.weight]  # Muon: 2-D hidden weights; AdamW the rest, as Muon's users do
    rest = [p for p in model.parameters() if all(p is not q for q in hidden)]
    return [torch.optim.Muon(hidden, lr=2e-2), torch.optim.AdamW(rest, lr=1e-2)]


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 16, (6, 5), generator=g), torch.randint(0, 16, (6, 5), generator=g)


def _train(model, optimizers, rank: int, clip, accumulate: int = 1) -> list[float]:
    losses = []
    for step in range(STEPS):
        for opt in optimizers:
            opt.zero_grad()
        for micro in range(accumulate):  # DDP's earlier micro-batches under no_sync, the engine's all reduced
            tokens, targets = _batch(step * accumulate + micro, rank)
            last = micro == accumulate - 1
            with model.no_sync() if not last and hasattr(model, "no_sync") else contextlib.nullcontext():
                loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()) / accumulate
                loss.backward()
        if clip is not None:
            clip()
        for opt in optimizers:
            opt.step()
        losses.append(loss.item())
    return losses


def _ddp_vs_zero(rank: int, world_size: int, stage: int, kind: str, accumulate: int = 1,
                 dtype: torch.dtype = torch.float32) -> dict:
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the model's parameters, and so its gradients and optimizer state
    try:
        return _compare(rank, world_size, stage, kind, accumulate)
    finally:
        torch.set_default_dtype(default)


def _compare(rank: int, world_size: int, stage: int, kind: str, accumulate: int) -> dict:
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(reference)
    ddp_opts = _optimizers(reference, kind)
    clipping = kind == "adafactor"  # one optimizer: its clipping is the whole model's, as DDP's
    ddp_losses = _train(ddp, ddp_opts, rank, (lambda: torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5))
                        if clipping else None, accumulate)

    config = ZeroConfig(stage=stage, bucket_cap_mb=BUCKET_MB, param_persistence_threshold=0,
                        shard_modules=("Linear", "Embedding") if stage == 3 else ())
    optimizers = _optimizers(model, kind)  # built on the whole parameters: Muon checks that they are 2-D
    sharder = shard_module(model, config, optimizers=optimizers) if stage == 3 else None
    zopts = [ZeroOptimizer(opt, config, sharder=sharder) for opt in optimizers]
    zero_losses = _train(model, zopts, rank, (lambda: zopts[0].clip_grad_norm_(0.5)) if clipping else None, accumulate)
    from zero_strategy import gathered_parameters

    with gathered_parameters(model):
        weights = {n: (p.detach().clone(), q.detach().clone())
                   for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters())}
    states = [(z.state_dict(), d.state_dict()) for z, d in zip(zopts, ddp_opts)]
    owned = [len(z.state) if z.step_backend.whole_parameters else None for z in zopts]
    plan = zopts[0].step_backend.plan  # Muon's, or Adafactor's: which rank steps each parameter
    bound = sum(p.numel for p in plan.params) / world_size + max(p.numel for p in plan.params)
    return {"losses": (zero_losses, ddp_losses), "weights": weights, "states": states, "owned": owned,
            "owned_elements": sum(p.numel for p in plan.owned), "bound": bound}


def _assert_same_state(mine: dict, theirs: dict) -> None:
    assert mine["param_groups"] == theirs["param_groups"]
    assert sorted(mine["state"]) == sorted(theirs["state"])
    for index, entry in theirs["state"].items():
        assert sorted(mine["state"][index]) == sorted(entry), index
        for key, value in entry.items():
            torch.testing.assert_close(torch.as_tensor(mine["state"][index][key]), torch.as_tensor(value), rtol=1e-5,
                                       atol=1e-6, msg=lambda m: f"state[{index}][{key!r}]: {m}")


CASES = {"stage1": (1, 2, 1), "stage2": (2, 2, 1), "stage3": (3, 2, 1), "stage2-accumulating": (2, 2, 2),
         "stage3-accumulating": (3, 2, 2), "stage1-4-ranks": (1, 4, 1), "stage3-4-ranks": (3, 4, 1)}
"""name: (stage, world size, micro-batches per step). On 2 ranks a sum of two gradients is the same in any
order, so the owners see DDP's gradients bit for bit. On 4 the reductions add in other orders than DDP's
all-reduce: last-bit differences, which Adafactor (fp32 throughout) keeps at that size, but which
torch's Muon, casting each matrix to bf16 for its Newton-Schulz iterations, turns into differences of
about 1e-4 whenever one moves a value across a bf16 rounding boundary (DDP against DDP with other
buckets does the same). So Muon's 4-rank cases train an fp64 model: its reductions' differences (about
1e-16) move no bf16 rounding, and what remains to compare is the sharding."""


def _dtype(world_size: int, kind: str) -> torch.dtype:
    return torch.float64 if world_size == 4 and kind == "muon+adamw" else torch.float32


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", [(name, kind) for name in CASES for kind in ("muon+adamw", "adafactor")],
                         ids="-".join)
def test_whole_parameter_optimizers_train_as_under_ddp(case):
    name, kind = case
    stage, world_size, accumulate = CASES[name]
    results = run_distributed(_ddp_vs_zero, world_size, stage, kind, accumulate, _dtype(world_size, kind))
    for result in results:
        zero_losses, ddp_losses = result["losses"]
        torch.testing.assert_close(torch.tensor(zero_losses), torch.tensor(ddp_losses), rtol=1e-6, atol=1e-6)
        for name, (mine, theirs) in result["weights"].items():
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
        for mine, theirs in result["states"]:  # torch's layout, gathered from the owners onto every rank
            _assert_same_state(mine, theirs)
    # each parameter's state lives on one rank: the ranks' counts add up to the parameters (AdamW: pieces)
    whole = [i for i, count in enumerate(results[0]["owned"]) if count is not None]
    assert whole == [0]  # Muon, or Adafactor
    stepped = len(results[0]["states"][0][1]["state"])
    assert sum(r["owned"][0] for r in results) == stepped
    assert sum(r["owned"][0] > 0 for r in results) == min(world_size, stepped)  # shared out (Muon: 2 matrices)
    # no rank steps more than its share plus the largest parameter (the state is per element or less)
    assert all(r["owned_elements"] <= r["bound"] for r in results), [(r["owned_elements"], r["bound"]) for r in results]


SAVE_AT = 5


def _engine(stage: int, kind: str, seed: int = 0):
    torch.manual_seed(seed)
    model = Net()
    config = ZeroConfig(stage=stage, bucket_cap_mb=BUCKET_MB, param_persistence_threshold=0,
                        shard_modules=("Linear", "Embedding") if stage == 3 else ())
    optimizers = _optimizers(model, kind)
    sharder = shard_module(model, config, optimizers=optimizers) if stage == 3 else None
    return model, [ZeroOptimizer(opt, config, sharder=sharder) for opt in optimizers], sharder


def _steps(model, optimizers, world_size: int, rank: int, start: int, stop: int) -> list[float]:
    losses = []
    for step in range(start, stop):
        if world_size == 1:  # both ranks' batches: the mean of the two ranks' mean gradients
            (t0, y0), (t1, y1) = _batch(step, 0), _batch(step, 1)
            tokens, targets = torch.cat([t0, t1]), torch.cat([y0, y1])
        else:
            tokens, targets = _batch(step, rank)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        for opt in optimizers:
            opt.step()
        losses.append(loss.item())
    return losses


def _resume(folder: str, stage: int, world_size: int, rank: int) -> list[float]:
    from zero_strategy.checkpoint import CheckpointReader, load_model, load_optimizers
    from zero_strategy.checkpoint.sharded import flat_groups

    model, optimizers, sharder = _engine(stage, "muon+adamw", seed=1)  # other weights: all from the checkpoint
    reader = CheckpointReader(folder)
    saved = reader.trainer_state()["zero_checkpoint"]
    load_model(reader, saved, model, flat_groups(optimizers, sharder))
    load_optimizers(reader, saved, model, optimizers)
    return _steps(model, optimizers, world_size, rank, SAVE_AT, STEPS)


def _resume_alone(rank: int, world_size: int, folder: str) -> list[float]:
    return _resume(folder, 3, world_size, rank)


def _save_then_resume(rank: int, world_size: int, folder: str) -> dict:
    from zero_strategy.checkpoint import save_sharded
    from zero_strategy.engine import Collectives

    model, optimizers, sharder = _engine(2, "muon+adamw")
    _steps(model, optimizers, world_size, rank, 0, SAVE_AT)
    save_sharded(folder, {"global_step": SAVE_AT, "optimizer_states": [{}, {}]}, model, optimizers, sharder,
                 Collectives(), 2)
    return {"uninterrupted": _steps(model, optimizers, world_size, rank, SAVE_AT, STEPS),
            "at stage 3": _resume(folder, 3, world_size, rank)}


@pytest.mark.timeout(180)
def test_a_sharded_checkpoint_resumes_muon_and_adamw_at_another_stage_and_world_size(tmp_path):
    folder = str(tmp_path / "whole.ckpt")
    runs = run_distributed(_save_then_resume, 2, folder)
    for run in runs:  # the same world size, stage 2 -> 3: the same steps exactly
        torch.testing.assert_close(torch.tensor(run["at stage 3"]), torch.tensor(run["uninterrupted"]), rtol=0, atol=0)
    # one rank, both ranks' batches: each parameter's whole state on the one rank, the same trajectory
    alone = run_distributed(_resume_alone, 1, folder)[0]  # its loss: the mean of the two ranks' losses
    both = (torch.tensor(runs[0]["uninterrupted"]) + torch.tensor(runs[1]["uninterrupted"])) / 2
    torch.testing.assert_close(torch.tensor(alone), both, rtol=1e-5, atol=1e-6)


def test_muon_with_adamw_is_the_two_optimizers_side_by_side_and_names_its_mistakes():
    from zero_strategy.optimizers import MuonWithAdamW

    def build(seed: int = 0):
        torch.manual_seed(seed)
        return Net()

    one, two = build(), build()
    rest = [p for n, p in one.named_parameters() if n not in ("fc1.weight", "fc2.weight")]
    combined = MuonWithAdamW([{"params": [one.fc1.weight, one.fc2.weight], "use_muon": True},
                              {"params": rest, "use_muon": False}], muon={"lr": 2e-2}, adamw={"lr": 1e-2})
    separate = _optimizers(two, "muon+adamw")  # torch's Muon(lr=2e-2) and AdamW(lr=1e-2)
    assert _train(one, [combined], 0, None) == _train(two, separate, 0, None)
    for p, q in zip(one.parameters(), two.parameters()):
        assert torch.equal(p, q)
    # its state dict resumes it, as torch's optimizers' do (load_state_dict replaces the state it steps with)
    three = build()
    three.load_state_dict(two.state_dict())
    others = [p for n, p in three.named_parameters() if n not in ("fc1.weight", "fc2.weight")]
    resumed = MuonWithAdamW([{"params": [three.fc1.weight, three.fc2.weight], "use_muon": True},
                             {"params": others, "use_muon": False}], muon={"lr": 2e-2}, adamw={"lr": 1e-2})
    resumed.load_state_dict(copy.deepcopy(combined.state_dict()))  # torch's load keeps the tensors it is given
    assert _train(three, [resumed], 1, None) == _train(one, [combined], 1, None)
    with pytest.raises(ValueError, match=r"param group 0 of MuonWithAdamW has use_muon=None"):
        MuonWithAdamW([{"params": list(one.parameters())}])
    with pytest.raises(ValueError, match=r"Muon takes 2-D parameters only; .* shape \(40,\)"):
        MuonWithAdamW([{"params": [one.fc1.bias], "use_muon": True}])
    with pytest.raises(ValueError, match=r"MuonWithAdamW\(adamw=\{'nesterov': True\}\)"):
        MuonWithAdamW([{"params": [one.fc1.bias], "use_muon": False}], adamw={"nesterov": True})


def _initialize_vs_ddp(rank: int, world_size: int) -> dict:
    """DeepSpeed's loop (``initialize`` with a client optimizer, ``engine.backward``, ``engine.step``) at
    stage 3 with MuonWithAdamW, against DDP with the same optimizer."""
    from zero_strategy import initialize
    from zero_strategy.optimizers import MuonWithAdamW

    def optimizer(model: Net) -> MuonWithAdamW:
        matrices = [model.fc1.weight, model.fc2.weight]
        rest = [p for p in model.parameters() if all(p is not m for m in matrices)]
        return MuonWithAdamW([{"params": matrices, "use_muon": True}, {"params": rest, "use_muon": False}],
                             muon={"lr": 2e-2}, adamw={"lr": 1e-2})

    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(reference)
    ddp_losses = _train(ddp, [optimizer(reference)], rank, None)
    config = {"train_micro_batch_size_per_gpu": 6, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = initialize(model=model, optimizer=optimizer(model), config=config)
    losses = []
    for step in range(STEPS):
        tokens, targets = _batch(step, rank)
        loss = F.cross_entropy(engine(tokens).flatten(0, 1), targets.flatten())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": (losses, ddp_losses)}


@pytest.mark.timeout(180)
def test_muon_with_adamw_through_initialize_at_stage_3_equals_ddp():
    for result in run_distributed(_initialize_vs_ddp, 2):
        zero_losses, ddp_losses = result["losses"]
        torch.testing.assert_close(torch.tensor(zero_losses), torch.tensor(ddp_losses), rtol=1e-6, atol=1e-6)
