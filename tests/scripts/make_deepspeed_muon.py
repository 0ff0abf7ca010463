"""Record DeepSpeed 0.19's losses with its Muon optimizer: tests/data/deepspeed_muon/reference.json.

    DS_ACCELERATOR=cpu TORCHDYNAMO_DISABLE=1 python tests/scripts/make_deepspeed_muon.py [--out FILE]

Needs DeepSpeed (``DS_BUILD_OPS=0 pip install --no-deps deepspeed==0.19.8``); the test that reads
the output does not (tests/test_deepspeed_muon.py, which also runs this script where DeepSpeed is
installed and compares). On 2 gloo processes, for each case of ``tests/deepspeed_muon_model.CASES``,
DeepSpeed trains ``MuonNet`` (seed 0, built inside ``deepspeed.zero.Init`` where the case says)
through ``deepspeed.initialize`` with the case's config for ``STEPS`` optimizer steps of ``GAS``
micro-batches and records each rank's loss at every micro-batch, with the dtype DeepSpeed's
Newton-Schulz iterations ran in (``ns_compute_dtype``: it depends on the CPU, so a test on another
CPU knows whether the numbers apply). ``TORCHDYNAMO_DISABLE=1`` runs DeepSpeed's Muon update eagerly:
it is wrapped in ``torch.compile``, whose inductor build takes many minutes on a small CPU and rounds
the same arithmetic differently only in the last bits.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.deepspeed_muon_model import CASES, GAS, STEPS, MuonNet, batch, config, model_parameters  # noqa: E402

DEFAULT_OUT = ROOT / "tests" / "data" / "deepspeed_muon" / "reference.json"


def run_case(rank: int, name: str) -> dict:
    import deepspeed

    torch.manual_seed(0)
    cfg = config(name)
    if CASES[name][1]:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = MuonNet()
    else:
        model = MuonNet()
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=model_parameters(model, name))
    tags = {n: bool(p.use_muon) for n, p in model.named_parameters()}
    losses = []
    for micro in range(STEPS * GAS):
        loss = engine(*batch(micro, rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    groups = [(g["name"], g["use_muon"]) for g in engine.basic_optimizer.param_groups]
    engine.destroy()
    return {"losses": losses, "use_muon": tags, "groups": groups}


def worker(rank: int, world_size: int, port: int, out: str, cases: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.runtime.zero.muon.original_muon import ns_compute_dtype

    deepspeed.init_distributed(dist_backend="gloo")
    results = {name: run_case(rank, name) for name in cases}
    gathered = [None] * world_size
    torch.distributed.all_gather_object(gathered, results)
    if rank == 0:
        info = {"deepspeed_version": deepspeed.__version__, "torch_version": torch.__version__, "world_size": 2,
                "ns_dtype": {m: str(ns_compute_dtype(m)).removeprefix("torch.") for m in ("gram", "standard")},
                "cases": {name: {"losses": [r[name]["losses"] for r in gathered], "use_muon": results[name]["use_muon"],
                                 "groups": results[name]["groups"]} for name in cases}}
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(2, port, args.out, args.cases), nprocs=2, start_method="spawn")
    print(f"wrote DeepSpeed's losses for {len(args.cases)} cases to {args.out}")


if __name__ == "__main__":
    main()
