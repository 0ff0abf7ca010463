"""Lightning training runs on 2 CPU processes, launched as users launch them (popen: this script
runs once per rank). Each rank writes what it saw to OUT/rank{r}.pt for the tests to compare.

    python lightning_run.py --strategy zero_stage_2 --out DIR [--steps 12] [--stop-at K] [--clip 0.05] ...
    python lightning_run.py --strategy zero_stage_2 --out DIR --cases '{"plain": [], "clip": ["--clip", "0.05"]}'

With ``--cases`` (JSON: case name -> extra arguments) the ranks run each case in turn in the same
two processes, one Trainer after another (each from ``seed_everything(0)``, as a fresh launch
would), writing OUT/<case>/rank{r}.pt: one launch serves many tests that share a strategy.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from zero_strategy import ZeroPrecision, ZeroStrategy  # the import registers "zero_stage_1", "zero_stage_2", ...


def dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 11, generator=g)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()  # 3 classes
    return TensorDataset(x, y)


class Classifier(L.LightningModule):
    def __init__(self, build_in_configure_model: bool = False) -> None:
        super().__init__()
        if not build_in_configure_model:
            self.configure_model()
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)
        self.test_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)
        self.losses: list[float] = []
        self.lrs: list[float] = []

    def configure_model(self) -> None:
        if hasattr(self, "head"):
            return
        self.embed = nn.Linear(11, 11)
        self.embed.requires_grad_(False)  # a frozen layer
        self.body = nn.Sequential(nn.Linear(11, 37), nn.Tanh(), nn.Linear(37, 37), nn.Tanh())
        self.head = nn.Linear(37, 3)
        self.built_on = self.head.weight.device.type

    def forward(self, x):
        return self.head(self.body(self.embed(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", self.val_acc)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.test_acc(self(x), y)
        self.log("test_acc", self.test_acc)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2 and p.requires_grad]
        other = [p for p in self.parameters() if p.dim() < 2 and p.requires_grad]
        opt = torch.optim.Adam([{"params": decay, "weight_decay": 0.01}, {"params": other, "lr": 0.02}], lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class TwoOptimizers(Classifier):
    """Manual optimization with two optimizers over disjoint parameters, GAN style: the head learns
    from detached features, then the body learns through the updated head."""

    def __init__(self, build_in_configure_model: bool = False) -> None:
        super().__init__(build_in_configure_model)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_body, opt_head = self.optimizers()
        features = self.body(self.embed(x))
        loss_head = F.cross_entropy(self.head(features.detach()), y)
        opt_head.zero_grad()
        self.manual_backward(loss_head)
        opt_head.step()
        loss = F.cross_entropy(self.head(features), y)
        opt_body.zero_grad()
        self.manual_backward(loss)
        opt_body.step()
        self.losses.append(loss_head.item())
        self.losses.append(loss.item())
        self.lrs.append(opt_body.param_groups[0]["lr"])
        self.log("train_loss", loss, sync_dist=True)

    def configure_optimizers(self):
        opt_body = torch.optim.Adam([p for p in self.body.parameters()], lr=0.01)
        opt_head = torch.optim.SGD(self.head.parameters(), lr=0.05, momentum=0.9)
        return [opt_body, opt_head]

    def on_train_batch_end(self, *args):
        self.trainer.optimizers[0].param_groups[0]["lr"] *= 0.9  # a schedule, stepped by hand


class WithMuon(TwoOptimizers):
    """Manual optimization with Muon on the body's matrices and AdamW on the rest, as Muon's users run it
    (torch's Muon takes 2-D parameters only), one loss for both."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        muon, adamw = self.optimizers()
        loss = F.cross_entropy(self(x), y)
        muon.zero_grad()
        adamw.zero_grad()
        self.manual_backward(loss)
        muon.step()
        adamw.step()
        self.losses.append(loss.item())
        self.lrs.append(muon.param_groups[0]["lr"])
        self.log("train_loss", loss, sync_dist=True)

    def configure_optimizers(self):
        matrices = [p for p in self.body.parameters() if p.dim() == 2]
        rest = [p for p in self.parameters() if p.requires_grad and all(p is not m for m in matrices)]
        return [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=0.01)]


class WithMuonAdamW(Classifier):
    """Automatic optimization with one optimizer: zero_strategy.optimizers.MuonWithAdamW (Muon on the
    body's matrices, AdamW on the rest) and a StepLR schedule stepped by Lightning."""

    def configure_optimizers(self):
        from zero_strategy.optimizers import MuonWithAdamW

        matrices = [p for p in self.body.parameters() if p.dim() == 2]
        rest = [p for p in self.parameters() if p.requires_grad and all(p is not m for m in matrices)]
        opt = MuonWithAdamW([{"params": matrices, "use_muon": True}, {"params": rest, "use_muon": False}],
                            muon={"lr": 0.02}, adamw={"lr": 0.01})
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class HashedExperts(nn.Module):
    """Experts chosen by each token's features, with no router (issue 52): each expert runs on its tokens
    only, so the ranks call different experts, which stage 3 learns to gather as one unit (see [Note:
    learned leaves] in zero_strategy/engine/params/leaves.py). Its Linears hold over 100,000 weights:
    ``zero_stage_3``'s defaults shard them."""

    def __init__(self, width: int = 128, hidden: int = 800, experts: int = 8) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, width))
                                     for _ in range(experts))

    def forward(self, x):
        choice = (x[:, 0].detach() * 1000).long().abs() % len(self.experts)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().squeeze(1)
            if rows.numel():
                out = out.index_add(0, rows, expert(x[rows]))
        return out


class MoEClassifier(Classifier):
    def configure_model(self) -> None:
        if hasattr(self, "head"):
            return
        self.embed = nn.Linear(11, 128)
        self.body = HashedExperts()
        self.head = nn.Linear(128, 3)
        self.built_on = self.head.weight.device.type

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        return self.head(h + self.body(h))


class Net(nn.Module):
    """The Classifier's layers as a network of their own, with a batch norm whose running statistics
    follow each rank's batches (see [Note: buffers kept in step] in zero_strategy/engine/params/buffer_sync.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(11, 11)
        self.body = nn.Sequential(nn.Linear(11, 37), nn.BatchNorm1d(37), nn.Tanh(), nn.Linear(37, 37), nn.Tanh())
        self.head = nn.Linear(37, 3)

    def forward(self, x):
        return self.head(self.body(self.embed(x)))


class NetInHparams(Classifier):
    """The network passed to __init__ and kept in the hyper-parameters (``save_hyperparameters()``), as
    lightning-hydra-template does: Lightning pickles it into every checkpoint. What the resumed run
    unpickled is kept in ``loaded_net``."""

    def __init__(self, net: nn.Module, build_in_configure_model: bool = False) -> None:
        super().__init__(build_in_configure_model=True)  # no layers of the Classifier's own
        self.save_hyperparameters()
        self.net = net
        self.built_on = net.head.weight.device.type
        self.loaded_net: dict = {}

    def configure_model(self) -> None:
        pass

    def forward(self, x):
        return self.net(x)

    def on_load_checkpoint(self, checkpoint):
        self.loaded_net = {k: v.clone() for k, v in checkpoint["hyper_parameters"]["net"].state_dict().items()}


def loaders():
    train = DataLoader(dataset(8 * 2 * 12 * 4, 1), batch_size=8)  # enough batches for 12 steps of 4
    val = DataLoader(dataset(64, 2), batch_size=16)
    return train, val


def strategy(name: str, broadcast_buffers: bool = True):
    if not broadcast_buffers:  # DDP's option, and ZeroStrategy's of the same name
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(broadcast_buffers=False) if name == "ddp" else ZeroStrategy(stage=int(name[-1]),
                                                                                        broadcast_buffers=False)
    if name == "zero3-linear":  # every Linear its own unit, nothing resident: the real stage 3 paths
        # the order guard checks every pass here, so that comm_stats() of the last step holds its tags
        return ZeroStrategy(stage=3, shard_modules=("Linear",), param_persistence_threshold=0)
    if name == "zero2-offload-overlap":  # the host step started during backward
        return ZeroStrategy(stage=2, offload_optimizer=True, offload_overlap=True)
    if name == "zero2-local":  # local accumulation: one reduction per optimizer step
        return ZeroStrategy(stage=2, local_accumulation=True)
    if name == "zero3-linear-hsdp":  # hybrid sharding: shard groups of one rank, replicated twice
        return ZeroStrategy(stage=3, shard_modules=("Linear",), param_persistence_threshold=0, shard_group_size=1)
    if name == "zero3-linear-local":
        return ZeroStrategy(stage=3, shard_modules=("Linear",), param_persistence_threshold=0,
                            local_accumulation=True)
    return name


def precision(args) -> dict:
    if args.precision == "16-mixed" and args.strategy != "ddp":
        # fp16 weights on CPU, where autocast has no fp16; a scale of 2**8 does not overflow here, so
        # no step is skipped and the run stays comparable with fp32 (overflow is tested elsewhere)
        return {"plugins": [ZeroPrecision("16-mixed", initial_scale_power=8)]}
    return {"precision": args.precision}


def trainer(args, max_steps: int, callbacks: tuple = ()) -> L.Trainer:
    return L.Trainer(
        **precision(args),
        strategy=strategy(args.strategy, not args.no_broadcast_buffers), accelerator="cpu", devices=2,
        max_steps=max_steps, val_check_interval=4, logger=False, enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks), enable_progress_bar=False, enable_model_summary=False,
        gradient_clip_val=args.clip or None, gradient_clip_algorithm=args.clip_algorithm,
        accumulate_grad_batches=args.accumulate,
        log_every_n_steps=args.log_every,
    )


def whole_state(trainer: L.Trainer) -> dict:
    """The module's state dict as the user sees it, on every rank (ZeroStrategy's gathers: a collective)."""
    strategy = trainer.strategy
    return strategy.full_state_dict() if hasattr(strategy, "full_state_dict") else strategy.lightning_module_state_dict()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--cases", help="JSON: case name -> extra arguments; each case writes OUT/<case>/")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--clip", type=float, default=0.0)
    parser.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    parser.add_argument("--configure-model", action="store_true", help="build the layers in configure_model")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--manual", action="store_true", help="manual optimization with two optimizers")
    parser.add_argument("--muon", action="store_true", help="manual optimization: Muon and AdamW")
    parser.add_argument("--muon-one", action="store_true", help="automatic optimization: MuonWithAdamW")
    parser.add_argument("--clip-algorithm", default="norm", choices=["norm", "value"])
    parser.add_argument("--stop-at", type=int, default=0, help="fit to this step, save, resume in a new Trainer")
    parser.add_argument("--net-in-hparams", action="store_true",
                        help="NetInHparams (a batch norm; with --stop-at saved by ModelCheckpoint)")
    parser.add_argument("--no-broadcast-buffers", action="store_true", help="broadcast_buffers=False")
    parser.add_argument("--log-every", type=int, default=50, help="Trainer(log_every_n_steps=...)")
    parser.add_argument("--keep-printed", action="store_true", help="save what fit printed to stdout")
    parser.add_argument("--moe", action="store_true", help="MoEClassifier: experts chosen without a router")
    args = parser.parse_args()
    if args.cases is None:
        run(args)
    else:
        for name, extra in json.loads(args.cases).items():
            case = parser.parse_args([*sys.argv[1:], *extra])  # a case's arguments come last: they win
            case.out = os.path.join(args.out, name)
            os.makedirs(case.out, exist_ok=True)
            run(case)
    # Leaving gloo's threads to interpreter shutdown sometimes aborts the process
    # ("terminate called without an active exception"), with DDP as with ZeRO.
    torch.distributed.destroy_process_group()


def run(args: argparse.Namespace) -> None:
    """One case: fit (with validation), validate, test, predict; save what this rank saw."""
    L.seed_everything(0)
    model_class = (WithMuon if args.muon else WithMuonAdamW if args.muon_one else TwoOptimizers if args.manual
                   else MoEClassifier if args.moe else Classifier)
    if args.net_in_hparams:
        def model_class(configure_model: bool) -> NetInHparams:
            return NetInHparams(Net(), configure_model)
    model = model_class(args.configure_model)
    train, val = loaders()
    net_at_save: dict = {}
    if args.stop_at:
        # a network in the hyper-parameters: saved by ModelCheckpoint, as users' runs save (resumed with
        # weights_only=False, which unpickling a module needs, under DDP as here)
        saver = ModelCheckpoint(os.path.join(args.out, "checkpoints"), every_n_train_steps=args.stop_at)
        first = trainer(args, args.stop_at, (saver,) if args.net_in_hparams else ())
        first.fit(model, train, val)
        if args.net_in_hparams:
            ckpt = saver.best_model_path
            net_at_save = {k[len("net."):]: v for k, v in whole_state(first).items() if k.startswith("net.")}
        else:
            ckpt = os.path.join(args.out, "mid.ckpt")
            first.save_checkpoint(ckpt)
        model = model_class(args.configure_model)  # fresh weights: everything must come from the checkpoint
        model.losses = first.lightning_module.losses
        model.lrs = first.lightning_module.lrs
        fit_trainer = trainer(args, args.steps)
        fit_trainer.fit(model, train, val, ckpt_path=ckpt, weights_only=False if args.net_in_hparams else None)
    else:
        fit_trainer = trainer(args, args.steps)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed) if args.keep_printed else contextlib.nullcontext():
            fit_trainer.fit(model, train, val)
    fit_metrics = {k: float(v) for k, v in fit_trainer.callback_metrics.items()}  # before validate resets them
    fit_buffers = {k: v.clone() for k, v in model.named_buffers()}  # before validate's set-up takes rank 0's
    memory = fit_trainer.strategy.memory_stats() if hasattr(fit_trainer.strategy, "memory_stats") else {}
    comm = fit_trainer.strategy.comm_stats() if hasattr(fit_trainer.strategy, "comm_stats") else {}
    config = dataclasses.asdict(fit_trainer.strategy.config) if hasattr(fit_trainer.strategy, "config") else {}
    overlap = getattr(fit_trainer.optimizers[0], "offload_overlap_stats", dict)()
    validated = fit_trainer.validate(model, val, verbose=False)
    tested = fit_trainer.test(model, val, verbose=False)
    predicted = fit_trainer.predict(model, val)
    rank = fit_trainer.global_rank
    strategy = fit_trainer.strategy
    sharder = getattr(strategy, "_sharder", None)
    strategy.barrier("end")
    collectives = {
        "reduce_sum": strategy.reduce(torch.tensor(float(rank + 1)), reduce_op="sum"),
        "reduce_mean": strategy.reduce(torch.tensor(float(rank + 1))),
        "all_gather": strategy.all_gather(torch.tensor([rank, 10 * rank])),
        "broadcast": strategy.broadcast(f"from rank {rank}"),
    }
    torch.save({
        "losses": model.losses, "lrs": model.lrs, "validate": validated, "test": tested,
        "predict": torch.cat(predicted), "memory": memory, "comm": comm, "config": config, "collectives": collectives,
        "overlap": overlap,
        "built_on": model.built_on,
        "metrics": fit_metrics, "world_size": fit_trainer.world_size,
        # whole at every stage (a collective); ZeroStrategy's lightning_module_state_dict is empty: see
        # [Note: checkpoint layout] in zero_strategy/checkpoint/store.py
        "params": whole_state(fit_trainer),
        "net_at_save": net_at_save, "loaded_net": getattr(model, "loaded_net", {}), "fit_buffers": fit_buffers,
        "printed": printed.getvalue() if args.keep_printed and not args.stop_at else "",
        "units": [u.name for u in sharder.units] if sharder is not None else [],
        "learned": list(sharder.learner.learned) if sharder is not None and sharder.learner is not None else [],
    }, os.path.join(args.out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
