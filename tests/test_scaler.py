"""The fp16 loss scaler moves its scale as DeepSpeed's DynamicLossScaler does.

Checked three ways: against DeepSpeed's own class step by step (where deepspeed is importable:
``DS_BUILD_OPS=0 pip install deepspeed==0.19.8``), against DeepSpeed's rules written out
independently below in DeepSpeed's own terms (iteration numbers, not counters; runs everywhere),
and on the named cases of [Note: DeepSpeed's dynamic loss scale].
"""

from __future__ import annotations

import random
import types

import pytest
import torch

from zero_strategy.engine.grads.scaler import LossScaleError, LossScaler

# (window, hysteresis, min_scale): the brief's window 4 / hysteresis 2, DeepSpeed's defaults' shape,
# a scaler without hysteresis, and one that reaches its floor
SETTINGS = [(4, 2, 1.0), (1000, 2, 1.0), (3, 1, 1.0), (2, 3, 0.25), (4, 2, 2.0**10)]


class _DeepSpeedRules:
    """DeepSpeed 0.19's dynamic loss scale (consecutive_hysteresis off), written from its description:
    iterations are numbered, an overflow records its number, and the scale doubles at iteration i when
    i - last_overflow - 1 is a positive multiple of the window."""

    def __init__(self, scale: float, window: int, hysteresis: int, min_scale: float) -> None:
        self.scale, self.window, self.hysteresis, self.min_scale = scale, window, hysteresis, min_scale
        self.left, self.iteration, self.last_overflow = hysteresis, 0, -1

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.hysteresis == 1 or self.left == 1:
                if self.scale == self.min_scale:
                    raise RuntimeError("already at the minimum")
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.left -= 1
            self.last_overflow = self.iteration
        else:
            stable = self.iteration - self.last_overflow - 1
            if stable > 0 and stable % self.window == 0:
                self.left = self.hysteresis
                self.scale *= 2
        self.iteration += 1


def _overflows(seed: int, steps: int = 300) -> list[bool]:
    """Bursts of overflows between clean stretches, so the scale both grows and shrinks."""
    rng = random.Random(seed)
    return [rng.random() < (0.6 if (i // 7) % 3 == 0 else 0.05) for i in range(steps)]


def _run_side_by_side(ours: LossScaler, update_theirs, read_theirs, sequence: list[bool]) -> int:
    """Feed both scalers the same overflows; compare (scale, hysteresis left) after each. Returns the
    steps run: fewer when both raised at the minimum scale, at the same step."""
    for step, overflow in enumerate(sequence):
        try:
            ours.update(overflow)
        except LossScaleError:
            with pytest.raises(Exception, match="minimum"):  # DeepSpeed raises a bare Exception
                update_theirs(overflow)
            return step
        update_theirs(overflow)
        assert (ours.scale, ours.overflows_left) == read_theirs(), f"step {step} (overflow={overflow})"
    return len(sequence)


@pytest.mark.parametrize(("window", "hysteresis", "min_scale"), SETTINGS)
def test_the_scale_follows_deepspeeds_rules(window, hysteresis, min_scale):
    reached_the_floor = False
    for seed in range(20):
        ours = LossScaler(scale=2.0**16, window=window, hysteresis=hysteresis, min_scale=min_scale)
        rules = _DeepSpeedRules(2.0**16, window, hysteresis, min_scale)
        reached_the_floor |= _run_side_by_side(ours, rules.update, lambda: (rules.scale, rules.left),
                                               _overflows(seed)) < 300
    if min_scale > 1:
        assert reached_the_floor  # the raise at the minimum was compared too


@pytest.mark.parametrize(("window", "hysteresis", "min_scale"), SETTINGS)
def test_the_scale_equals_deepspeeds_own_scaler(monkeypatch, window, hysteresis, min_scale):
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler", exc_type=ImportError,
                                      reason="compare with DeepSpeed's own scaler where it is installed")
    monkeypatch.setattr(loss_scaler, "dist", types.SimpleNamespace(get_rank=lambda: 0))  # its log line's rank
    reached_the_floor = False
    for seed in range(20):
        ours = LossScaler(scale=2.0**12, window=window, hysteresis=hysteresis, min_scale=min_scale)
        theirs = loss_scaler.DynamicLossScaler(init_scale=2.0**12, scale_window=window, min_scale=min_scale,
                                               delayed_shift=hysteresis, consecutive_hysteresis=False)
        steps = _run_side_by_side(ours, theirs.update_scale, lambda: (theirs.cur_scale, theirs.cur_hysteresis),
                                  _overflows(seed))
        reached_the_floor |= steps < 300
    if min_scale > 1:
        assert reached_the_floor  # the raise at the minimum was compared too


def test_named_cases_of_the_rules():
    scaler = LossScaler(scale=64.0, window=4, hysteresis=2, min_scale=8.0)
    for _ in range(4):
        scaler.update(overflow=False)
    assert scaler.scale == 64.0  # not after window clean steps ...
    scaler.update(overflow=False)
    assert scaler.scale == 128.0  # ... but after window + 1
    for _ in range(3):
        scaler.update(overflow=False)
    assert scaler.scale == 128.0
    scaler.update(overflow=False)
    assert scaler.scale == 256.0  # then every window
    scaler.update(overflow=True)
    assert (scaler.scale, scaler.overflows_left) == (256.0, 1)  # the first overflow spends the hysteresis
    scaler.update(overflow=True)
    assert (scaler.scale, scaler.overflows_left) == (128.0, 1)  # the second halves; the hysteresis stays spent
    scaler.update(overflow=False)
    scaler.update(overflow=True)
    assert scaler.scale == 64.0  # so the next overflow halves at once, clean steps in between or not
    scaler.update(overflow=True)
    scaler.update(overflow=True)
    assert scaler.scale == 16.0 and scaler.skipped_steps == 5
    scaler.update(overflow=True)
    assert scaler.scale == 8.0  # the floor
    with pytest.raises(LossScaleError, match=r"minimum, 8 \(min_loss_scale=8\).*bf16"):
        scaler.update(overflow=True)


def test_a_start_below_the_floor_is_refused():
    # DeepSpeed would jump up to the floor at the first overflow; here it is a mistake in the config
    with pytest.raises(ValueError, match=r"scale=128.0 is below min_scale=1024.0.*initial_scale_power"):
        LossScaler(scale=128.0, min_scale=1024.0)
    LossScaler(scale=128.0, min_scale=1024.0, dynamic=False)  # a static scale has no floor


def test_static_scale_never_moves_but_counts_skips():
    scaler = LossScaler(scale=128.0, dynamic=False, window=1)
    for overflow in (True, False, False, True, True):
        scaler.update(overflow)
    assert (scaler.scale, scaler.skipped_steps) == (128.0, 3)


def test_state_dict_round_trip_and_earlier_versions_state():
    scaler = LossScaler(scale=2.0**10, window=4, hysteresis=2)
    for overflow in (False, True, False, False):
        scaler.update(overflow)
    resumed = LossScaler()
    resumed.load_state_dict(scaler.state_dict())
    assert resumed == scaler
    # an earlier version's state (same fields; it refilled the hysteresis on halving) loads and goes on
    old = {"scale": 512.0, "dynamic": True, "window": 4, "hysteresis": 2, "min_scale": 1.0, "skipped_steps": 3,
           "good_steps": 2, "overflows_left": 2}
    resumed = LossScaler()
    resumed.load_state_dict(old)
    for _ in range(3):
        resumed.update(overflow=False)
    assert (resumed.scale, resumed.good_steps) == (1024.0, 5)  # 5 clean steps: window + 1
    with pytest.raises(ValueError, match=r"keys \['cur_scale'\] that LossScaler does not have"):
        LossScaler().load_state_dict({"cur_scale": 2.0})


def test_scale_loss_is_fp32():
    loss = torch.tensor(3.0, dtype=torch.float16)
    scaled = LossScaler(scale=2.0**16).scale_loss(loss)
    assert scaled.dtype == torch.float32 and scaled.item() == 3.0 * 2**16  # past fp16's range, still finite
