"""memory_stats counts live storages; estimate_memory is the ZeRO paper's formula."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zero_strategy import ZeroConfig, ZeroOptimizer, estimate_memory, memory_stats
from zero_strategy.engine import shard_module
from zero_strategy.engine.grads.reducer import MAX_INFLIGHT
from zero_strategy.engine.params.flat_parameters import owner_of, owners_of

from .distributed import run_distributed
from .models import OddMLP, batch

GB = 1e9


def test_estimate_reproduces_the_papers_worked_example():
    # ZeRO paper, figure 1: 7.5B parameters, 64 GPUs, mixed-precision Adam (K = 12)
    totals = [estimate_memory(7_500_000_000, stage=s, world_size=64, precision="bf16-mixed")["total"] / GB
              for s in range(4)]
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]


def test_estimate_splits_by_key_and_location():
    est = estimate_memory(1000, stage=2, world_size=4, precision="16-mixed")
    assert (est["params"], est["grads"], est["master_params"], est["optimizer_states"]) == (2000, 500, 1000, 2000)
    assert est["device"] == est["total"] == 5500 and est["host"] == est["disk"] == 0
    # offloaded, the gradient shard the step reads is on the host, in the fp32 master's dtype
    est = estimate_memory(1000, stage=2, world_size=4, precision="16-mixed", offload_optimizer=True)
    assert est["params"] == 2000 and est["grads"] == 1000
    assert est["master_params"] == 1000 and est["optimizer_states"] == 2000
    assert est["host"] == 4000 and est["device"] == 2000 and est["total"] == 6000
    # stage 1 keeps autograd's full gradient on the device too; fp32 weights get a host master copy
    est = estimate_memory(1000, stage=1, world_size=4, precision="32-true", offload_optimizer=True)
    assert (est["params"], est["grads"], est["master_params"]) == (4000, 4000 + 1000, 1000)
    assert est["device"] == 8000 and est["host"] == 1000 + 1000 + 2000
    # on disk: the optimizer state; stage 3 with parameter offload: nothing on the device between uses
    est = estimate_memory(1000, stage=3, world_size=2, precision="32-true", offload_optimizer=True,
                          offload_params=True, offload_disk=True)
    assert est["disk"] == est["optimizer_states"] == 4000 and est["device"] == 0
    assert est["master_params"] == 0  # the fp32 host shard is its own master
    assert est["host"] == est["params"] + est["grads"] == 4000
    fp32 = estimate_memory(1000, stage=1, world_size=2)
    assert (fp32["params"], fp32["grads"], fp32["optimizer_states"], fp32["master_params"]) == (4000, 4000, 4000, 0)


@pytest.mark.parametrize("kwargs, match", [
    ({"num_params": -1}, "num_params=-1"),
    ({"num_params": 10, "stage": 5}, "stage=5"),
    ({"num_params": 10, "world_size": 0}, "world_size=0"),
    ({"num_params": 10, "precision": "fp8"}, "precision='fp8'.*32-true"),
    ({"num_params": 10, "stage": 2, "offload_params": True}, "offload_params=True needs stage 3"),
    ({"num_params": 10, "stage": 0, "offload_optimizer": True}, "offload needs a ZeRO stage"),
    ({"num_params": 10, "stage": 2, "offload_disk": True}, "offload_disk=True .* needs offload_optimizer=True"),
])
def test_estimate_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        estimate_memory(**kwargs)


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(64, 257)
        self.frozen.requires_grad_(False)
        self.a = nn.Linear(257, 511)
        self.b = nn.Linear(511, 129)

    def forward(self, x):
        return self.b(torch.relu(self.a(self.frozen(x))))


BUCKET_MB = 0.125  # a bit over an eighth of the model per bucket


def _measure(rank, world_size, stage):
    torch.manual_seed(0)
    model = Wide()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    everything = sum(p.numel() for p in model.parameters())
    opt = ZeroOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), ZeroConfig(stage=stage, bucket_cap_mb=BUCKET_MB))
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))
    F.mse_loss(model(x), torch.zeros(4, 129)).backward()
    opt.step()
    stats = memory_stats(model, [opt])
    pieces = sum(len(g.pieces) for g in opt.groups)
    largest_segment = max(s.numel for g in opt.groups for s in g.segments) * 4
    return stats, trainable, everything, pieces, largest_segment


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2])
def test_two_ranks_hold_half_the_optimizer_state(stage):
    results = run_distributed(_measure, 2, stage)
    trainable, everything = results[0][1], results[0][2]
    adam_state = 8 * trainable  # two fp32 moments per trainable element, unsharded
    for stats, _, _, pieces, largest_segment in results:
        step_bytes = 4 * pieces  # one fp32 step counter per piece
        assert stats["optimizer_states"] - step_bytes == pytest.approx(adam_state / 2, rel=0.01)
        assert stats["params"] == pytest.approx(4 * everything, rel=0.01)  # whole on every rank
        full_grads = 4 * trainable
        if stage == 1:  # the whole flat gradient buffer
            assert stats["grads"] == pytest.approx(full_grads, rel=0.01)
        else:  # half, plus the few staging buffers kept for the reductions in flight
            staging_bound = (MAX_INFLIGHT + 1) * largest_segment
            assert full_grads / 2 <= stats["grads"] <= full_grads / 2 * 1.01 + staging_bound
        assert stats["master_params"] == 0  # fp32 weights are their own master
        assert stats["total"] == sum(stats[k] for k in ("params", "grads", "optimizer_states", "master_params"))
    # together the ranks hold each moment element exactly once: no padding gets state
    assert sum(s["optimizer_states"] - 4 * p for s, _, _, p, _ in results) == adam_state


def _measure_stage3(rank, world_size):
    from zero_strategy.engine import shard_module

    torch.manual_seed(0)
    model = Wide()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    everything = sum(p.numel() for p in model.parameters())
    config = ZeroConfig(stage=3, shard_modules=("Linear",), param_persistence_threshold=1000)
    user_opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sharder = shard_module(model, config)
    opt = ZeroOptimizer(user_opt, config, sharder=sharder)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))
    F.mse_loss(model(x), torch.zeros(4, 129)).backward()
    opt.step()
    resident = sum(p.numel() for g in sharder.resident for p in g.params)
    pieces = sum(len(g.pieces) for g in opt.groups)
    largest_unit = max(g.layout.numel for u in sharder.units for g in u.groups) * 4
    gathered = [u.name for u in sharder.all_units if u.has_full_buffers]
    return memory_stats(model, [opt]), trainable, everything, resident, pieces, largest_unit, gathered


@pytest.mark.timeout(120)
def test_stage3_holds_half_of_everything():
    for stats, trainable, everything, resident, pieces, largest_unit, gathered in run_distributed(_measure_stage3, 2):
        assert gathered == []  # between steps every unit is released
        sharded = everything - resident
        # params: half of the sharded ones plus the resident biases (whole), up to padding
        assert stats["params"] == pytest.approx(4 * (sharded / 2 + resident), rel=0.01)
        # grads: half, plus the staging buffers kept for the reductions in flight
        assert 4 * trainable / 2 * 0.99 <= stats["grads"] <= 4 * trainable / 2 * 1.01 + (MAX_INFLIGHT + 1) * largest_unit
        assert stats["optimizer_states"] - 4 * pieces == pytest.approx(8 * trainable / 2, rel=0.01)
        assert stats["master_params"] == 0



def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _freed_block_after_training(rank: int, world_size: int, threshold_mb) -> tuple[int, int, int]:
    """Resident bytes before, with and after freeing a 6 MiB tensor, once a stage-3 engine with
    ``cpu_mmap_threshold_mb=threshold_mb`` has trained two steps (whose frees of 16 MiB blocks raise
    glibc's own threshold above 6 MiB)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))
    config = ZeroConfig(stage=3, cpu_mmap_threshold_mb=threshold_mb)
    sharder = shard_module(model, config)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters()), config, sharder=sharder)
    for _ in range(2):
        model(torch.randn(4, 1024)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    before = _rss()
    block = torch.ones(3 * 2**19)  # 6 MiB, every page touched
    held = _rss()
    del block
    return before, held, _rss()



@pytest.mark.timeout(120)
def test_on_cpu_the_engine_makes_freed_blocks_leave_the_process(monkeypatch):
    """[Note: glibc's mmap threshold]: with the default ``cpu_mmap_threshold_mb`` a block of 4 MiB or
    more that malloc takes from the system goes back to it when freed. A fresh process, started
    without a threshold of its own: the pool's workers have set it already (for good), and free
    heap memory from before it is set would serve the block (with ``None`` that is where a freed
    block stays: benchmarks/RESULTS.md)."""
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    MiB = 2**20
    [(before, held, after)] = run_distributed(_freed_block_after_training, 1, ZeroConfig().cpu_mmap_threshold_mb,
                                              fresh=True)
    assert held - before >= 5 * MiB, (before, held, after)  # it took fresh pages: not memory the heap had
    assert after - before <= MiB, (before, held, after)  # and gave them back


@pytest.mark.parametrize("stage, overlap", [(1, False), (2, False), (2, True), (3, False), (3, True)])
def test_a_dropped_model_and_engine_are_freed(stage, overlap):
    """Nothing keeps a model and its engine alive once the user drops them (see [Note: hooks that hold the
    reducer weakly] in zero_strategy/engine/grads/reducer.py): a notebook or a sweep builds many."""
    torch.manual_seed(0)
    model = OddMLP()
    options = dict(offload_optimizer=True, offload_overlap=True) if overlap else {}
    config = ZeroConfig(stage=stage, **options)
    sharder = shard_module(model, config) if stage == 3 else None
    opt = ZeroOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), config, sharder=sharder)
    x, y = batch(0, 0)
    F.mse_loss(model(x, 0, 0), y).backward()
    opt.step()
    refs = {name: weakref.ref(o) for name, o in (("model", model), ("optimizer", opt), ("reducer", opt.reducer),
                                                 ("weight", model.fc1.weight))}
    del model, opt, sharder
    gc.collect()
    assert {name: ref() is None for name, ref in refs.items()} == dict.fromkeys(refs, True)


def test_owner_of_finds_the_flat_groups_of_a_parameter_or_a_module():
    """owner_of / owners_of, the one lookup of the flat groups' owner (memory_stats, gathered_parameters
    and pretrained loading use it): a plain loop's two optimizers each build one."""
    model = OddMLP()
    assert owner_of(model) is None and owners_of(model) == []
    first = ZeroOptimizer(torch.optim.Adam(model.fc1.parameters(), lr=0.01), ZeroConfig(stage=2))
    assert owner_of(model.fc1.weight) is first.sharder and owner_of(model) is first.sharder
    assert owner_of(model.fc2.weight) is None and owner_of(model.frozen.weight) is None
    rest = [p for name, p in model.named_parameters() if p.requires_grad and not name.startswith("fc1.")]
    second = ZeroOptimizer(torch.optim.Adam(rest, lr=0.01), ZeroConfig(stage=2))
    assert owners_of(model) == [second.sharder, first.sharder]  # in the parameters' order: model.scale is first
    assert owner_of(model.head.bias) is second.sharder and owners_of(model.fc1.parameters()) == [first.sharder]
    with pytest.raises(ValueError, match="held by 2 flat-group owners"):
        owner_of(model)


def test_zero_estimate_counts_an_optimizer_stepped_whole(capsys):
    """Adafactor reads whole parameters: zero-estimate gives the ZeRO stages the owners' state (the rank that
    owns the 128 x 512 matrix holds all of its state) and the step's all-to-alls, as the models predict."""
    from zero_strategy.cli.estimate import main
    from zero_strategy.cli.report import format_bytes
    from zero_strategy.comm_model import predict_step_bytes
    from zero_strategy.models import MLP

    assert main(["model=mlp", "world_size=4", "comm.devices_per_node=4",
                 "model.optimizer._target_=torch.optim.Adafactor"]) == 0
    out = capsys.readouterr().out
    rows = {line.strip("│ ").split("│")[0].strip(): [c.strip() for c in line.strip("│ ").split("│")]
            for line in out.splitlines() if line.startswith("│")}
    with torch.device("meta"):
        net = MLP(128, 512, 10)  # conf/model/mlp.yaml over conf/data/gaussian.yaml
    sizes = [p.numel() for p in net.parameters()]
    for stage in (1, 2, 3):
        whole = estimate_memory(sum(sizes), stage, 4, whole_parameters=sizes)["optimizer_states"]
        assert whole == 8 * 128 * 512 > estimate_memory(sum(sizes), stage, 4)["optimizer_states"]
        assert rows[f"{stage} *" if stage == 2 else str(stage)][4] == format_bytes(whole)
    assert rows["0"][4] == format_bytes(estimate_memory(sum(sizes), 0, 4)["optimizer_states"])  # DDP: unchanged
    predicted = predict_step_bytes(net, ZeroConfig(stage=2), 4, 4, whole_parameters=True)["all_to_all"]
    assert predicted > 0 and "all-to-all" in out and rows["ZeRO-2"][4] == format_bytes(predicted)
