"""Communication accounting on 4 gloo ranks laid out as 2 nodes of 2: comm_stats() of real steps
equals the communication model's prediction exactly (stages 1-3, with and without each option, per
phase of the step), quantized all-gathers send about a quarter (fp32) or half (bf16) of the bytes,
and the secondary partition keeps backward's all-gathers inside the nodes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zero_strategy.comm_model import predict_step_bytes
from zero_strategy.config import ZeroConfig
from zero_strategy.engine import Collectives, ZeroOptimizer, shard_module
from zero_strategy.engine.params.buffer_sync import BufferBroadcast

from .distributed import run_distributed

WORLD, PER_NODE = 4, 2
VOCAB, WIDTH = 64, 32


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)  # 32 + 32 elements: resident (whole on every rank) at stage 3
        self.fc = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.norm(x))))


class TinyLM(nn.Module):
    """Tied embeddings (the root unit), three blocks (units), a final norm (resident); with ``buffers``
    a float and an int buffer, broadcast before each training step (broadcast_buffers)."""

    def __init__(self, d: int = WIDTH, buffers: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(3))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.wte.weight
        if buffers:
            self.register_buffer("gain", torch.ones(d))
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, idx):
        h = self.wte(idx)  # (B, T, C)
        if hasattr(self, "gain"):
            h = h * self.gain
            self.calls += 1
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))  # (B, T, V)


def _config(stage: int, options: dict) -> ZeroConfig:
    stage3 = dict(shard_modules=("Block",), param_persistence_threshold=100) if stage == 3 else {}
    # buckets of 2621 fp32 elements: several segments per group; blocks of 64: several per shard
    return ZeroConfig(**{"stage": stage, "bucket_cap_mb": 0.01, "quantization_block_size": 64, **stage3, **options})


# name: (stage, options, dtype, clip): every option at the stages it exists at, fp32 and bf16
CASES = {
    "stage1": (1, {}, torch.float32, False),
    "stage1-qgZ-int8": (1, {"quantized_gradients": "int8"}, torch.float32, False),
    "stage2-clip": (2, {}, torch.float32, True),
    "stage2-qgZ-int4": (2, {"quantized_gradients": "int4"}, torch.float32, False),
    "stage3": (3, {}, torch.float32, False),
    "stage3-bf16": (3, {}, torch.bfloat16, True),
    "stage3-qwZ": (3, {"quantized_weights": True}, torch.float32, False),
    "stage3-qwZ-bf16": (3, {"quantized_weights": True}, torch.bfloat16, False),
    "stage3-hpZ": (3, {"secondary_partition_size": 2}, torch.float32, False),
    "stage3-qgZ-int8": (3, {"quantized_gradients": "int8"}, torch.float32, False),
    "stage3-zero++": (3, {"quantized_weights": True, "secondary_partition_size": 2, "quantized_gradients": "int4"},
                      torch.float32, True),
    # without the order guard's headers: the parameters' all-gathers alone
    "stage3-noguard": (3, {"check_unit_order": False}, torch.float32, False),
    "stage3-noguard-bf16": (3, {"check_unit_order": False}, torch.bfloat16, False),
    "stage3-noguard-qwZ": (3, {"check_unit_order": False, "quantized_weights": True,
                               "quantization_block_size": 256}, torch.float32, False),  # the default block
    "stage3-noguard-qwZ-bf16": (3, {"check_unit_order": False, "quantized_weights": True,
                                    "quantization_block_size": 256}, torch.bfloat16, False),
    "stage3-noguard-hpZ": (3, {"check_unit_order": False, "secondary_partition_size": 2}, torch.float32, False),
    # blocks of 1 MiB in one segment, one thread per rank: their all-gathers go as broadcasts, without headers
    "stage3-broadcasts": (3, {"bucket_cap_mb": 25}, torch.float32, False),
    # buffers broadcast before the forward (see [Note: buffers kept in step]), the float one in the working dtype
    "stage1-buffers": (1, {}, torch.float32, False),
    "stage3-bf16-buffers": (3, {}, torch.bfloat16, False),
    # AdamW stepped whole (see [Note: whole-parameter step]): the step's two all-to-alls, in fp32 (the masters')
    "stage2-whole": (2, {"whole_parameter_step": True}, torch.float32, True),
    "stage3-whole-bf16": (3, {"whole_parameter_step": True}, torch.bfloat16, False),
}
BROADCASTS = {"stage3-broadcasts": 256}  # case -> the model's width (see [Note: headers left out on gloo])
WITH_BUFFERS = ("stage1-buffers", "stage3-bf16-buffers")


def _train(rank: int, world_size: int, names: list[str]) -> dict:
    """Two steps of each case; per case, the counter's bytes per phase of the second step, its
    comm_stats() and the final parameters."""
    out = {}
    for name in names:
        stage, options, dtype, clip = CASES[name]
        config = _config(stage, options)
        torch.manual_seed(0)
        model = TinyLM(BROADCASTS.get(name, WIDTH), buffers=name in WITH_BUFFERS).to(dtype)
        threads = torch.get_num_threads()
        torch.set_num_threads(1 if name in BROADCASTS else threads)
        user_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        comm = Collectives(ranks_per_node=PER_NODE)
        sharder = shard_module(model, config, comm) if stage == 3 else None
        opt = ZeroOptimizer(user_opt, config, comm, sharder=sharder)
        sync = BufferBroadcast(model, comm).hook() if name in WITH_BUFFERS else None  # as setup_engine does
        for step in range(2):
            g = torch.Generator().manual_seed(100 * step + rank)
            idx = torch.randint(0, VOCAB, (2, 6), generator=g)
            phases = {}
            before = dict(comm.counter.current)
            loss = F.cross_entropy(model(idx[:, :-1]).float().reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
            phases["forward"] = dict(comm.counter.current)
            loss.backward()
            phases["backward"] = dict(comm.counter.current)
            if clip:
                opt.clip_grad_norm_(1.0)
            opt.step()
            phases["step"] = opt.comm_stats()  # the step's total: the counter closed it
            opt.zero_grad()
        deltas, last = {}, before
        for phase in ("forward", "backward", "step"):
            deltas[phase] = {k: phases[phase][k] - last[k] for k in last}
            last = phases[phase]
        from zero_strategy import gathered_parameters

        with gathered_parameters(model):
            params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        out[name] = {"phases": deltas, "stats": opt.comm_stats(), "sharder_stats": sharder.comm_stats()
                     if sharder is not None else None, "params": params,
                     "left_out": sharder is not None and sharder.guard.leaves_out}
        if config.whole_parameter_step:  # the state each rank holds, and of which parameters
            from zero_strategy.memory import memory_stats

            plan = opt.step_backend.plan
            out[name].update(state=memory_stats(model, [opt])["optimizer_states"], numels=[p.numel for p in plan.params],
                             owned=[p.numel for p in plan.owned])
        if sync is not None:
            sync.remove_hooks()
        torch.set_num_threads(threads)
    return out


def _predicted(name: str, by_phase: bool, rank: int = 0):
    stage, options, dtype, clip = CASES[name]
    with torch.device("meta"):
        model = TinyLM(BROADCASTS.get(name, WIDTH), buffers=name in WITH_BUFFERS)
    return predict_step_bytes(model, _config(stage, options), WORLD, PER_NODE, dtype=dtype,
                              clipping=clip, by_phase=by_phase, backend="gloo", rank=rank)


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_train, WORLD, list(CASES))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CASES))
def test_comm_stats_equal_the_models_prediction_exactly(runs, name):
    for rank, result in enumerate(runs):  # the whole step's all-to-alls differ by rank: each its own
        want, phases = _predicted(name, by_phase=False, rank=rank), _predicted(name, by_phase=True, rank=rank)
        got = result[name]
        assert got["left_out"] == (name in BROADCASTS), f"rank {rank}: headers left out: {got['left_out']}"
        assert got["stats"] == want, f"rank {rank}"
        if got["sharder_stats"] is not None:
            assert got["sharder_stats"] == want
        for phase in ("forward", "backward", "step"):
            assert got["phases"][phase] == phases.get(phase, {k: 0 for k in want}), f"rank {rank}, {phase}"
        assert (want["all_to_all"] > 0) == ("whole" in name), rank  # the whole step's alone
    assert (want["broadcast"] > 0) == (name in WITH_BUFFERS)  # the buffers' (the gathers by broadcasts count as such)
    assert want["total"] == sum(want[k] for k in ("all_gather", "reduce_scatter", "all_reduce", "broadcast",
                                                  "all_to_all"))
    assert want["total"] == want["intra_node"] + want["inter_node"] > 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("dtype", "ratio"), [("", 4.0), ("-bf16", 2.0)])
def test_quantized_weights_send_a_quarter_for_fp32_and_half_for_bf16(runs, dtype, ratio):
    plain, quantized = runs[0][f"stage3-noguard{dtype}"], runs[0][f"stage3-noguard-qwZ{dtype}"]
    for run in (plain, quantized):  # forward and backward all-gather units over all ranks: across nodes
        for phase in ("forward", "backward"):
            bytes_ = run["phases"][phase]
            assert bytes_["all_gather"] + bytes_["reduce_scatter"] == bytes_["inter_node"] and not bytes_["intra_node"]
    forward = plain["phases"]["forward"]["all_gather"] / quantized["phases"]["forward"]["all_gather"]
    backward = plain["phases"]["backward"]["all_gather"] / quantized["phases"]["backward"]["all_gather"]
    # int8 codes plus one fp32 scale per 256 elements: 1 + 1/64 bytes an element instead of 4 (or 2)
    for measured in (forward, backward):
        assert 0.97 * ratio < measured <= ratio, f"{measured:.3f}x fewer bytes, expected close to {ratio}x"
    # the gradients and the resident parameters are not quantized
    assert plain["phases"]["backward"]["reduce_scatter"] == quantized["phases"]["backward"]["reduce_scatter"]
    assert plain["phases"]["step"] == quantized["phases"]["step"]


@pytest.mark.timeout(300)
def test_secondary_partition_keeps_backward_all_gathers_inside_the_nodes(runs):
    plain, hpz = runs[0]["stage3-noguard"], runs[0]["stage3-noguard-hpZ"]
    assert hpz["phases"]["forward"] == plain["phases"]["forward"]  # forward gathers over all ranks, as before
    backward = hpz["phases"]["backward"]
    assert backward["all_gather"] > 0 and backward["all_gather"] == backward["intra_node"]  # no byte crosses a node
    # the backward's inter-node bytes are the gradients' reduction alone
    assert backward["inter_node"] == backward["reduce_scatter"] == plain["phases"]["backward"]["reduce_scatter"]
    for rank_result in runs:  # and the values are the same: hpZ only moves where the bytes come from
        for key, value in rank_result["stage3-noguard"]["params"].items():
            assert torch.equal(rank_result["stage3-noguard-hpZ"]["params"][key], value), key


@pytest.mark.timeout(300)
def test_ranks_end_with_the_same_weights_under_every_option(runs):
    for name in CASES:
        first = runs[0][name]["params"]
        for other in runs[1:]:  # data parallelism: every rank ends with the same weights
            for key, value in first.items():
                assert torch.equal(other[name]["params"][key], value), (name, key)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [name for name in CASES if "whole" in name])
def test_whole_step_state_is_the_owners_share_as_estimated(runs, name):
    """Each rank holds AdamW's state (two fp32 moments an element, a 4-byte step count a parameter) of the
    parameters it owns, every parameter owned once; estimate_memory gives the most loaded rank's moments,
    at most 1/N of all plus the largest parameter's."""
    stage, _, dtype, _ = CASES[name]
    numels = runs[0][name]["numels"]
    assert sorted(n for run in runs for n in run[name]["owned"]) == sorted(numels)
    for run in runs:
        assert run[name]["state"] == 8 * sum(run[name]["owned"]) + 4 * len(run[name]["owned"])
    from zero_strategy.memory import estimate_memory

    precision = "bf16-mixed" if dtype == torch.bfloat16 else "32-true"
    estimate = estimate_memory(sum(numels), stage, WORLD, precision, whole_parameters=numels)["optimizer_states"]
    assert estimate == max(8 * sum(run[name]["owned"]) for run in runs)
    assert estimate <= 8 * (sum(numels) / WORLD + max(numels))
