"""Where the step's time goes (issue 53): the step breakdown on 2 gloo ranks, the engine without
Lightning. Its parts add up to the step's time and land where the time was spent (sleeps placed in the
forward, the backward and the loop); a rank that issues its gathers late makes the other wait, and the
advice names prefetch; the profiler ranges name the units; the FLOPs of a small transformer are the
hand count. Then, without processes: the advice's rules, the devices' peaks, the options and
DeepSpeed's keys. The Trainer's logging and end-of-fit table: test_lightning.py; zero-train's: test_cli.py.
"""

from __future__ import annotations

import contextlib
import io
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zero_strategy.config import ZeroConfig
from zero_strategy.engine import Collectives, ZeroOptimizer, shard_module
from zero_strategy.engine.diagnose.breakdown import PARTS
from zero_strategy.step_report import advise, mean_ms, units_of

from .distributed import run_distributed

FORWARD_S, BACKWARD_S, REST_S = 0.02, 0.04, 0.03  # sleeps placed in each part of a step
DELAY_S = 0.03  # rank 1 issues each stage-3 gather this late
WIDTH, VOCAB, HEADS, T, B = 16, 32, 2, 8, 2


class SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(BACKWARD_S)
        return grad


class Block(nn.Module):
    def __init__(self, d: int = WIDTH) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.proj(torch.tanh(self.fc(x)))


class Sleepy(nn.Module):
    """Three blocks (stage-3 units) after an input layer; its forward sleeps FORWARD_S, its backward BACKWARD_S."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.Sequential(*[Block() for _ in range(3)])

    def forward(self, x):
        time.sleep(FORWARD_S)
        return self.blocks(SleepInBackward.apply(self.inp(x)))


class Attention(nn.Module):
    """Causal self-attention written with matmuls, so that its FLOPs are the products counted by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):  # (B, T, C)
        q, k, v = self.qkv(x).split(WIDTH, dim=-1)
        q, k, v = (t.view(B, T, HEADS, WIDTH // HEADS).transpose(1, 2) for t in (q, k, v))  # (B, H, T, hd)
        scores = (q @ k.transpose(-2, -1)) / (WIDTH // HEADS) ** 0.5  # (B, H, T, T)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        y = scores.softmax(-1) @ v  # (B, H, T, hd)
        return self.out(y.transpose(1, 2).reshape(B, T, WIDTH))


class TransformerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.fc, self.proj = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(TransformerBlock() for _ in range(layers))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx):  # (B, T) token ids
        h = self.wte(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(h)  # (B, T, V)


def hand_count(layers: int = 2) -> tuple[int, int]:
    """(FLOPs of one forward, of forward and backward) of TinyGPT on a (B, T) batch: 2 m n k per product;
    backward twice each forward product (the gradients of both operands: every input of a product
    needs one, the embedding's output too); layer norms, softmax, GELU and the lookup count nothing."""
    n, d = B * T, WIDTH
    linear = 2 * n * d * 3 * d + 2 * n * d * d + 2 * n * d * 4 * d * 2  # qkv, out, fc and proj
    attention = 2 * (2 * B * T * T * d)  # q k^T and (scores) v, over the heads
    forward = layers * (linear + attention) + 2 * n * d * VOCAB  # the blocks, the head
    return forward, 3 * forward


class SlowGathers(Collectives):
    """On rank 1, each stage-3 unit's all-gather is issued ``delay`` seconds late."""

    delay = 0.0

    def all_gather(self, output, input, what=lambda: "collective", header=None):
        if self.delay and self.rank == 1 and "stage-3 unit" in what():
            time.sleep(self.delay)
        return super().all_gather(output, input, what, header)


def _stage3(model: nn.Module, unit: str = "Block"):
    """``model`` at stage 3, each ``unit`` a unit, with AdamW: (sharder, optimizer)."""
    config = ZeroConfig(stage=3, shard_modules=(unit,), param_persistence_threshold=0)
    sharder = shard_module(model, config)
    return sharder, ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), config, sharder=sharder)


def _adds_up(rank: int) -> dict:
    torch.manual_seed(0)
    model = Sleepy()
    sharder, opt = _stage3(model)
    ends = []
    for step in range(11):
        time.sleep(REST_S)  # the loop's own time, outside the engine's phases
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).square().mean().backward()
        opt.step()
        ends.append(time.perf_counter())
        opt.zero_grad()
    records = list(opt.comm.breakdown.records)
    sharder.remove_hooks()
    opt.remove_hooks()
    return {"records": [(r.seconds, r.total, r.samples) for r in records],
            "measured": [b - a for a, b in zip(ends, ends[1:])]}


def _delayed(rank: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), *[Block() for _ in range(3)])
    config = ZeroConfig(stage=3, shard_modules=("Block",), param_persistence_threshold=0, prefetch=False)
    comm = SlowGathers()
    sharder = shard_module(model, config, comm)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), config, comm, sharder=sharder)
    for step in range(10):
        comm.delay = DELAY_S if step >= 5 else 0.0
        model(torch.randn(4, WIDTH)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    records = list(comm.breakdown.records)
    out = {"before": mean_ms(records[1:5]), "after": mean_ms(records[6:10]), "units": units_of(sharder),
           "waited": opt.comm_stats(times=True)}
    sharder.remove_hooks()
    opt.remove_hooks()
    return out


def _traced(rank: int) -> list[str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), *[Block() for _ in range(3)])
    sharder, opt = _stage3(model)
    model(torch.randn(4, WIDTH)).sum().backward()  # a step outside the trace: the next is a steady one
    opt.step()
    opt.zero_grad()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(torch.randn(4, WIDTH)).sum().backward()
        opt.step()
    names = sorted({e.name for e in prof.events() if e.name.startswith("zero/")})
    sharder.remove_hooks()
    opt.remove_hooks()
    return names


def _flops(rank: int) -> dict:
    torch.manual_seed(0)
    model = TinyGPT()
    sharder, opt = _stage3(model, "TransformerBlock")
    for step in range(2):
        for micro in range(2):  # two micro-batches per optimizer step
            idx = torch.randint(0, VOCAB, (B, T + 1), generator=torch.Generator().manual_seed(step + micro + rank))
            F.cross_entropy(model(idx[:, :-1]).reshape(-1, VOCAB), idx[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    counted = opt.comm.breakdown.flops
    last = opt.comm.breakdown.last()
    sharder.remove_hooks()
    opt.remove_hooks()
    return {"per_step": counted.per_step, "forward": counted.forward_per_step,
            "samples": last.samples, "tokens": last.tokens}


def _deepspeed_reports(rank: int, out_file: str) -> str:
    import zero_strategy as deepspeed

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 2,
              "wall_clock_breakdown": True, "zero_optimization": {"stage": 3},
              "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": out_file if rank == 0 else None},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), *[Block() for _ in range(2)])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        engine, _, _, _ = deepspeed.initialize(model=model, config=config)
        for _ in range(8):  # 4 optimizer steps
            engine.backward(engine(torch.randn(4, WIDTH)).square().mean())
            engine.step()
    engine.destroy()
    return printed.getvalue()


def _cases(rank: int, world_size: int, out_file: str) -> dict:
    return {"adds_up": _adds_up(rank), "delayed": _delayed(rank), "traced": _traced(rank), "flops": _flops(rank),
            "deepspeed": _deepspeed_reports(rank, out_file)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_file = str(tmp_path_factory.mktemp("profile") / "flops.txt")
    return run_distributed(_cases, 2, out_file), out_file


@pytest.mark.timeout(240)
def test_parts_add_up_to_the_step_and_land_where_the_time_went(runs):
    for rank, result in enumerate(runs[0]):
        records, measured = result["adds_up"]["records"][1:], result["adds_up"]["measured"]  # the first warms up
        assert len(records) == len(measured) == 10
        for seconds, total, samples in records:
            assert set(seconds) == set(PARTS) and samples == 4
            assert sum(seconds.values()) == pytest.approx(total, abs=1e-9)  # a partition of the step
            assert min(seconds.values()) >= -1e-9, seconds
        engine_total = sum(total for _, total, _ in records)
        assert abs(engine_total - sum(measured)) <= 0.05 * sum(measured), (engine_total, sum(measured))
        # each sleep in its part: a sleep lasts at least its time, and a part that lost its sleep to another
        # (a phase ending or beginning at the wrong point) holds less. (No upper bounds: on a host with more
        # runnable threads than cores the computation around the sleeps takes many times its time.)
        for seconds, _, _ in records:
            assert seconds["forward"] >= FORWARD_S and seconds["backward"] >= BACKWARD_S, (rank, seconds)
            assert seconds["rest"] >= REST_S, (rank, seconds)


@pytest.mark.timeout(240)
def test_a_rank_that_gathers_late_makes_the_other_wait_and_the_advice_names_prefetch(runs):
    delayed = runs[0][0]["delayed"]  # rank 0 waits for rank 1's late gathers
    gathers_per_step = 3 + 3  # each unit in forward and again in backward (prefetch is off)
    assert delayed["after"]["gather"] - delayed["before"]["gather"] >= 0.5 * gathers_per_step * DELAY_S * 1e3
    assert delayed["waited"]["all_gather_s"] >= 0.5 * gathers_per_step * DELAY_S
    assert delayed["waited"]["total_s"] >= delayed["waited"]["all_gather_s"]
    config = ZeroConfig(stage=3, shard_modules=("Block",), param_persistence_threshold=0, prefetch=False)
    advice = dict(advise(delayed["after"], config, delayed["units"]))
    assert "prefetch" in advice and "prefetch=True" in advice["prefetch"], advice
    block = WIDTH * 2 * WIDTH * 2 + 2 * WIDTH + WIDTH
    assert [tuple(unit) for unit in delayed["units"]] == [(str(i), block, 4 * block) for i in (1, 2, 3)]


@pytest.mark.timeout(240)
def test_profiler_ranges_name_the_units_and_the_step(runs):
    names = runs[0][0]["traced"]
    for unit in ("1", "2", "3"):  # nn.Sequential's blocks, by their names in the model
        assert f"zero/gather {unit}" in names and f"zero/wait gather {unit}" in names, names
    assert any(n.startswith("zero/reduce-scatter segment ") for n in names), names
    assert any(n.startswith("zero/wait reduce-scatter segment ") for n in names), names
    assert {"zero/step", "zero/update", "zero/all-gather updated parameters"} <= set(names), names


def test_ranges_cost_nothing_when_no_profiler_records():
    from zero_strategy.engine.diagnose.ranges import _NO_RANGE, profiling, span

    assert not profiling()
    assert span(lambda: 1 / 0) is _NO_RANGE  # a shared no-op; the name is not even built


@pytest.mark.timeout(240)
def test_the_flops_of_a_small_transformer_are_the_hand_count(runs):
    forward, total = hand_count()
    for result in runs[0]:
        flops = result["flops"]
        assert flops["forward"] == 2 * forward  # two micro-batches in the step counted
        assert flops["per_step"] == 2 * total
        assert (flops["samples"], flops["tokens"]) == (2 * B, 2 * B * T)


def test_a_backward_inside_the_open_forward_phase_leaves_no_counter_on():
    """Manual optimization's shape: the front end's forward phase opens around training_step, which
    calls the model and then backward itself. The autograd engine puts back, after a backward, the
    dispatch modes the thread had when it began, so the FLOP counter, still on then, must be left
    outside it (it was left inside, came back, and slowed every later operation of the run)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    from torch.utils.flop_counter import FlopCounterMode

    from zero_strategy.engine.diagnose.breakdown import BACKWARD, StepBreakdown

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x = torch.randn(3, 8)
    with FlopCounterMode(display=False) as reference:
        model(x)
    breakdown = StepBreakdown()
    breakdown.enable(True, torch.device("cpu"))
    breakdown.watch(model)
    for p in model.parameters():  # as the engine's gradient hooks do (engine/grads/reducer.py)
        p.register_hook(lambda grad: breakdown.enter(BACKWARD))
    for _ in range(2):
        breakdown.forward_began((x,))  # the front end's step, around the model's own forward
        model(x).square().sum().backward()  # backward reached while the phase is open: counting stops there
        breakdown.forward_ended(None)
        breakdown.end_step()
        assert _get_current_dispatch_mode_stack() == []
    assert breakdown.flops.forward_per_step == reference.get_total_flops()  # backward's products not counted


@pytest.mark.timeout(240)
def test_initialize_prints_deepspeeds_reports(runs):
    (results, out_file) = runs
    printed = results[0]["deepspeed"]
    lines = printed.splitlines()
    micro = [line for line in lines if line.startswith("[Rank 0] time (ms) | fwd_microstep: ")]
    whole = [line for line in lines if line.startswith("[Rank 0] time (ms) | fwd: ")]
    assert len(micro) == 8 and len(whole) == 4, printed
    for line in micro:
        assert [part.split(":")[0] for part in line.split(" | ")[1:]] == [
            "fwd_microstep", "bwd_microstep", "bwd_inner_microstep", "bwd_allreduce_microstep", "step_microstep"]
    assert [line.split(",")[0] for line in lines if line.startswith("[Rank 0] step=")] == [
        "[Rank 0] step=2", "[Rank 0] step=4"]
    assert sum("RunningAvgSamplesPerSec=" in line and "CurrSamplesPerSec=" in line for line in lines) == 2
    assert results[1]["deepspeed"] == ""  # rank 0 alone prints, as DeepSpeed
    profile = open(out_file).read()
    assert "Profile Summary at step 1:" in profile and "DeepSpeed Flops Profiler" in profile
    fwd_flops = next(line for line in profile.splitlines() if line.startswith("fwd flops per GPU:"))
    per_micro = 2 * 4 * (WIDTH * WIDTH + 2 * (WIDTH * 2 * WIDTH * 2))  # the Linear products of one forward
    assert fwd_flops.split(":")[1].split() == [f"{round(2 * per_micro / 1e3, 2):g}", "K"]  # two micro-batches


# ---- without processes: the rules, the peaks, the options, DeepSpeed's keys ----------------------


def _ms(**parts: float) -> dict[str, float]:
    ms = dict.fromkeys(PARTS, 0.0)
    ms.update(parts)
    ms["step"] = sum(ms[p] for p in PARTS)
    return ms


def test_each_rule_of_the_advice_names_its_option():
    stage3 = ZeroConfig(stage=3)
    assert dict(advise(_ms(forward=10, backward=10), stage3)) == {}  # nothing exposed: nothing to say
    with_prefetch = dict(advise(_ms(forward=10, gather=5), stage3))
    assert list(with_prefetch) == ["quantized_weights"]
    assert "quantized_weights=True" in with_prefetch["quantized_weights"]
    small = [(f"blocks.{i}", 1000, 4000) for i in range(3)]  # latency-bound gathers: larger units, not fewer bytes
    assert "name a larger module class in shard_modules" in dict(advise(_ms(forward=10, gather=5), stage3, small))[
        "shard_modules"]
    small = dict(advise(_ms(backward=10, reduce=5), ZeroConfig(stage=2, bucket_cap_mb=0.5)))
    assert "bucket_cap_mb=0.5" in small["bucket_cap_mb"]
    assert not advise(_ms(backward=10, reduce=5), ZeroConfig(stage=2))  # 25 MiB buckets: not latency-bound
    offload = ZeroConfig(stage=2, offload_optimizer=True)
    assert "offload_overlap=True" in dict(advise(_ms(backward=10, optimizer=30), offload))["offload_overlap"]
    assert not advise(_ms(backward=10, optimizer=30), ZeroConfig(stage=2, offload_optimizer=True, offload_overlap=True))
    units = [("blocks.0", 10**6, 4 * 10**6), ("blocks.1", 10**6, 4 * 10**6), ("blocks.2", 10**6, 4 * 10**6),
             ("head", 9 * 10**6, 36 * 10**6)]
    large = dict(advise(_ms(forward=10, gather=5), stage3, units))
    assert "'head' holds 9,000,000 parameters, 9x" in large["unit_params"] and "quantized_weights" in large


def test_peak_flops_of_known_devices(monkeypatch):
    from zero_strategy.engine.diagnose.flops import peak_flops

    cuda = torch.device("cuda", 0)
    assert peak_flops(torch.device("cpu"), torch.bfloat16) is None
    for name, dtype, peak in [("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4e12),
                              ("NVIDIA H100 PCIe", torch.bfloat16, 756e12), ("NVIDIA H200", torch.float16, 989.4e12),
                              ("NVIDIA A100-SXM4-80GB", torch.float32, 19.5e12), ("NVIDIA L4", torch.bfloat16, 121e12),
                              ("NVIDIA A10G", torch.bfloat16, None), ("Tesla T4", torch.bfloat16, None),
                              ("Tesla T4", torch.float16, 65e12), ("NVIDIA H100 NVL", torch.bfloat16, None),
                              ("Tesla V100-PCIE-16GB", torch.float16, 112e12)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert peak_flops(cuda, dtype) == peak, name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with monkeypatch.context() as m:
        m.setattr(torch, "get_float32_matmul_precision", lambda: "high")  # TF32 allowed
        assert peak_flops(cuda, torch.float32) == 156e12


def test_the_options_are_checked():
    with pytest.raises(ValueError, match="step_breakdown='yes' must be True"):
        ZeroConfig(step_breakdown="yes")
    for bad in (0, -1.0, float("inf"), "312e12", True):
        with pytest.raises(ValueError, match="peak_flops=.* must be a positive number of FLOP/s"):
            ZeroConfig(peak_flops=bad)
    assert ZeroConfig(peak_flops=312e12).peak_flops == 312e12 and ZeroConfig().step_breakdown


def test_deepspeeds_report_keys_are_read_and_checked():
    from zero_strategy.deepspeed.config import DeepSpeedConfigError, map_deepspeed_config

    config = {"zero_optimization": {"stage": 3}, "steps_per_print": 10, "wall_clock_breakdown": False,
              "flops_profiler": {"enabled": True, "profile_step": 3, "module_depth": -1, "top_modules": 1,
                                 "detailed": True, "output_file": None}}
    honoured = map_deepspeed_config(config, front_end="initialize")
    assert not {"steps_per_print", "wall_clock_breakdown", "flops_profiler"} & set(honoured.ignored)
    reporting = honoured.reporting
    assert reporting.steps_per_print == 10 and reporting.flops_profiler.profile_step == 3
    assert reporting.wall_clock_breakdown  # the profiler turns it on, as in DeepSpeed
    assert {"steps_per_print", "wall_clock_breakdown", "flops_profiler"} <= set(map_deepspeed_config(config).ignored)
    with pytest.raises(DeepSpeedConfigError, match="flops_profiler.profile_stepz: unknown key"):
        map_deepspeed_config({"flops_profiler": {"profile_stepz": 3}})
    with pytest.raises(DeepSpeedConfigError, match="steps_per_print=0 must be an integer of at least 1"):
        map_deepspeed_config({"steps_per_print": 0})
