"""fabric.save / fabric.load with ZeroFabricStrategy, on gloo processes: a sharded checkpoint saved at
world size 2 and stage 3 (in the background, async_save) continues bit for bit at world size 1 and stage 2; the Trainer and Fabric
load each other's checkpoints; regular files go both ways between Fabric's DDP and ZeRO; a state holding a
DataLoader saves (beside the safe files) and resumes as under DDP, the DataLoader restored only with
weights_only=False."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from zero_strategy import consolidate_checkpoint
from zero_strategy.checkpoint import PickledObjectsWarning

from .distributed import run_distributed
from .test_fabric import FP32, Net, _message, assert_same, fabric_for, micro_batch, train, whole, zero


def _step(fabric, model, optimizer, scheduler, batches) -> list[float]:
    """One optimizer step over ``batches`` (micro-batches accumulated, the loss divided by their number)."""
    losses = []
    for i, (x, y) in enumerate(batches):
        with fabric.no_backward_sync(model, enabled=i < len(batches) - 1):
            loss = F.mse_loss(model(x), y)
            fabric.backward(loss / len(batches))
        losses.append(loss.item())
    fabric.clip_gradients(model, optimizer, max_norm=1e3)  # through the clipping path; the norm stays below it
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    return losses


def _model_and_state(fabric, seed: int) -> tuple:
    torch.manual_seed(seed)
    net = Net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.02, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer = fabric.setup(net, optimizer)
    return model, optimizer, scheduler


def _optimizer_state(optimizer) -> dict:
    state = optimizer.state_dict()  # torch's unsharded layout, the same at any world size and stage
    return {"state": {i: {k: v.clone() for k, v in entry.items()} for i, entry in state["state"].items()},
            "param_groups": state["param_groups"]}


def _train_and_save_at_stage_3(rank: int, world_size: int, path: str) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    fabric = fabric_for(zero(3, async_save=True), world_size)  # written in the background while training goes on
    model, optimizer, scheduler = _model_and_state(fabric, seed=0)
    for step in range(2):
        _step(fabric, model, optimizer, scheduler, [micro_batch(step, rank)])
    fabric.save(path, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 2})
    saved = {"weights": whole(fabric, model), "optimizer": _optimizer_state(optimizer)}
    losses = [_step(fabric, model, optimizer, scheduler, [micro_batch(step, rank)])[0] for step in (2, 3)]
    fabric.strategy.wait_for_saves()
    return {**saved, "losses": losses, "after": whole(fabric, model)}


def _load_at_stage_2_alone(rank: int, world_size: int, path: str) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    fabric = fabric_for(zero(2), world_size)
    model, optimizer, scheduler = _model_and_state(fabric, seed=1)  # other weights: the load must replace them
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    rest = fabric.load(path, state)
    loaded = {"weights": whole(fabric, model), "optimizer": _optimizer_state(optimizer), "step": state["step"],
              "rest": sorted(rest), "lr": scheduler.get_last_lr()}
    # the two ranks' micro-batches, accumulated: the same global batch as the run at world size 2
    losses = [_step(fabric, model, optimizer, scheduler, [micro_batch(step, r) for r in (0, 1)]) for step in (2, 3)]
    return {**loaded, "losses": losses, "after": whole(fabric, model)}


def _load_consolidated(rank: int, world_size: int, path: str) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    fabric = fabric_for(zero(1), world_size)
    model, optimizer, scheduler = _model_and_state(fabric, seed=1)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    fabric.load(path, state)  # one regular file, in Lightning's layout, with the names it was saved under
    return {"weights": whole(fabric, model), "optimizer": _optimizer_state(optimizer), "step": state["step"]}


def assert_equal_states(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


@pytest.mark.timeout(240)
def test_saved_at_world_size_2_stage_3_continues_bit_exact_at_world_size_1_stage_2(tmp_path):
    path = str(tmp_path / "run.ckpt")
    saved = run_distributed(_train_and_save_at_stage_3, 2, path)
    [loaded] = run_distributed(_load_at_stage_2_alone, 1, path)
    assert loaded["rest"] == [] and loaded["step"] == 2 and loaded["lr"] == pytest.approx([0.02 / 3])
    assert_equal_states(loaded["weights"], saved[0]["weights"])
    assert loaded["optimizer"]["param_groups"] == saved[0]["optimizer"]["param_groups"]
    for index, entry in saved[0]["optimizer"]["state"].items():
        assert_equal_states(loaded["optimizer"]["state"][index], entry)
    for step in range(2):  # each rank's micro-batch, then the same update: bit for bit
        assert [loaded["losses"][step][r] for r in (0, 1)] == [saved[r]["losses"][step] for r in (0, 1)]
    assert_equal_states(loaded["after"], saved[0]["after"])
    one_file = consolidate_checkpoint(path, tmp_path / "one.ckpt")  # zero-consolidate's function
    [consolidated] = run_distributed(_load_consolidated, 1, str(one_file))
    assert consolidated["step"] == 2
    assert_equal_states(consolidated["weights"], saved[0]["weights"])
    for index, entry in saved[0]["optimizer"]["state"].items():
        assert_equal_states(consolidated["optimizer"]["state"][index], entry)


# ---- the Trainer and Fabric load each other's checkpoints -----------------------------------------


class LitNet(L.LightningModule):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = Net()
        self.loaded_keys: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def train_dataloader(self):
        xs, ys = zip(*(micro_batch(step, 0) for step in range(8)))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.02)

    def on_load_checkpoint(self, checkpoint) -> None:
        self.loaded_keys = sorted(checkpoint)


class _AtTrainStart(L.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.weights = {k: v.detach().clone() for k, v in trainer.strategy.full_state_dict().items()}
        self.optimizer = _optimizer_state(trainer.strategy.optimizers[0])


def _trainer(stage: int, world_size: int, max_steps: int, callbacks=()) -> L.Trainer:
    from zero_strategy import ZeroStrategy

    return L.Trainer(strategy=ZeroStrategy(stage=stage), accelerator="cpu", devices=world_size, max_steps=max_steps,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, callbacks=list(callbacks))


def _trainer_and_fabric(rank: int, world_size: int, root: str) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    out = {}
    trainer = _trainer(2, world_size, max_steps=2)  # the Trainer writes, Fabric reads
    trainer.fit(LitNet(seed=0))
    trainer.save_checkpoint(f"{root}/trainer.ckpt")
    out["trainer"] = {"weights": {k: v.clone() for k, v in trainer.strategy.full_state_dict().items()},
                      "optimizer": _optimizer_state(trainer.strategy.optimizers[0])}
    fabric = fabric_for(zero(3), world_size)
    lit = LitNet(seed=1)
    model, optimizer = fabric.setup(lit, torch.optim.AdamW(lit.parameters(), lr=0.02))
    rest = fabric.load(f"{root}/trainer.ckpt", {"model": model, "optimizer": optimizer})
    out["fabric_loaded"] = {"weights": whole(fabric, model), "optimizer": _optimizer_state(optimizer),
                            "global_step": rest.get("global_step")}
    train(fabric, model, [optimizer], rank, steps=2)  # Fabric writes, the Trainer reads
    fabric.save(f"{root}/fabric.ckpt", {"model": model, "optimizer": optimizer, "step": 3})
    out["fabric"] = {"weights": whole(fabric, model), "optimizer": _optimizer_state(optimizer)}
    probe = _AtTrainStart()
    lit = LitNet(seed=2)
    _trainer(1, world_size, max_steps=1, callbacks=[probe]).fit(lit, ckpt_path=f"{root}/fabric.ckpt")
    out["trainer_loaded"] = {"weights": probe.weights, "optimizer": probe.optimizer, "keys": lit.loaded_keys}
    return out


@pytest.mark.timeout(240)
def test_the_trainer_and_fabric_load_each_others_checkpoints(tmp_path):
    for r in run_distributed(_trainer_and_fabric, 2, str(tmp_path)):
        for reader, writer in (("fabric_loaded", "trainer"), ("trainer_loaded", "fabric")):
            assert_equal_states(r[reader]["weights"], r[writer]["weights"])
            assert r[reader]["optimizer"]["param_groups"] == r[writer]["optimizer"]["param_groups"]
            for index, entry in r[writer]["optimizer"]["state"].items():
                assert_equal_states(r[reader]["optimizer"]["state"][index], entry)
        assert r["fabric_loaded"]["global_step"] == 2  # the Trainer's own state comes back to the caller
        assert "step" in r["trainer_loaded"]["keys"]  # and Fabric's extra objects reach on_load_checkpoint


# ---- regular files: Fabric's DDP writes, ZeRO reads, and the other way round ----------------------


def _regular_files(rank: int, world_size: int, root: str) -> dict:
    from zero_strategy.fabric import ZeroFabricStrategy

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    ddp = fabric_for("ddp", world_size)
    model, optimizer, scheduler = _model_and_state(ddp, seed=0)
    _step(ddp, model, optimizer, scheduler, [micro_batch(0, rank)])
    ddp.save(f"{root}/ddp.pt", {"model": model, "optimizer": optimizer, "scheduler": scheduler})
    written = {"weights": whole(ddp, model), "optimizer": _optimizer_state(optimizer)}
    continued = train(ddp, model, [optimizer], rank, steps=4)
    continued["params"] = whole(ddp, model)

    fabric = fabric_for(zero(3), world_size)
    z_model, z_optimizer, z_scheduler = _model_and_state(fabric, seed=1)
    fabric.load(f"{root}/ddp.pt", {"model": z_model, "optimizer": z_optimizer, "scheduler": z_scheduler})
    loaded = {"weights": whole(fabric, z_model), "optimizer": _optimizer_state(z_optimizer)}
    resumed = train(fabric, z_model, [z_optimizer], rank, steps=4)
    resumed["params"] = whole(fabric, z_model)

    full = fabric_for(ZeroFabricStrategy(stage=3, state_dict_type="full", param_persistence_threshold=0), world_size)
    f_model, f_optimizer, _ = _model_and_state(full, seed=3)
    full.save(f"{root}/zero_full.pt", {"model": f_model, "optimizer": f_optimizer, "note": "hi"})
    ddp2 = fabric_for("ddp", world_size)
    d_model, d_optimizer, _ = _model_and_state(ddp2, seed=4)
    state = {"model": d_model, "optimizer": d_optimizer, "note": ""}
    ddp2.load(f"{root}/zero_full.pt", state)
    return {"written": written, "loaded": loaded, "continued": continued, "resumed": resumed,
            "full": whole(full, f_model), "ddp_read_full": whole(ddp2, d_model), "note": state["note"],
            "file": os.path.isfile(f"{root}/zero_full.pt")}


@pytest.mark.timeout(240)
def test_regular_files_go_both_ways_between_fabric_ddp_and_zero(tmp_path):
    for r in run_distributed(_regular_files, 2, str(tmp_path)):
        assert_equal_states(r["loaded"]["weights"], r["written"]["weights"])
        for index, entry in r["written"]["optimizer"]["state"].items():
            assert_equal_states(r["loaded"]["optimizer"]["state"][index], entry)
        assert_same(r["resumed"], r["continued"], **FP32)  # and training goes on as DDP's does
        assert r["file"] and r["note"] == "hi"
        assert_equal_states(r["ddp_read_full"], r["full"])


# ---- a state holding a DataLoader: saved as DDP saves it, its main files still safe to load ---------


def _loader() -> torch.utils.data.DataLoader:
    xs, ys = zip(*(micro_batch(step, 0) for step in range(4)))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=4)


def _resumed(fabric, path: str, **load) -> tuple[dict, list]:
    """Load ``path`` into a model built from other weights, then train 2 steps on from it."""
    model, optimizer, scheduler = _model_and_state(fabric, seed=1)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": None, "step": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.load(path, state, **load)
    out = {"loader": type(state["loader"]).__name__, "step": state["step"],
           "warned": [str(w.message) for w in caught if w.category is PickledObjectsWarning]}
    rank = fabric.global_rank
    out["losses"] = [_step(fabric, model, optimizer, scheduler, [micro_batch(step, rank)])[0] for step in (2, 3)]
    out["params"] = whole(fabric, model)
    return out, [batch[0].sum().item() for batch in state["loader"]] if state["loader"] is not None else []


def _dataloader_in_the_state(rank: int, world_size: int, root: str, stage: int) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    out = {}
    for name, strategy in (("ddp", lambda: "ddp"), ("zero", lambda: zero(stage))):
        fabric = fabric_for(strategy(), world_size)
        model, optimizer, scheduler = _model_and_state(fabric, seed=0)
        for step in range(2):
            _step(fabric, model, optimizer, scheduler, [micro_batch(step, rank)])
        fabric.save(f"{root}/{name}.ckpt", {"model": model, "optimizer": optimizer, "scheduler": scheduler,
                                            "loader": _loader(), "step": 2})  # after training, as scripts do
        out[name], out[f"{name}_batches"] = _resumed(fabric_for(strategy(), world_size), f"{root}/{name}.ckpt",
                                                     weights_only=False)  # the file's owner trusts it
    out["ddp_refused"] = _message(lambda: fabric_for("ddp", world_size).load(f"{root}/ddp.ckpt", {"loader": None}))
    out["safe"], _ = _resumed(fabric_for(zero(stage), world_size), f"{root}/zero.ckpt")  # no opt-in
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [2, 3])
def test_a_state_holding_a_dataloader_saves_and_loads_it_only_when_asked(tmp_path, stage):
    from zero_strategy.checkpoint import store

    results = run_distributed(_dataloader_in_the_state, 2, str(tmp_path), stage)
    folder = tmp_path / "zero.ckpt"
    assert sorted(p.name for p in folder.iterdir()) == [store.INDEX, store.PICKLED_OBJECTS, store.rank_file(0),
                                                        store.rank_file(1), store.TRAINER_STATE]
    state = torch.load(folder / store.TRAINER_STATE, weights_only=True)  # the main files load safely
    assert "loader" not in state and state["step"] == 2 and state["zero_checkpoint"]["pickled_objects"] == [["loader"]]
    with pytest.raises(Exception, match="DataLoader"):  # the object itself needs pickle, as in DDP's file
        torch.load(folder / store.PICKLED_OBJECTS, weights_only=True)
    want_batches = [batch[0].sum().item() for batch in _loader()]
    for r in results:
        assert "weights_only" in r["ddp_refused"]  # DDP's own file needs the opt-in too (torch >= 2.6)
        assert r["ddp_batches"] == r["zero_batches"] == want_batches  # restored with weights_only=False
        assert r["zero"]["loader"] == "DataLoader" and r["zero"]["warned"] == []
        assert r["zero"]["step"] == r["safe"]["step"] == 2
        assert_same(r["zero"], r["ddp"], **FP32)  # the resumed run goes on as DDP's resumed run does
        assert_same(r["safe"], r["zero"], rtol=0, atol=0)  # without the opt-in: all but the loader, the same
        assert r["safe"]["loader"] == "NoneType"  # kept its value, and said why (below): the entry and the opt-in
    [warning] = results[0]["safe"]["warned"]
    assert "'loader'" in warning and "fabric.load(path, state, weights_only=False)" in warning
    assert results[1]["safe"]["warned"] == []  # rank 0 says it once


class PathLitNet(LitNet):
    """Hyper-parameters holding a Path, as scripts' ``save_hyperparameters()`` often do: a safe load refuses it."""

    def __init__(self, seed: int = 0, data_dir: Path = Path("/data")) -> None:
        super().__init__(seed)
        self.save_hyperparameters()
        self.loaded_data_dir = "not loaded"

    def on_load_checkpoint(self, checkpoint) -> None:
        self.loaded_data_dir = repr(checkpoint["hyper_parameters"].get("data_dir", "absent"))


def _trainer_state_with_a_path(rank: int, world_size: int, root: str) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    trainer = _trainer(3, world_size, max_steps=2)
    trainer.fit(PathLitNet(seed=0))
    trainer.save_checkpoint(f"{root}/trainer.ckpt")  # what ModelCheckpoint calls
    out = {"saved": {k: v.clone() for k, v in trainer.strategy.full_state_dict().items()}}
    for name, load in (("safe", {}), ("trusted", {"weights_only": False})):
        probe, lit = _AtTrainStart(), PathLitNet(seed=1, data_dir=Path("/elsewhere"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _trainer(3, world_size, max_steps=3, callbacks=[probe]).fit(lit, ckpt_path=f"{root}/trainer.ckpt", **load)
        out[name] = {"weights": probe.weights, "data_dir": lit.loaded_data_dir,
                     "warned": [str(w.message) for w in caught if w.category is PickledObjectsWarning]}
    return out


@pytest.mark.timeout(240)
def test_the_trainers_checkpoint_keeps_what_a_safe_load_refuses_beside_it(tmp_path):
    results = run_distributed(_trainer_state_with_a_path, 2, str(tmp_path))
    state = torch.load(tmp_path / "trainer.ckpt" / "trainer_state.pt", weights_only=True)
    assert state["hyper_parameters"] == {"seed": 0}  # the rest of the hyper-parameters stays in the safe file
    for rank, r in enumerate(results):
        for name in ("safe", "trusted"):
            assert_equal_states(r[name]["weights"], r["saved"])  # resumed either way
        assert r["safe"]["data_dir"] == "'absent'" and r["trusted"]["data_dir"] == "PosixPath('/data')"
        assert r["trusted"]["warned"] == [] and len(r["safe"]["warned"]) == (rank == 0)
    warning = results[0]["safe"]["warned"][0]
    assert "'hyper_parameters.data_dir'" in warning and "ckpt_path=path, weights_only=False" in warning
