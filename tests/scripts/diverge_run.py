"""Ranks that disagree, on 2 CPU processes: each case must end every process with a message naming
the cause, never hang. tests/test_failures.py runs it and reads the processes' output.

    python diverge_run.py skip|twice         # Lightning fit at stage 3; rank 1 diverges at step 3
    python diverge_run.py hang|sigterm       # engine only (RANK/WORLD_SIZE set by the test): rank 0
                                             # waits in a collective that rank 1 never joins
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

DIVERGE_AT = 2  # global step (0-based) at which rank 1 runs other units


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def lightning_case(case: str) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    from zero_strategy import ZeroStrategy

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(16) for _ in range(3))
            self.head = nn.Linear(16, 1)

        def training_step(self, batch, batch_idx):
            h = batch
            for i, block in enumerate(self.blocks):
                diverging = self.global_rank == 1 and self.global_step == DIVERGE_AT
                if diverging and case == "skip" and i == 1:
                    continue  # a data-dependent branch taken on one rank only
                h = block(h)
                if diverging and case == "twice" and i == 0:
                    h = block(h)  # one rank runs a block again
            return F.mse_loss(self.head(h), torch.zeros(len(h), 1))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    L.seed_everything(0)
    trainer = L.Trainer(strategy=ZeroStrategy(stage=3, shard_modules=["Block"], param_persistence_threshold=0),
                        accelerator="cpu", devices=2, max_steps=6, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Net(), DataLoader(torch.randn(64, 16), batch_size=4))


def engine_case(case: str) -> None:
    import torch.distributed as dist

    from zero_strategy.engine import Collectives
    from zero_strategy.engine.diagnose.watchdog import install_sigterm_handler

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    comm = Collectives(collective_timeout=3.0 if case == "hang" else 600.0)
    install_sigterm_handler()
    comm.all_reduce(torch.ones(1), what=lambda: "warm-up all-reduce")
    if rank == 0:
        print("rank 0 waiting", flush=True)
        comm.all_reduce(torch.ones(4), what=lambda: "all-reduce that rank 1 never joins")
    else:
        time.sleep(120)  # the test ends it
    print(f"rank {rank}: should not get here", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    name = sys.argv[1]
    if name in ("skip", "twice"):
        lightning_case(name)
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        engine_case(name)
