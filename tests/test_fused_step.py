"""The engine's fused mixed-precision step, run on the CPU through the kernel emulator
(tests/kernel_emulator.py), against the same run on the torch path (``set_backend("torch")``).

[Note: fused step against the torch path]
Both runs are the same ZeroOptimizer over the same OddMLP, data and seed, with bf16 or fp16 working
weights, fp32 masters, AdamW (or SGD with momentum) and clipping by norm (at every step but the
last, whose factor is then a host float, not a device scalar); fp16 runs have a dynamic
LossScaler and one step whose gradient overflows on one rank and is skipped. Only the backend
switch differs. Where the kernels run (see [Note: the fused mixed-precision step] in
zero_strategy/engine/optim/step/grads.py) the bf16/fp16 gradients are read as reduced, 1/loss scale times the clip
coefficient is one factor handed to the kernel, and the update writes the fp32 master and the
working weights in one pass; on the torch path the gradients are copied to fp32, unscaled, clipped
and stepped by torch.optim, and the masters rounded into the working weights after.

How far apart may they be? Each path rounds once per operation in fp32, in the same order (the
emulator is the kernels' per-element formula in torch fp32). The one value computed differently is
the clipping norm: the kernel sums squares per block of 16384 in fp32 and the blocks in fp64, torch
takes per-tensor fp32 norms and sums their squares in fp64; the two totals differ by a few fp32 ulps
(NORM_RTOL: eight), and so does the clip coefficient, so an update may round to the neighbouring
fp32 value and a master move by an ulp of itself at a step. Over STEPS steps that stays within
MASTER_TOLERANCE: four fp32 ulps relative, plus one ulp of 1.0 absolute, because a weight near
zero, reached by subtracting updates from a larger one, carries that one's rounding (the weights
here are below 1.5). A bug moves masters by the size of an update (lr 1e-2) or a gradient's
rounding to 16 bits (2**-8 relative), thousands of times more. A working weight is its master
rounded once to 16 bits on both paths, so it may differ by one ulp of bf16/fp16 where the masters
straddle a rounding boundary, and by no more (checked on the bit patterns: ``_assert_within_one_ulp``). The
losses are computed from those working weights, so they agree to LOSS_TOLERANCE: one 16-bit ulp of
a few weights moves an MSE loss by far less than a 16-bit ulp of it.

That the fused path really ran is checked on its own: the emulated launches are exactly one
``adam_step<G, G>`` (or ``sgd_step``) per step taken and param group with elements to step on
this rank (at least one a step), G the working dtype, so the gradients were read as bf16/fp16 (an fp32
copy would launch ``<float, ...>``) and the working weights written by the update;
``grad_norm_partials<G>`` for each overflow check and each clip; and ``opt._step.deferred`` held
with gradients of dtype G before every step. The torch run launches nothing.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from zero_strategy import ZeroConfig, ZeroOptimizer, gathered_parameters, kernels
from zero_strategy.engine import LossScaler, shard_module
from zero_strategy.kernels.loader import CUDA_TYPE_NAMES

from .distributed import run_distributed
from .kernel_emulator import emulated_kernels
from .models import OddMLP, batch, make_optimizer, param_groups
from .test_engine_parity import TINY_BUCKET_MB

STEPS = 6
CLIP = 0.05  # below the gradients' norm at every step here, so every clipped step clips
UNCLIPPED_STEP = STEPS - 1  # its factor is 1/loss scale alone: a host float, not a device scalar
OVERFLOW_STEP = 2  # fp16 runs: the gradient of model.scale is inf at this step on rank 0
# see [Note: fused step against the torch path]
NORM_RTOL = 2**-20  # eight fp32 ulps
MASTER_TOLERANCE = dict(rtol=2**-21, atol=2**-23)
LOSS_TOLERANCE = dict(rtol=1e-4, atol=1e-7)  # below an ulp of the loss in fp16 (2**-11) and bf16 (2**-8)
UNITS = dict(shard_modules=("Linear",), param_persistence_threshold=0)  # stage 3: every Linear a unit
CASES = {
    # name: (stage, working dtype, optimizer, initial loss scale (None: no LossScaler), norm type of the clipping)
    "s1-bf16-adamw": (1, torch.bfloat16, "adamw", None, 2.0),
    "s2-bf16-adamw": (2, torch.bfloat16, "adamw", None, 2.0),
    "s3-bf16-adamw": (3, torch.bfloat16, "adamw", None, 2.0),
    "s1-fp16-adamw-scaled": (1, torch.float16, "adamw", 2.0**10, 2.0),
    "s2-fp16-adamw-scaled": (2, torch.float16, "adamw", 2.0**10, 2.0),
    "s3-fp16-adamw-scaled": (3, torch.float16, "adamw", 2.0**10, 2.0),
    "s2-bf16-sgd": (2, torch.bfloat16, "sgd", None, 2.0),
    "s3-fp16-sgd-scaled": (3, torch.float16, "sgd", 2.0**10, 2.0),
    "s2-bf16-adamw-l1": (2, torch.bfloat16, "adamw", None, 1.0),
    "s2-fp16-adamw-scaled-l1": (2, torch.float16, "adamw", 2.0**16, 1.0),  # the LossScaler's default start
    "s3-fp16-adamw-scaled-linf": (3, torch.float16, "adamw", 2.0**10, float("inf")),
}
ONE_NORM_CASES = [case for case, (*_, norm_type) in CASES.items() if norm_type == 1.0]
"""Clipping by a norm the kernel does not compute: the torch code reads the bf16/fp16 gradients as they are."""
INF_NORM_CASES = [case for case, (*_, norm_type) in CASES.items() if norm_type == float("inf")]


def _engine_run(case: str, backend: str, rank: int, launched: Counter) -> dict:
    """Train ``case`` for STEPS steps with the kernel backend ``backend`` ("auto": the emulated kernels)."""
    stage, dtype, optimizer, loss_scale, norm_type = CASES[case]
    scaled = loss_scale is not None
    kernels.set_backend(backend)
    try:
        torch.manual_seed(0)
        model = OddMLP().to(dtype)
        config = ZeroConfig(stage=stage, bucket_cap_mb=TINY_BUCKET_MB, **(UNITS if stage == 3 else {}))
        user_opt = make_optimizer(optimizer, param_groups(model))
        sharder = shard_module(model, config) if stage == 3 else None
        scaler = LossScaler(scale=loss_scale, window=2, hysteresis=1) if scaled else None  # moves within STEPS
        opt = ZeroOptimizer(user_opt, config, sharder=sharder, scaler=scaler)
        step_of = [0]
        poisoned = scaled and rank == 0  # at world size 2, rank 1 learns of it from the overflow flag alone
        model.scale.register_hook(lambda g: g * float("inf") if poisoned and step_of[0] == OVERFLOW_STEP else g)
        before = launched.copy()
        out = {"losses": [], "scales": [], "norms": [], "deferred": [], "working_is_rounded_master": [],
               "groups_stepped": 0}
        for step in range(STEPS):
            step_of[0] = step
            x, y = batch(step, rank)
            opt.zero_grad()
            loss = F.mse_loss(model(x.to(dtype), step, 0).float(), y)
            (scaler.scale_loss(loss) if scaler else loss).backward()
            opt.reduce_gradients()
            if not opt.overflowed and step != UNCLIPPED_STEP:  # an overflowing step is skipped: no norm
                out["norms"].append(opt.clip_grad_norm_(CLIP, norm_type).item())
            out["deferred"].append(opt._step.deferred and all(g.dtype == dtype for g in opt._step.grads))
            if not opt.overflowed:  # the param groups with elements to step: one launch each
                stepped = set(opt._step.where)
                out["groups_stepped"] += len({ref.param_group for ref in opt.pieces()
                                              if (ref.group_index, ref.index) in stepped and ref.piece.numel})
            opt.step()
            out["losses"].append(loss.item())
            out["scales"].append((scaler.scale, scaler.skipped_steps) if scaler else None)
            # the update wrote every stepped piece's working weights: they are its master rounded
            out["working_is_rounded_master"].append(all(
                torch.equal(ref.group.weights(ref.piece), ref.tensor.to(dtype)) for ref in opt.pieces()))
        out["masters"] = {(ref.group_index, ref.index): ref.tensor.detach().clone() for ref in opt.pieces()}
        with gathered_parameters(model):
            out["weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        out["launched"] = launched - before
        return out
    finally:
        kernels.set_backend(None)


def _both_paths(rank: int, world_size: int, cases: list[str]) -> dict:
    """Each case on the emulated kernels and on the torch path, in this process (a pooled worker too:
    the emulator puts everything back when it exits)."""
    with emulated_kernels() as launched:
        return {case: {backend: _engine_run(case, backend, rank, launched) for backend in ("auto", "torch")}
                for case in cases}


def _ordered(bits: torch.Tensor) -> torch.Tensor:
    """16-bit floats' bit patterns as integers in the order of their values (sign-magnitude to two's
    complement), so adjacent representable values differ by 1."""
    raw = bits.view(torch.int16).to(torch.int32)
    return torch.where(raw < 0, -(raw & 0x7FFF), raw)


def _assert_within_one_ulp(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    distance = (_ordered(got) - _ordered(want)).abs().reshape(-1)
    largest = int(distance.max()) if distance.numel() else 0
    assert largest <= 1, f"{what}: {int((distance > 1).sum())} elements more than one ulp apart (largest {largest})"


def _assert_fused_matches_torch(case: str, runs: dict, where: str) -> None:
    """See [Note: fused step against the torch path]; ``where`` names the process in messages."""
    stage, dtype, optimizer, loss_scale, norm_type = CASES[case]
    scaled = loss_scale is not None
    fused, reference = runs["auto"], runs["torch"]
    # the fused path ran: see [Note: fused step against the torch path]
    g = CUDA_TYPE_NAMES[dtype]
    taken = STEPS - (1 if scaled else 0)
    step_kernel = f"{'sgd' if optimizer == 'sgd' else 'adam'}_step<{g}, {g}>"
    # every overflow check, and every clip by the 2- or inf-norm (others run torch code: [Note: when the kernels run])
    norm_passes = (STEPS if scaled else 0) + (len(fused["norms"]) if norm_type in (2.0, float("inf")) else 0)
    norm_kernels = {f"grad_norm_partials<{g}>": norm_passes, "grad_norm_final": norm_passes} if norm_passes else {}
    what = f"{case} {where}"
    assert fused["launched"] == {step_kernel: fused["groups_stepped"], **norm_kernels}, (what, fused["launched"])
    assert fused["groups_stepped"] >= taken and all(fused["deferred"]), what
    assert all(fused["working_is_rounded_master"]) and all(reference["working_is_rounded_master"]), what
    assert reference["launched"] == {} and not any(reference["deferred"]), what
    # the runs did what the case says: every clipped step clipped, the overflow skipped on every rank
    assert min(fused["norms"]) > CLIP and len(fused["norms"]) == taken - 1, (what, fused["norms"])
    if scaled:
        assert fused["scales"][OVERFLOW_STEP][1] == 1 == fused["scales"][-1][1], (what, fused["scales"])
    # and matched the torch path
    assert fused["scales"] == reference["scales"], what
    torch.testing.assert_close(torch.tensor(fused["norms"]), torch.tensor(reference["norms"]), rtol=NORM_RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(fused["losses"]), torch.tensor(reference["losses"]), **LOSS_TOLERANCE)
    assert fused["masters"].keys() == reference["masters"].keys()
    for key, want in reference["masters"].items():
        torch.testing.assert_close(fused["masters"][key], want, **MASTER_TOLERANCE,
                                   msg=lambda m: f"{what}, master {key}: {m}")
    assert fused["weights"].keys() == reference["weights"].keys()
    for name, want in reference["weights"].items():
        assert fused["weights"][name].dtype == want.dtype
        if want.dtype == dtype:
            _assert_within_one_ulp(fused["weights"][name], want, f"{what}, {name}")
        else:
            assert torch.equal(fused["weights"][name], want), f"{what}, {name}"


@pytest.mark.timeout(120)
def test_fused_step_matches_the_torch_path():
    cases = [case for case in CASES if case not in ONE_NORM_CASES + INF_NORM_CASES]
    for case, runs in _both_paths(0, 1, cases).items():
        _assert_fused_matches_torch(case, runs, "in one process")


@pytest.mark.timeout(120)
def test_fused_step_at_world_size_two_matches_the_torch_path():
    cases = ["s1-bf16-adamw", "s2-fp16-adamw-scaled", "s3-bf16-adamw", "s3-fp16-sgd-scaled"]
    for rank, results in enumerate(run_distributed(_both_paths, 2, cases)):
        for case in cases:
            _assert_fused_matches_torch(case, results[case], f"on rank {rank} of 2")


# Clipping by norms the kernels do not take (1, inf): their norms in fp32 (raw fp16 ones overflow under
# loss scaling), and an empty gradient left out of the inf-norm.
@pytest.mark.timeout(120)
def test_fused_step_clipping_by_the_one_norm_matches_the_torch_path():
    for case, runs in _both_paths(0, 1, ONE_NORM_CASES).items():
        _assert_fused_matches_torch(case, runs, "in one process")


@pytest.mark.timeout(120)
def test_fused_step_clipping_by_the_inf_norm_matches_the_torch_path():
    for case, runs in _both_paths(0, 1, INF_NORM_CASES).items():
        _assert_fused_matches_torch(case, runs, "in one process")
