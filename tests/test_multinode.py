"""Two "nodes" of one process each on loopback, each started by its own torchrun, as a cluster
would start them: both must finish and end with the same model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zero_strategy.checkpoint import is_sharded_checkpoint

from .cli_runs import clean_env, script
from .distributed import free_port


@pytest.mark.timeout(240)
def test_two_nodes_with_torchrun_agree(tmp_path):
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
               script("zero-train"),  # torchrun runs the console script (a Python file) per process
               "experiment=smoke", "trainer=multi_node", "trainer.devices=1", "trainer.accelerator=cpu",
               f"hydra.run.dir={tmp_path / f'node{node}'}"]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=200) for p in procs]
    for node, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"node {node} failed:\n{out[-3000:]}\n{err[-5000:]}"
    # each node's run folder holds its own rank's summary only
    rank0 = json.loads((tmp_path / "node0" / "summary_rank0.json").read_text())
    rank1 = json.loads((tmp_path / "node1" / "summary_rank1.json").read_text())
    assert (rank0["global_rank"], rank1["global_rank"]) == (0, 1)
    assert rank0["world_size"] == rank1["world_size"] == 2 and rank0["global_step"] == rank1["global_step"] == 6
    assert rank0["param_digest"] == rank1["param_digest"]  # same model on both nodes after training
    assert rank0["metrics"]["val/loss"] == rank1["metrics"]["val/loss"]  # synced over both nodes
    last = tmp_path / "node0" / "checkpoints" / "last.ckpt"
    assert is_sharded_checkpoint(last)  # every rank wrote its part, rank 0 the index
    assert sorted(f.name for f in last.glob("rank_*.safetensors")) == ["rank_00000.safetensors", "rank_00001.safetensors"]
