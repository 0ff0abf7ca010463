"""Hybrid sharding (issue 32, [Note: hybrid sharding] in zero_strategy/engine/comm/topology.py) on 4 gloo ranks laid out
as 2 nodes of 2, with shard_group_size=2 (the node): stages 1-3 equal DDP (1e-5); comm_stats()
equals the communication model's prediction exactly, every all-gather and reduce-scatter stays
inside a node and only all-reduces cross one; checkpoints are written by the first shard group and
load at another layout (HSDP to plain stage 3, and back). One launch covers all of it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zero_strategy import gathered_parameters
from zero_strategy.checkpoint import CheckpointReader, load_model, load_optimizers, save_sharded
from zero_strategy.checkpoint.hf_export import LiveSource
from zero_strategy.checkpoint.sharded import flat_groups, writes_shards
from zero_strategy.comm_model import predict_step_bytes
from zero_strategy.config import ZeroConfig
from zero_strategy.engine import Collectives, ZeroOptimizer, shard_module
from zero_strategy.engine.comm.volume import sent_bytes
from zero_strategy.engine.comm.topology import HybridMesh, resolve_shard_group_size
from zero_strategy.engine.diagnose.tally import TALLY_BYTES
from zero_strategy.memory import estimate_memory, memory_stats

from .distributed import run_distributed
from .models import BlockNet, block_net_config

WORLD, PER_NODE, STEPS, ACCUM = 4, 2, 3, 4


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def _build(stage: int, seed: int = 0, **options):
    torch.manual_seed(seed)
    model = BlockNet()
    config = block_net_config(stage, **options)
    comm = Collectives(ranks_per_node=PER_NODE)
    sharder = shard_module(model, config, comm) if stage == 3 else None
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), config, comm, sharder=sharder)
    return model, opt, sharder


def _train(model, opt, rank: int, start: int, stop: int, clip: bool = False) -> None:
    for step in range(start, stop):
        x, y = _batch(rank, step)
        F.mse_loss(model(x), y).backward()
        if clip:
            opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()


def _train_accumulating(model, opt, rank: int, last_deferred: bool = False) -> None:
    """STEPS optimizer steps of ACCUM micro-batches, those before the last inside ``no_sync`` (the
    last too with ``last_deferred``: the step finds the sums pending)."""
    for step in range(STEPS):
        for micro in range(ACCUM):
            x, y = _batch(rank, 10 * step + micro)
            with opt.no_sync() if last_deferred or micro < ACCUM - 1 else torch.enable_grad():
                (F.mse_loss(model(x), y) / ACCUM).backward()
        opt.step()
        opt.zero_grad()


def _params(model) -> dict[str, torch.Tensor]:
    with gathered_parameters(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _ddp(rank: int, clip: bool = False, accumulate: bool = False) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(BlockNet())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        for micro in range(ACCUM if accumulate else 1):
            x, y = _batch(rank, 10 * step + micro if accumulate else step)
            with model.no_sync() if accumulate and micro < ACCUM - 1 else torch.enable_grad():
                (F.mse_loss(model(x), y) / (ACCUM if accumulate else 1)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


# name: (stage, options, clip); shard_group_size=2 is the node here
CASES = {
    "s1": (1, {"shard_group_size": 2}, False),
    "s2": (2, {"shard_group_size": "node"}, True),
    "s3": (3, {"shard_group_size": 2}, False),
    "s3-clip": (3, {"shard_group_size": 2}, True),
    "s2-k1": (2, {"shard_group_size": 1}, False),  # ZeRO over one rank: DDP with the engine's buckets
    "s2-offload": (2, {"shard_group_size": 2, "offload_optimizer": True, "offload_overlap": True}, False),
    "s3-qgZ": (3, {"shard_group_size": 2, "quantized_gradients": "int8", "quantization_block_size": 64}, False),
    "s3-qwZ": (3, {"shard_group_size": 2, "quantized_weights": True, "quantization_block_size": 64}, False),
}
EXACT = ("s3-qgZ", "s3-qwZ")  # quantized: compared with the model's bytes, not with DDP's values
# with ACCUM micro-batches per step: name: (stage, options, the last micro-batch deferred too)
ACCUMULATING = {
    "acc-s2": (2, {"shard_group_size": 2}, False),  # replica_all_reduce="boundary", the default
    "acc-s2-every": (2, {"shard_group_size": 2, "replica_all_reduce": "every_backward"}, False),
    "acc-s3": (3, {"shard_group_size": 2}, False),
    "acc-s3-every": (3, {"shard_group_size": 2, "replica_all_reduce": "every_backward"}, False),
    "acc-s3-all-deferred": (3, {"shard_group_size": 2}, True),
    "acc-s3-local": (3, {"shard_group_size": 2, "local_accumulation": True}, False),
    "acc-s2-offload": (2, {"shard_group_size": 2, "offload_optimizer": True}, False),  # host shards
    "acc-s2-overlap-all-deferred": (2, {"shard_group_size": 2, "offload_optimizer": True, "offload_overlap": True},
                                    True),  # the host step started on a shard the step's all-reduce then changes
}


def _checkpoints(rank: int, folder: Path) -> dict:
    """HSDP saves and plain stage 3 loads it, and the other way round; each goes on for STEPS more
    steps, as the run that saved it does uninterrupted."""
    out = {}
    for name, saving, loading in (("hsdp-to-plain", dict(shard_group_size=2), {}),
                                  ("plain-to-hsdp", {}, dict(shard_group_size=2))):
        model, opt, sharder = _build(3, **saving)
        _train(model, opt, rank, 0, STEPS)
        path = folder / name
        save_sharded(path, {"global_step": STEPS, "optimizer_states": [{}]}, model, [opt], sharder,
                     Collectives(), 3)
        saved = _params(model)
        _train(model, opt, rank, STEPS, 2 * STEPS)
        model2, opt2, sharder2 = _build(3, seed=1, **loading)  # other weights: all must come from the file
        reader = CheckpointReader(path)
        state = reader.trainer_state()["zero_checkpoint"]
        load_model(reader, state, model2, flat_groups([opt2], sharder2))
        load_optimizers(reader, state, model2, [opt2])
        loaded = _params(model2)
        _train(model2, opt2, rank, STEPS, 2 * STEPS)
        out[name] = {"saved": saved, "loaded": loaded, "uninterrupted": _params(model), "resumed": _params(model2),
                     "shard_group_size": reader.shard_group_size,
                     "file_bytes": {f: e["bytes"] for f, e in reader.index["files"].items()},
                     "parts_in": sorted({part[0] for t in reader.tensors.values() for part in t["parts"]})}
    return out


def _pretrained(rank: int, folder: Path) -> dict:
    """Weights from a safetensors file straight into the shards of a shard group (sharded_init, then
    load_pretrained), then trained: the file holds the seed-0 model DDP starts from."""
    from safetensors.torch import save_file

    from zero_strategy.frontend.precision import WorkingPrecision
    from zero_strategy.frontend.setup import setup_engine
    from zero_strategy.pretrained import load_pretrained, sharded_init

    path = folder / "pretrained.safetensors"
    if rank == 0:
        torch.manual_seed(0)
        save_file(BlockNet().state_dict(), str(path))
    dist.barrier()
    torch.manual_seed(5)  # another init: every weight must come from the file
    with sharded_init():
        model = BlockNet()
    load_pretrained(model, path)
    config = block_net_config(3, shard_group_size=2)
    engine = setup_engine(model, config, WorkingPrecision(), Collectives(ranks_per_node=PER_NODE),
                          torch.device("cpu"), lambda: [torch.optim.AdamW(model.parameters(), lr=1e-2)])
    sharded = all(p.numel() == 0 for u in engine.sharder.units for g in u.groups for p in g.params)
    _train(model, engine.optimizers[0], rank, 0, STEPS)
    return {"params": _params(model), "sharded": sharded}


def _all(rank: int, world_size: int, folder: str) -> dict:
    out = {"pretrained": _pretrained(rank, Path(folder))}
    out.update({"ddp": _ddp(rank), "ddp-clip": _ddp(rank, clip=True), "ddp-accumulating": _ddp(rank, accumulate=True)})
    for name, (stage, options, last_deferred) in ACCUMULATING.items():
        model, opt, sharder = _build(stage, **options)
        _train_accumulating(model, opt, rank, last_deferred)
        out[name] = {"params": _params(model), "stats": opt.comm_stats()}
    for name, (stage, options, clip) in CASES.items():
        model, opt, sharder = _build(stage, **options)
        _train(model, opt, rank, 0, STEPS, clip)
        out[name] = {"params": _params(model), "stats": opt.comm_stats(),
                     "groups": (opt.sharder.hybrid.shard.global_ranks, opt.sharder.hybrid.replicate.global_ranks)}
        if name == "s3":
            out[name]["memory"] = memory_stats(model, [opt])
            # what a Hugging Face export gathers over all ranks, one tensor at a time
            source = LiveSource(model, flat_groups([opt], sharder), Collectives(), writes_shards([opt], sharder))
            out[name]["exported"] = {key: source.fetch(key) for key in model.state_dict()}
    dist.barrier()
    out["checkpoints"] = _checkpoints(rank, Path(folder))
    from zero_strategy import Join

    model, opt, _ = _build(2, shard_group_size=2)
    try:
        Join(model, opt)
    except ValueError as err:
        out["join"] = str(err)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_all, WORLD, str(tmp_path_factory.mktemp("hybrid")))


def _close(got: dict, want: dict, atol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [n for n in CASES if n not in EXACT])
def test_hybrid_sharding_equals_ddp(runs, name):
    clip = CASES[name][2]
    for rank in range(WORLD):
        _close(runs[rank][name]["params"], runs[rank]["ddp-clip" if clip else "ddp"], 1e-5)
        _close(runs[rank][name]["params"], runs[0][name]["params"], 0)  # the replicas stayed equal


@pytest.mark.timeout(300)
def test_a_hugging_face_export_gathers_each_tensor_once_not_once_per_replica(runs):
    exported = runs[0]["s3"]["exported"]  # rank 0 writes
    _close(exported, runs[0]["s3"]["params"], 0)
    assert all(value is None for value in runs[1]["s3"]["exported"].values())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(ACCUMULATING))
def test_accumulating_equals_ddp_and_the_boundary_all_reduces_once_per_step(runs, name):
    stage, options, _ = ACCUMULATING[name]
    for rank in range(WORLD):
        _close(runs[rank][name]["params"], runs[rank]["ddp-accumulating"], 1e-5)
    with torch.device("meta"):
        model = BlockNet()
    want = predict_step_bytes(model, block_net_config(stage, **options), WORLD, PER_NODE, accumulation_steps=ACCUM,
                              backend="gloo")
    for rank in range(WORLD):  # (all deferred: the step all-reduces each shard once instead)
        assert runs[rank][name]["stats"] == want, f"rank {rank}"
    # what crosses nodes: each gradient shard's all-reduce across the replicas, and once per step the
    # all-reduce of which parameters got gradients, with the step's tally
    mask = sent_bytes("all_reduce", len(list(model.parameters())) + TALLY_BYTES, WORLD)
    once = predict_step_bytes(model, block_net_config(stage, shard_group_size=2), WORLD, PER_NODE,  # one micro-batch
                              backend="gloo")
    replica_sums = ACCUM if options.get("replica_all_reduce") == "every_backward" else 1
    assert want["inter_node"] - mask == replica_sums * (once["inter_node"] - mask) > 0


@pytest.mark.timeout(300)
def test_pretrained_weights_load_into_the_shard_groups_and_train_as_ddp(runs):
    for rank in range(WORLD):
        assert runs[rank]["pretrained"]["sharded"]
        _close(runs[rank]["pretrained"]["params"], runs[rank]["ddp"], 1e-5)


@pytest.mark.timeout(300)
def test_memory_per_rank_follows_the_formula_with_the_shard_group_in_place_of_the_world(runs):
    numel = sum(p.numel() for p in runs[0]["ddp"].values())
    over_group, over_world = estimate_memory(numel, 3, 2)["total"], estimate_memory(numel, 3, WORLD)["total"]
    for rank in range(WORLD):
        held = runs[rank]["s3"]["memory"]["total"]
        assert over_group <= held <= 1.01 * over_group  # the segments' padding on top
        assert held > 1.9 * over_world  # twice what sharding over all 4 would hold


@pytest.mark.timeout(300)
def test_groups_are_consecutive_ranks_and_their_replicas(runs):
    for rank in range(WORLD):
        shard, replicate = runs[rank]["s3"]["groups"]
        assert shard == [rank // 2 * 2, rank // 2 * 2 + 1] and replicate == [rank % 2, rank % 2 + 2]
        shard, replicate = runs[rank]["s2-k1"]["groups"]
        assert shard == [rank] and replicate == [0, 1, 2, 3]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CASES))
def test_comm_stats_equal_the_prediction_and_only_all_reduces_cross_nodes(runs, name):
    stage, options, clip = CASES[name]
    with torch.device("meta"):
        model = BlockNet()
    want = predict_step_bytes(model, block_net_config(stage, **options), WORLD, PER_NODE, clipping=clip,
                              backend="gloo")
    for rank in range(WORLD):
        assert runs[rank][name]["stats"] == want, f"rank {rank}"
    if options["shard_group_size"] == 1:
        assert want["all_gather"] == want["reduce_scatter"] == 0  # a group of one sends nothing to itself
        return
    # the shard group is the node: every all-gather and reduce-scatter stays in it, and what crosses
    # nodes is the all-reduce of each gradient shard across the replicas (and the small gradient mask)
    assert want["all_gather"] > 0 and want["reduce_scatter"] > 0 and want["inter_node"] > 0
    small = 8 if clip else 0  # the norm's all-reduce, within the shard group
    assert want["inter_node"] == want["all_reduce"] - small
    assert want["intra_node"] == want["all_gather"] + want["reduce_scatter"] + small


@pytest.mark.timeout(300)
def test_hybrid_sends_fewer_inter_node_bytes_than_sharding_over_all_ranks():
    with torch.device("meta"):
        model = BlockNet()
    for stage in (1, 2, 3):
        plain = predict_step_bytes(model, block_net_config(stage), WORLD, PER_NODE)
        hybrid = predict_step_bytes(model, block_net_config(stage, shard_group_size=2), WORLD, PER_NODE)
        assert hybrid["inter_node"] < plain["inter_node"], stage


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["hsdp-to-plain", "plain-to-hsdp"])
def test_checkpoints_load_at_the_other_layout_and_training_goes_on(runs, name):
    for rank in range(WORLD):
        got = runs[rank]["checkpoints"][name]
        _close(got["loaded"], got["saved"], 0)  # exactly the saved weights
        _close(got["resumed"], got["uninterrupted"], 1e-5)  # and the optimizer state: the same steps follow


@pytest.mark.timeout(300)
def test_a_hybrid_checkpoint_is_written_once_and_says_its_layout(runs):
    hsdp, plain = runs[0]["checkpoints"]["hsdp-to-plain"], runs[0]["checkpoints"]["plain-to-hsdp"]
    assert hsdp["shard_group_size"] == 2 and plain["shard_group_size"] is None
    assert hsdp["parts_in"] == ["rank_00000.safetensors", "rank_00001.safetensors"]  # the first shard group
    assert len(plain["parts_in"]) == WORLD
    # the second shard group's files hold no tensor (a header only): one replica's bytes, as plain
    # stage 3 writes, not two
    assert hsdp["file_bytes"]["rank_00002.safetensors"] < 100 and hsdp["file_bytes"]["rank_00003.safetensors"] < 100
    assert sum(hsdp["file_bytes"].values()) < 1.1 * sum(plain["file_bytes"].values())


def test_resolve_shard_group_size():
    assert resolve_shard_group_size(None, 8, 4) is None
    assert resolve_shard_group_size("node", 8, 4) == 4
    assert resolve_shard_group_size(8, 8, 4) is None  # the whole world: plain ZeRO
    assert resolve_shard_group_size(2, 8, 4) == 2
    with pytest.raises(ValueError, match=r"shard_group_size=3 does not divide the world size 8.*\[1, 2, 4, 8\]"):
        resolve_shard_group_size(3, 8, 4)
    mesh = HybridMesh(6, 3)
    assert mesh.shard_groups() == [[0, 1, 2], [3, 4, 5]] and mesh.replicate_groups() == [[0, 3], [1, 4], [2, 5]]
    assert [mesh.replica_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("options, message", [
    (dict(shard_group_size=0), r"shard_group_size=0 must be a positive integer"),
    (dict(shard_group_size="rack"), r"shard_group_size='rack' must be a positive integer"),
    (dict(shard_group_size=2.0), r"shard_group_size=2.0 must be a positive integer"),
    (dict(stage=3, shard_group_size=2, secondary_partition_size=2), r"secondary_partition_size=2: hpZ"),
    (dict(shard_group_size=2, replica_all_reduce="never"), r"replica_all_reduce='never' is not one of"),
])
def test_bad_shard_group_sizes_are_refused_with_what_to_do(options, message):
    with pytest.raises(ValueError, match=message):
        ZeroConfig(**options)


def test_deepspeed_mics_shard_size_maps_onto_shard_group_size():
    from zero_strategy.deepspeed.config import DeepSpeedConfigError, map_deepspeed_config

    settings = map_deepspeed_config({"zero_optimization": {"stage": 3, "mics_shard_size": 8,
                                                           "mics_hierarchical_params_gather": True}})
    assert settings.strategy["shard_group_size"] == 8
    assert any("mics_shard_size=8 read as shard_group_size=8" in note for note in settings.notes)
    assert "shard_group_size" not in map_deepspeed_config({"zero_optimization": {"stage": 3}}).strategy
    with pytest.raises(DeepSpeedConfigError, match=r"mics_shard_size=8 at stage 2"):
        map_deepspeed_config({"zero_optimization": {"stage": 2, "mics_shard_size": 8}})


@pytest.mark.timeout(300)
def test_join_refuses_hybrid_sharding(runs):
    for rank in range(WORLD):
        assert "Join with shard_group_size=2" in runs[rank].get("join", "")
