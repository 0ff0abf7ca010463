"""What DDP keeps in step, kept here too (issue 50), on the engine without Lightning: a module on the
engine pickles and deep-copies as the user's module at stages 1-3 (see [Note: a module's copies hold
what the user sees] in zero_strategy/engine/params/attached.py); its buffers follow DDP's broadcast
before each forward, with no_sync and evaluation forwards, against a real DDP run (see [Note: buffers
kept in step] in zero_strategy/engine/params/buffer_sync.py); and ``sync_batchnorm`` is applied or
refused before training, naming the option."""

from __future__ import annotations

import contextlib
import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from zero_strategy import ZeroConfig, gathered_parameters
from zero_strategy.engine import Collectives
from zero_strategy.frontend import WorkingPrecision, setup_engine
from zero_strategy.frontend.in_step import no_sync

from .distributed import run_distributed

STAGE3 = dict(shard_modules=("Linear",), param_persistence_threshold=0)  # every Linear a sharded unit


class BNNet(nn.Module):
    """Batch norm between linears: its running statistics follow each rank's batches."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 12)
        self.norm = nn.BatchNorm1d(12)
        self.out = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.inp(x))))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)  # other data on each rank: other statistics
    return torch.randn(6, 5, generator=g) * (1 + rank), torch.randn(6, 3, generator=g)


def _engine(model: nn.Module, stage: int, **options):
    config = ZeroConfig(stage=stage, **(STAGE3 if stage == 3 else {}), **options)
    return setup_engine(model, config, WorkingPrecision("32-true"), Collectives(), torch.device("cpu"),
                        [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)])


# ---- copies of a module on the engine -----------------------------------------------------------------


def _copies(rank: int, world_size: int) -> dict:
    out = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = BNNet()
        engine = _engine(model, stage, offload_activations=True)  # offload's hooks: closures, never pickled
        x, y = _batch(0, rank)
        F.mse_loss(model(x), y).backward()
        engine.optimizers[0].step()
        engine.optimizers[0].zero_grad()
        x = _batch(1, rank)[0]
        model.eval()
        with torch.no_grad():
            want = model(x)  # (which takes rank 0's buffers: the copies below hold them too)
        whole = {k: v.clone() for k, v in engine.full_state_dict().items()}
        refused = ""
        if stage == 3:  # released shards: a copy would be a module of empty tensors
            try:
                copy.deepcopy(model)
            except RuntimeError as err:
                refused = str(err)
        with gathered_parameters(model) if stage == 3 else contextlib.nullcontext():
            copied, pickled = copy.deepcopy(model), pickle.loads(pickle.dumps(model))
            saved = io.BytesIO()
            torch.save(model, saved)  # what Lightning does with a module in the hyper-parameters
        saved.seek(0)
        loaded = torch.load(saved, weights_only=False)
        result = {"refused": refused}
        for name, c in (("deepcopy", copied), ("pickle", pickled), ("torch.save", loaded)):
            c.eval()
            hooks = sum(len(getattr(m, key)) for m in c.modules()
                        for key in ("_forward_pre_hooks", "_forward_hooks"))
            with torch.no_grad():
                got = c(x)
            result[name] = {"state": {k: v.clone() for k, v in c.state_dict().items()}, "hooks": hooks,
                            "same_output": torch.equal(got, want), "attached": any(
                                "__getstate__" in m.__dict__ for m in c.modules())}
        result["whole"] = whole
        result["original_hooks"] = sum(len(m._forward_pre_hooks) for m in model.modules())
        engine.remove_hooks()
        result["after_removal"] = any("__getstate__" in m.__dict__ for m in model.modules())
        out[stage] = result
    return out


@pytest.mark.timeout(120)
def test_copies_of_a_module_on_the_engine_hold_the_users_module():
    for rank, out in enumerate(run_distributed(_copies, 2)):
        for stage, result in out.items():
            assert result["original_hooks"] > 0, "the engine's hooks are on the original: the test would see them"
            for name in ("deepcopy", "pickle", "torch.save"):
                got = result[name]
                assert got["hooks"] == 0 and not got["attached"], (stage, name)  # a plain module: nothing attached
                assert got["same_output"], (stage, name)
                assert got["state"].keys() == result["whole"].keys()
                for key, value in result["whole"].items():  # whole parameters, the trained values, and the buffers
                    assert torch.equal(got["state"][key], value), (rank, stage, name, key)
            if stage == 3:
                assert "gathered_parameters(module)" in result["refused"] and "empty" in result["refused"]
            assert not result["after_removal"]  # the engine took its record back with its hooks


# ---- buffers against DDP ------------------------------------------------------------------------------


def _loop(model, step, zero_grad, no_sync_context, rank: int) -> dict:
    """Two optimizer steps of two micro-batches (the first inside no_sync), an evaluation, one more
    step: DDP's flag goes through every case (see [Note: buffers kept in step])."""
    losses, evaluated = [], []
    for i in range(6):
        x, y = _batch(i, rank)
        with no_sync_context() if i % 2 == 0 else contextlib.nullcontext():
            loss = F.mse_loss(model(x), y)
            loss.backward()
        losses.append(loss.item())
        if i % 2:
            step()
            zero_grad()
        if i == 3:
            model.eval()
            with torch.no_grad():
                for j in range(2):  # the first broadcasts (a training forward came before), the second not
                    evaluated.append(model(_batch(10 + j, rank)[0]))
            model.train()
    return {"losses": losses, "evaluated": torch.stack(evaluated)}


def _buffers_vs_ddp(rank: int, world_size: int, cases: list) -> dict:
    out = {}
    for stage, broadcast in cases:
        torch.manual_seed(0)
        model = BNNet()
        reference = copy.deepcopy(model)
        ddp = DistributedDataParallel(reference, forward_sync_buffers=broadcast)  # (torch 2.13: broadcast_buffers)
        ddp_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        theirs = _loop(ddp, ddp_opt.step, ddp_opt.zero_grad, ddp.no_sync, rank)
        engine = _engine(model, stage, broadcast_buffers=broadcast)
        opt = engine.optimizers[0]
        ours = _loop(model, opt.step, opt.zero_grad, lambda: no_sync(engine.buffer_sync), rank)
        ours["state"], theirs["state"] = engine.full_state_dict(), reference.state_dict()
        out[(stage, broadcast)] = {"ours": ours, "theirs": theirs}
        engine.remove_hooks()
    return out


@pytest.mark.timeout(120)
def test_buffers_follow_ddps_broadcast_at_every_stage():
    cases = [(1, True), (2, True), (3, True), (2, False)]
    runs = run_distributed(_buffers_vs_ddp, 2, cases)
    for rank, out in enumerate(runs):
        for case, run in out.items():
            ours, theirs = run["ours"], run["theirs"]
            torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=1e-6,
                                       atol=1e-7)
            torch.testing.assert_close(ours["evaluated"], theirs["evaluated"], rtol=1e-6, atol=1e-6)
            for key, value in theirs["state"].items():  # parameters and running statistics
                torch.testing.assert_close(ours["state"][key], value, rtol=1e-6, atol=1e-6,
                                           msg=lambda m: f"{case} rank {rank} {key}: {m}")
    # the test can tell: without the broadcast, the ranks' statistics (and evaluations) part ways
    stats = [out[(2, False)]["ours"]["state"]["norm.running_mean"] for out in runs]
    assert not torch.allclose(stats[0], stats[1])
    assert not torch.allclose(runs[1][(2, False)]["ours"]["evaluated"], runs[1][(2, True)]["ours"]["evaluated"])


# ---- sync_batchnorm -----------------------------------------------------------------------------------


class _ToSync:
    """Lightning's TorchSyncBatchNorm plugin, as the strategy receives it (apply and revert)."""

    def apply(self, module: nn.Module) -> nn.Module:
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)

    def revert(self, module: nn.Module) -> nn.Module:
        raise AssertionError("the user's layers are put back as they were, not reverted into new ones")


def test_sync_batchnorm_applies_where_torch_syncs_and_is_refused_elsewhere():
    from zero_strategy.frontend.in_step import apply_layer_sync

    model = BNNet()
    norm = model.norm
    with pytest.raises(ValueError, match=r"Trainer\(sync_batchnorm=True\) on a cpu device: .*cuda.*1 batch norm "
                                         r"layers of BNNet \(\['norm'\]\).*accelerator='gpu'.*broadcast_buffers=True"):
        apply_layer_sync(_ToSync(), model, torch.device("cpu"))
    assert model.norm is norm  # refused: the model is as it was
    synced = apply_layer_sync(_ToSync(), model, torch.device("cuda", 0))  # conversion only: no CUDA needed
    assert isinstance(synced.norm, nn.SyncBatchNorm) and synced.norm.weight is norm.weight
    assert apply_layer_sync(None, model, torch.device("cpu")) is model
