"""The low-precision step (engine/optim/step/lowp.py) in the engine: its options' checks, stage and
world-size parity bit for bit, resume bit for bit (also onto another world size), and its bytes.

Parity is against the same combination in one process. Every rank trains on the same full batch, so
that the averaged gradient is the one process's exactly ((g + g) / 2 == g in floating point) and any
difference left is the sharded step's: int8 blocks cut by a shard, stochastic rounding drawn at
another position, a tile boundary. The reference also steps in tiles of another size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zero_strategy.config import ZeroConfig
from zero_strategy.engine import ZeroOptimizer, shard_module

from .distributed import run_distributed

STEPS = 4
BLOCK = 64
COMBOS = (("int8", "bf16"), ("bf16", "bf16"), ("int8", "fp32"), ("fp32", "bf16"))
"""(optimizer_state_dtype, master_weights_dtype); bf16 working weights throughout."""


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(24, 40)  # 960 weights: cut by the shard ends at 2 ranks
        self.b = nn.Linear(40, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 24, generator=g).bfloat16(), torch.randn(16, 10, generator=g).bfloat16()


def _config(stage: int, state: str, master: str, **extra) -> ZeroConfig:
    more = dict(shard_modules=("Linear",), param_persistence_threshold=0) if stage == 3 else {}
    options = dict(bucket_cap_mb=600 * 2 / 2**20, optimizer_state_block_size=BLOCK, optimizer_state_min_numel=100)
    return ZeroConfig(stage=stage, optimizer_state_dtype=state, master_weights_dtype=master,
                      **{**options, **more, **extra})


def _build(config: ZeroConfig, sgd: bool = False, tile: int = 128):
    torch.manual_seed(0)
    model = _MLP().bfloat16()
    sharder = shard_module(model, config) if config.stage == 3 else None
    inner = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if sgd
             else torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01))
    opt = ZeroOptimizer(inner, config, sharder=sharder)
    opt.step_backend.tile_numel = tile
    return model, opt


def _train(model, opt, steps, first=0) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        x, y = _batch(step)
        loss = F.mse_loss(model(x).float(), y.float())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _weights(model, opt) -> dict[str, torch.Tensor]:
    """The full weights (gathered at stage 3) and the fp32 masters' full values where there are some."""
    from zero_strategy.engine.params.flat_parameters import gathered_parameters

    with gathered_parameters(model) if opt.config.stage == 3 else _nothing():
        out = {n: p.detach().clone().float() for n, p in model.named_parameters()}
    out["#state"] = _state_vector(opt)
    return out


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _state_vector(opt) -> torch.Tensor:
    """The whole optimizer state (every rank's, decoded), one vector: a collective."""
    state = opt.state_dict()["state"]
    return torch.cat([v.reshape(-1).float() for i in sorted(state) for k, v in sorted(state[i].items())
                      if k != "step"]) if state else torch.zeros(0)


def _stored_on_host(opt) -> bool:
    stored = opt.memory_tensors()
    return bool(stored["stored_states"]) and all(any(t is h for h in stored["host"]) for t in stored["stored_states"])


def _all_runs(rank: int, world_size: int, folder: str = "") -> dict[str, dict[str, torch.Tensor]]:
    """Every combination at stages 1-3 (and SGD with int8 momentum at stage 2)."""
    out = {}
    for stage in (1, 2, 3):
        for state, master in COMBOS:
            model, opt = _build(_config(stage, state, master), tile=128 if world_size > 1 else 192)
            losses = _train(model, opt, STEPS)
            out[f"{stage}-{state}-{master}"] = {**_weights(model, opt), "#losses": torch.tensor(losses)}
        model, opt = _build(_config(stage, "int8", "fp32", offload_optimizer=True),  # the state encoded on the host
                            tile=128 if world_size > 1 else 192)
        losses = _train(model, opt, STEPS)
        out[f"{stage}-int8-fp32-offload"] = {**_weights(model, opt), "#losses": torch.tensor(losses),
                                             "#host": torch.tensor(_stored_on_host(opt))}
    model, opt = _build(_config(2, "int8", "bf16"), sgd=True)
    losses = _train(model, opt, STEPS)  # before _weights: a dict display evaluates in order
    out["2-int8-bf16-sgd"] = {**_weights(model, opt), "#losses": torch.tensor(losses)}
    out.update(_resumed(rank, world_size))
    if world_size > 1:
        out.update(_checkpointed(folder))
    return out


CHECKPOINTED = (("int8", "bf16"), ("int8", "fp32"), ("bf16", "bf16"))


def _checkpointed(folder: str) -> dict[str, dict[str, torch.Tensor]]:
    """Two steps at stage 3, a sharded checkpoint, loaded at stage 3 and at stage 2 (other layouts), two
    more steps."""
    from pathlib import Path

    from zero_strategy.checkpoint import CheckpointReader, load_model, load_optimizers, save_sharded
    from zero_strategy.checkpoint.sharded import flat_groups
    from zero_strategy.engine import Collectives

    out = {}
    for state, master in CHECKPOINTED:
        path = Path(folder) / f"{state}-{master}"
        model, opt = _build(_config(3, state, master))
        _train(model, opt, 2)
        decoded = _state_vector(opt)  # the state after 2 steps, decoded to fp32
        save_sharded(path, {"global_step": 2, "optimizer_states": [{}]}, model, [opt], opt.sharder, Collectives(), 3)
        out[f"stored-{state}-{master}"] = _stored_form(path, state, decoded)
        for stage in (3, 2):
            torch.manual_seed(1)
            model, opt = _build(_config(stage, state, master))
            with torch.no_grad():  # other weights: all must come from the checkpoint
                for p in model.parameters():
                    p.add_(1.0)
            reader = CheckpointReader(path)
            saved = reader.trainer_state()["zero_checkpoint"]
            load_model(reader, saved, model, flat_groups([opt], opt.sharder if stage == 3 else None))
            load_optimizers(reader, saved, model, [opt])
            losses = _train(model, opt, 2, first=2)
            out[f"checkpoint-{state}-{master}-s{stage}"] = {**_weights(model, opt), "#losses": torch.tensor(losses)}
    return out


def _stored_form(path, state: str, decoded: torch.Tensor) -> dict[str, torch.Tensor]:
    """What a checkpoint of int8 or bf16 state holds (codes and scales, or bf16 values), and that it loads
    into fp32 state and consolidates to the state decoded before the save."""
    from zero_strategy.checkpoint import CheckpointReader, load_model, load_optimizers
    from zero_strategy.checkpoint.consolidate import full_optimizer_states
    from zero_strategy.checkpoint.sharded import flat_groups

    reader = CheckpointReader(path)
    saved = reader.trainer_state()["zero_checkpoint"]
    dtypes = {tuple(n.split("/")[2:]): reader.read(n, 0, 1).dtype for n in reader.tensors if n.startswith("optim/")}
    consolidated = full_optimizer_states(reader, saved)[0]["state"]
    torch.manual_seed(1)
    fp32_model, fp32_opt = _build(_config(2, "fp32", "fp32"))
    load_model(reader, saved, fp32_model, flat_groups([fp32_opt], None))
    load_optimizers(reader, saved, fp32_model, [fp32_opt])
    if state == "int8":
        form = (dtypes.get(("exp_avg:codes", "a.weight")) == torch.uint8
                and dtypes.get(("exp_avg_sq:scales", "a.weight")) == torch.float32 and ("exp_avg", "a.weight") not in dtypes)
    else:
        form = dtypes.get(("exp_avg", "a.weight")) == torch.bfloat16
    return {"#form": torch.tensor(form and dtypes.get(("exp_avg", "a.bias")) == torch.float32),  # a.bias: small, fp32
            "#decoded": decoded, "#in fp32 state": _state_vector(fp32_opt),
            "#consolidated": torch.cat([v.reshape(-1).float() for i in sorted(consolidated)
                                        for k, v in sorted(consolidated[i].items()) if k != "step"])}


def _resumed(rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    """Two steps, a state dict (the decoded fp32 state, and the weights), a fresh engine loading it, two
    more steps; the state dict comes from 2 ranks and is loaded at 2 ranks and at one."""
    out = {}
    if world_size == 1:
        return out
    import torch.distributed as dist

    from zero_strategy.engine.comm.collectives import Collectives

    alone = dist.new_group([0])  # every rank takes part in making it; rank 0 alone uses it
    for state in ("int8", "bf16"):
        config = _config(2, state, "bf16")
        model, opt = _build(config)
        _train(model, opt, 2)
        saved = opt.state_dict(), {n: p.detach().clone() for n, p in model.named_parameters()}
        for where in ("2 ranks", "1 rank"):
            if where == "1 rank" and rank == 1:
                continue
            model, opt = _build_on(config, Collectives(alone)) if where == "1 rank" else _build(config)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(saved[1][n])
            opt.load_state_dict(saved[0])
            losses = _train(model, opt, 2, first=2)
            out[f"resumed-{state}-{where}"] = {**_weights(model, opt), "#losses": torch.tensor(losses)}
    dist.destroy_process_group(alone)
    return out


def _build_on(config: ZeroConfig, comm):
    """``_build`` over a group of one rank (a run on one process resharded from two)."""
    from zero_strategy.engine.params.flat_parameters import FlatParameters

    torch.manual_seed(0)
    model = _MLP().bfloat16()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sharder = FlatParameters(list(model.parameters()), config, comm)
    opt = ZeroOptimizer(inner, config, sharder=sharder)
    opt.step_backend.tile_numel = 192
    return model, opt


def _straight(state: str, master: str = "bf16") -> dict[str, torch.Tensor]:
    model, opt = _build(_config(2, state, master))
    losses = _train(model, opt, 4)
    return {**_weights(model, opt), "#losses": torch.tensor(losses[2:])}


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), what
    for name in want:
        assert torch.equal(got[name], want[name]), f"{what}: {name} differs by {(got[name] - want[name]).abs().max()}"


@pytest.mark.timeout(240)
def test_every_combination_equals_one_process_bit_for_bit_at_every_stage_and_resumes(tmp_path):
    reference = _all_runs(0, 1)
    ranks = run_distributed(_all_runs, 2, str(tmp_path), timeout_s=220)
    for rank, runs in enumerate(ranks):
        for name, want in reference.items():
            _assert_equal(runs[name], want, f"rank {rank}, {name}")
    for stage in (1, 2, 3):  # offloaded: the same bits as on the device, the encoded state held on the host
        offloaded = dict(reference[f"{stage}-int8-fp32-offload"])
        assert offloaded.pop("#host").item(), stage
        _assert_equal(offloaded, reference[f"{stage}-int8-fp32"], f"stage {stage}, int8 state offloaded")
    # the combinations change the result (the parity above is not of fp32 runs in disguise)
    assert not torch.equal(reference["2-int8-bf16"]["a.weight"], reference["2-bf16-bf16"]["a.weight"])
    assert not torch.equal(reference["2-int8-bf16"]["#state"], reference["2-int8-fp32"]["#state"]) or \
        not torch.equal(reference["2-int8-bf16"]["a.weight"], reference["2-int8-fp32"]["a.weight"])
    for state in ("int8", "bf16"):
        want = _straight(state)
        _assert_equal(ranks[0][f"resumed-{state}-2 ranks"], want, f"resume {state} at 2 ranks")
        _assert_equal(ranks[1][f"resumed-{state}-2 ranks"], want, f"resume {state} at 2 ranks, rank 1")
        _assert_equal(ranks[0][f"resumed-{state}-1 rank"], want, f"resume {state} from 2 ranks onto 1")
    for state, master in CHECKPOINTED:  # a sharded checkpoint of stage 3, loaded at stages 3 and 2
        for rank in (0, 1):  # it holds int8 codes and fp32 scales (or bf16), which decode to the state as it was
            stored = ranks[rank][f"stored-{state}-{master}"]
            assert stored["#form"].item(), f"the checkpoint holds the {state} state in its stored form"
            assert torch.equal(stored["#in fp32 state"], stored["#decoded"]), "loaded into fp32 state"
            assert torch.equal(stored["#consolidated"], stored["#decoded"]), "zero-consolidate's fp32 state"
        want = _straight(state, master)
        for rank in (0, 1):
            for stage in (3, 2):
                _assert_equal(ranks[rank][f"checkpoint-{state}-{master}-s{stage}"], want,
                              f"checkpoint {state}/{master} loaded at stage {stage}, rank {rank}")


# ---- options and their errors ------------------------------------------------------------------


@pytest.mark.parametrize("field, value, match", [
    ("optimizer_state_dtype", "fp8", "is not one of"), ("master_weights_dtype", "fp16", "is not one of"),
    ("stochastic_rounding", "yes", "True or False"), ("optimizer_state_block_size", 100, "power of two"),
    ("optimizer_state_min_numel", -1, "non-negative"),
])
def test_bad_options_are_refused_with_what_is_allowed(field, value, match):
    with pytest.raises(ValueError, match=match):
        ZeroConfig(**{field: value})


def test_unsupported_combinations_are_refused_before_training():
    with pytest.raises(ValueError, match="offload_dir='/tmp/x': the disk and overlapped host steps keep fp32 state"):
        ZeroConfig(optimizer_state_dtype="int8", offload_optimizer=True, offload_dir="/tmp/x")
    with pytest.raises(ValueError, match="bf16 masters are the device's working weights"):
        ZeroConfig(master_weights_dtype="bf16", offload_optimizer=True)
    model = nn.Linear(8, 8).bfloat16()
    with pytest.raises(ValueError, match="int8' covers Adam, AdamW, SGD; RMSprop"):
        ZeroOptimizer(torch.optim.RMSprop(model.parameters()), ZeroConfig(stage=1, optimizer_state_dtype="int8"))
    with pytest.raises(ValueError, match="master_weights_dtype='bf16' makes bf16 working weights their own master"):
        ZeroOptimizer(torch.optim.AdamW(nn.Linear(8, 8).parameters()), ZeroConfig(stage=1, master_weights_dtype="bf16"))
    assert ZeroConfig(master_weights_dtype="bf16").master_dtype is None  # the working weights are the master
    assert ZeroConfig(master_weights_dtype="fp32").master_dtype is torch.float32


def test_bf16_masters_share_the_working_weights_and_state_bytes_follow_the_dtype():
    from zero_strategy.memory import memory_stats

    sizes = {}
    for state, master in (("fp32", "fp32"), ("bf16", "bf16"), ("int8", "bf16")):
        model, opt = _build(_config(1, state, master, optimizer_state_min_numel=0))
        _train(model, opt, 1)
        stats = memory_stats(model, [opt])
        sizes[state] = stats
        if master == "bf16":
            assert stats["master_params"] == 0  # no copy: the bf16 working weights are stepped
    n = sum(p.numel() for p in _MLP().parameters())
    assert sizes["fp32"]["optimizer_states"] >= 8 * n  # torch's two fp32 moments (and step counts)
    assert sizes["bf16"]["optimizer_states"] == 4 * n + 4 * 4  # two bf16 moments; four fp32 step counts
    assert sizes["int8"]["optimizer_states"] < 2.2 * n  # a code per moment and element, and the scales


def test_the_formula_counts_each_combination():
    from zero_strategy.memory import estimate_memory

    n = 1 << 20
    per_param = {combo: estimate_memory(n, 3, 2, "bf16-mixed", optimizer_state_dtype=combo[0],
                                        master_weights_dtype=combo[1])["total"] * 2 / n
                 for combo in (("fp32", "fp32"), ("bf16", "bf16"), ("int8", "bf16"))}
    # issue 31's figures: 16 bytes per parameter, 8 with bf16 state and masters, 6 with int8 (and its scales)
    assert per_param == {("fp32", "fp32"): 16, ("bf16", "bf16"): 8, ("int8", "bf16"): 6 + 2 * 4 / 256}
    with pytest.raises(ValueError, match="has none"):
        estimate_memory(n, 3, 2, "32-true", master_weights_dtype="bf16")
    offloaded = estimate_memory(n, 2, 2, "bf16-mixed", offload_optimizer=True, optimizer_state_dtype="int8")
    state = 2 * (1 + 4 / 256) * n / 2  # two moments of int8 codes and scales, over 2 ranks, on the host
    assert offloaded["optimizer_states"] == state and offloaded["host"] == state + (4 + 4) * n / 2  # + masters, grads
    with pytest.raises(ValueError, match="offload_disk=True with optimizer_state_dtype='int8'"):
        estimate_memory(n, 2, 2, "bf16-mixed", offload_optimizer=True, offload_disk=True, optimizer_state_dtype="int8")


# ---- DeepSpeed's keys --------------------------------------------------------------------------

DS_BF16 = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


def _through_initialize(rank: int, world_size: int) -> dict:
    import zero_strategy as deepspeed
    from zero_strategy.memory import memory_stats

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 80), nn.Tanh(), nn.Linear(80, 10))  # 5120 weights: above the threshold
    config = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1, "bf16": DS_BF16,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 2}}
    engine, opt, _, _ = deepspeed.initialize(model=model, config=config)
    for step in range(3):
        g = torch.Generator().manual_seed(step)  # the same batch on every rank: see the module's docstring
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 10, generator=g)
        engine.backward(F.mse_loss(engine(x).float(), y))
        engine.step()
    stored = opt.step_backend.stored_tensors()
    return {"backend": type(opt.step_backend).__name__, "stored_dtypes": sorted({str(t.dtype) for t in stored}),
            "masters": memory_stats(model, [opt])["master_params"], "weight_dtype": str(model[0].weight.dtype),
            "weights": {n: p.detach().float().clone() for n, p in model.named_parameters()}}


@pytest.mark.timeout(120)
def test_deepspeeds_bf16_keys_train_through_initialize_and_configure_the_strategy():
    from zero_strategy import ZeroStrategy

    one, *two = run_distributed(_through_initialize, 1) + run_distributed(_through_initialize, 2)
    for run in (one, *two):
        assert run["backend"] == "LowPrecisionStep" and run["stored_dtypes"] == ["torch.bfloat16"]
        assert run["masters"] == 0 and run["weight_dtype"] == "torch.bfloat16"
        _assert_equal(run["weights"], one["weights"], "initialize, 2 ranks against 1")
    torch.manual_seed(0)
    assert not torch.equal(one["weights"]["0.weight"], nn.Linear(64, 80).weight.detach().bfloat16().float())
    strategy = ZeroStrategy(config={"bf16": DS_BF16, "zero_optimization": {"stage": 3}})
    assert (strategy.config.master_weights_dtype, strategy.config.optimizer_state_dtype) == ("bf16", "bf16")


@pytest.mark.parametrize("signed", [True, False])
def test_the_code_table_finds_what_bucketize_finds(signed):
    from zero_strategy.engine.optim.lowp import _midpoints, nearest_codes

    mids = _midpoints(signed)
    g = torch.Generator().manual_seed(0)
    spread = torch.rand(50_000, generator=g) * 10.0 ** -torch.randint(0, 12, (50_000,), generator=g).float()
    values = [mids, torch.nextafter(mids, torch.tensor(2.0)), torch.nextafter(mids, torch.tensor(-2.0)), spread,
              torch.rand(50_000, generator=g), torch.tensor([0.0, -0.0, 1.0, 1e-38, 1e-45])]
    x = torch.cat(values).clamp(0.0, 1.0)
    if signed:
        x = torch.cat([x, -x])
    assert torch.equal(nearest_codes(x, signed).long(), torch.bucketize(x, mids))


def test_the_fast_random_bits_and_rounding_are_splitmix64_and_truncation_as_written_out():
    """random_bits16 skips splitmix64's last step and rounding skips its ``where`` where no value can
    overflow: both against the algorithm written here with Python integers (what cuda/adam_lowp.cu does)."""
    from zero_strategy.engine.optim.lowp import random_bits16, round_to_bf16, sr_base

    mask = (1 << 64) - 1

    def splitmix_bits(base: int, position: int) -> int:
        z = (position * 0x9E3779B97F4A7C15 + base) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return ((z ^ (z >> 31)) >> 40) & 0xFFFF

    for seed, step, key, slot, start in ((0, 0, 0, 0, 0), (7, 3, 1 << 20, 2, 12345), (1, 99, 5, 0, 1 << 40)):
        got = random_bits16(seed, step, key, start, 300, slot=slot)
        base = sr_base(seed, step, key, slot) & mask
        assert got.tolist() == [splitmix_bits(base, start + i) for i in range(300)]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5000, generator=g) * 10.0 ** torch.randint(-30, 30, (5000,), generator=g).float()
    bits = x.view(torch.int32).tolist()
    noise = random_bits16(4, 5, 6, 70, 5000, slot=1).tolist()
    want = torch.tensor([((b + r) >> 16) for b, r in zip(bits, noise)], dtype=torch.int32)  # truncated
    got = round_to_bf16(x, True, 4, 5, 6, 70, 1).view(torch.int16).int()
    assert torch.equal(got, torch.where(want >= 1 << 15, want - (1 << 16), want))
