"""Write the DeepSpeed checkpoints in tests/data/deepspeed/ and DeepSpeed's own readings of them.

    DS_ACCELERATOR=cpu python tests/scripts/make_deepspeed_checkpoints.py [--out tests/data/deepspeed]

Needs DeepSpeed (``DS_BUILD_OPS=0 pip install deepspeed==0.19.8``); the tests that read the output
do not. On 2 gloo processes, for each case of ``tests/deepspeed_model.CASES``, DeepSpeed trains
``TiedMLP`` with its AdamW for ``SAVE_AT`` steps, saves with ``engine.save_checkpoint`` into
``<out>/<case>/``, then trains ``CONTINUE`` more steps on the same fixed data. Beside each
checkpoint go the references (written by DeepSpeed, never by this package):

    reference.safetensors   zero_to_fp32/<name>: get_fp32_state_dict_from_zero_checkpoint's result
                            exp_avg/<name>, exp_avg_sq/<name>: safe_get_full_optimizer_state
                            continued/<name>: safe_get_full_fp32_param after the CONTINUE steps
    reference.json          the case, DeepSpeed's version, the step count, each rank's losses in
                            the CONTINUE steps (and the loss scale and skipped steps after each),
                            the Lightning client state (Lightning case)

The recovery scripts DeepSpeed copies into every checkpoint (zero_to_fp32.py...) are removed:
they are DeepSpeed's code, not checkpoint data, and the reader does not need them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.deepspeed_model import (CASES, CONTINUE, DTYPES, SAVE_AT, batch, build_model,  # noqa: E402
                                   deepspeed_config, loss_of, param_groups)


def lightning_client_state() -> dict:
    """What Lightning's DeepSpeedStrategy passes as client state: Lightning's checkpoint dict of a
    real (single-process) fit of the same model, without state_dict and optimizer_states."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Module(L.LightningModule):
        def __init__(self, lr: float = 0.01) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.model = build_model()

        def training_step(self, data, index):
            return loss_of(self.model, data[0][0], data[1][0])

        def configure_optimizers(self):
            opt = torch.optim.AdamW(param_groups(self.model), lr=self.hparams.lr)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1000)]

    data = [tuple(t.unsqueeze(0) for t in batch(step, 0)) for step in range(SAVE_AT)]
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(max_steps=SAVE_AT, accelerator="cpu", devices=1, logger=False, default_root_dir=tmp,
                            enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[ModelCheckpoint(dirpath=tmp, save_last=True)])
        trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=None))
        checkpoint = trainer._checkpoint_connector.dump_checkpoint()
    return {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}


def _full(deepspeed, param) -> torch.Tensor:
    """A parameter's whole fp32 value on every rank (a collective at stage 3)."""
    if param.requires_grad:
        return deepspeed.utils.safe_get_full_fp32_param(param).detach().float().cpu().clone()
    with deepspeed.zero.GatheredParameters([param]):  # frozen: no master; its working weights
        return param.detach().float().cpu().clone()


def run_case(rank: int, name: str, out: Path, client_state: dict) -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_optimizer_state
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file

    stage, precision, tag, client = CASES[name]
    if precision == "fp16":
        # DeepSpeed's CPU accelerator accepts fp16 only where oneDNN has fp16 kernels (AVX512-FP16);
        # torch computes fp16 on any CPU, and the checkpoint layout does not depend on the kernels
        deepspeed.get_accelerator().is_fp16_supported = lambda: True
    model = build_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model),
                                           config=deepspeed_config(stage, precision))
    dtype = DTYPES[precision]

    def train(step: int) -> float:
        inputs, targets = batch(step, rank)
        loss = loss_of(engine, inputs.to(engine.device), targets.to(engine.device))
        engine.backward(loss)
        engine.step()
        return loss.item()

    for step in range(SAVE_AT):
        train(step)
    folder = out / name
    if rank == 0 and folder.exists():
        shutil.rmtree(folder)
    torch.distributed.barrier()
    engine.save_checkpoint(str(folder), tag=tag, client_state=client_state if client == "lightning" else {})
    torch.distributed.barrier()

    names = {p: n for n, p in model.named_parameters()}  # first names, as DeepSpeed's param_names
    if getattr(engine.optimizer, "_hp_optimizer_states_linked", None):
        # DeepSpeed 0.19.8 (stages 1-2, bf16 optimizer) links each parameter to its Adam moments after
        # the first group's first step, before the other groups have state: link them again now
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    refs: dict[str, torch.Tensor] = {}
    for p, n in names.items():
        if p.requires_grad:
            for key in ("exp_avg", "exp_avg_sq"):
                refs[f"{key}/{n}"] = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
    if rank == 0:
        fp32 = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag)
        for n, value in fp32.items():
            refs[f"zero_to_fp32/{n}"] = value.detach().cpu().clone()  # tied names: one copy each
    losses, scales = [], []
    for step in range(SAVE_AT, SAVE_AT + CONTINUE):
        losses.append(train(step))
        scaler = getattr(engine.optimizer, "loss_scaler", None)  # fp16: where the dynamic scale went
        scales.append([float(scaler.cur_scale) if scaler is not None else None, int(engine.skipped_steps)])
    for p, n in names.items():
        refs[f"continued/{n}"] = _full(deepspeed, p)
    gathered: list = [None, None]
    torch.distributed.all_gather_object(gathered, losses)
    if rank == 0:
        for script in folder.glob("*.py"):
            script.unlink()
        save_file({k: v.contiguous() for k, v in refs.items()}, str(folder / "reference.safetensors"))
        info = {"case": name, "stage": stage, "precision": precision, "tag": tag or f"global_step{SAVE_AT}",
                "deepspeed_version": deepspeed.__version__, "torch_version": torch.__version__,
                "world_size": 2, "save_at": SAVE_AT, "continue": CONTINUE, "losses": gathered,
                "loss_scale_and_skipped_steps": scales,
                "model_dtype": str(dtype).removeprefix("torch.")}
        if client == "lightning":
            info["client_state"] = {k: client_state[k] for k in ("epoch", "global_step", "loops")}
        (folder / "reference.json").write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    engine.destroy()
    torch.distributed.barrier()


def worker(rank: int, world_size: int, port: int, out: str, cases: list[str], client_state: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    for name in cases:
        run_case(rank, name, Path(out), client_state)
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "tests" / "data" / "deepspeed"))
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    client_state = lightning_client_state() if any(CASES[c][3] == "lightning" for c in args.cases) else {}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    mp.start_processes(worker, args=(2, port, args.out, args.cases, client_state), nprocs=2, start_method="spawn")
    total = sum(f.stat().st_size for f in Path(args.out).rglob("*") if f.is_file())
    print(f"wrote {len(args.cases)} checkpoints to {args.out} ({total / 1024:.0f} KiB in all)")


if __name__ == "__main__":
    main()
