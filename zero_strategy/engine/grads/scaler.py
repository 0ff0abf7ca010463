"""fp16 loss scaling with the knobs DeepSpeed users know, and DeepSpeed's dynamics.

[Note: DeepSpeed's dynamic loss scale]
The scale moves exactly as DeepSpeed 0.19's ``DynamicLossScaler`` (consecutive_hysteresis false, its
default) moves it, so a config means the same run here (tests/test_scaler.py runs both side by side):
- An overflowing step is skipped. ``overflows_left`` (DeepSpeed's ``cur_hysteresis``) counts the
  overflows still tolerated at this scale, this one included: while it is above 1 an overflow only
  takes one off; at 1 (or with ``hysteresis=1``) an overflow halves the scale, never below
  ``min_scale``, and leaves it at 1, so every further overflow halves again until the scale grows.
- An overflow at ``min_scale`` that would halve it raises ``LossScaleError``: the run cannot go on
  (DeepSpeed raises too; skipping forever would train nothing while looking alive).
- ``good_steps`` counts the clean steps since the last overflow (or the start), this one included.
  The scale doubles when ``good_steps - 1`` is a positive multiple of ``window``: after window + 1
  clean steps, then every ``window`` (DeepSpeed measures the interval from the overflow's step, so the
  first clean step counts for nothing). A doubling refills ``overflows_left`` to ``hysteresis``.
Earlier versions refilled the hysteresis at every halving, doubled after ``window`` clean steps and
kept skipping at the minimum; their state dicts (the same fields) load and go on with these rules.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from torch import Tensor


class LossScaleError(RuntimeError):
    """fp16 gradients overflowed with the loss scale already at its minimum: training cannot go on."""


@dataclass
class LossScaler:
    """Multiplies the loss before backward so small fp16 gradients do not flush to zero.

    Dynamic (the default): see [Note: DeepSpeed's dynamic loss scale]. Static (``dynamic=False``):
    the scale never changes, and overflowing steps are still skipped (as in DeepSpeed).
    """

    scale: float = 2.0**16  # DeepSpeed's initial_scale_power = 16
    dynamic: bool = True
    window: int = 1000  # DeepSpeed's loss_scale_window
    hysteresis: int = 2  # DeepSpeed's hysteresis (delayed_shift): overflows tolerated at one scale
    min_scale: float = 1.0  # DeepSpeed's min_loss_scale
    skipped_steps: int = 0
    good_steps: int = 0  # clean steps since the last overflow or the start, the latest included
    overflows_left: int = field(default=-1)  # DeepSpeed's cur_hysteresis; -1: start at hysteresis

    def __post_init__(self) -> None:
        if not self.scale > 0 or self.window < 1 or self.hysteresis < 1 or not self.min_scale > 0:
            raise ValueError(f"loss scaling needs scale > 0, window >= 1, hysteresis >= 1 and min_scale > 0; got "
                             f"scale={self.scale}, window={self.window}, hysteresis={self.hysteresis}, "
                             f"min_scale={self.min_scale}")
        if self.dynamic and self.scale < self.min_scale:
            raise ValueError(f"a dynamic loss scale starting at scale={self.scale} is below "
                             f"min_scale={self.min_scale}; raise fp16.initial_scale_power (the start is 2**power) "
                             "or lower fp16.min_loss_scale.")
        if self.overflows_left < 0:
            self.overflows_left = self.hysteresis

    def scale_loss(self, loss: Tensor) -> Tensor:
        """``loss`` times the scale, in fp32: a loss of 2 times the default scale of 2**16 is already
        past fp16's range."""
        return loss.float() * self.scale

    def update(self, overflow: bool) -> None:
        """Account for one step that did (skipped) or did not overflow; see [Note: DeepSpeed's
        dynamic loss scale]. Raises LossScaleError for an overflow that would halve ``min_scale``."""
        if overflow:
            self.skipped_steps += 1
            self.good_steps = 0
            if not self.dynamic:
                return
            if self.hysteresis > 1 and self.overflows_left > 1:
                self.overflows_left -= 1
                return
            if self.scale <= self.min_scale:
                raise LossScaleError(
                    f"fp16 gradients overflowed (inf or NaN) with the loss scale already at its minimum, "
                    f"{self.scale:g} (min_loss_scale={self.min_scale:g}), after {self.skipped_steps} skipped steps: "
                    "the step cannot be made finite by scaling. Look for NaN or inf in the inputs or the loss, lower "
                    "the learning rate, lower fp16.min_loss_scale, or train in bf16 (fp32's range).")
            self.scale = max(self.scale / 2, self.min_scale)
            return
        self.good_steps += 1
        if self.dynamic and self.good_steps > 1 and (self.good_steps - 1) % self.window == 0:
            self.scale *= 2
            self.overflows_left = self.hysteresis

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        """Load what ``state_dict`` gave (also of an earlier version: see [Note: DeepSpeed's dynamic
        loss scale]); an unknown key is an error, since it means another object's state."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(state) - known)
        if unknown:
            raise ValueError(f"loss scaler state has keys {unknown} that LossScaler does not have (it has "
                             f"{sorted(known)}): it is not a LossScaler's state_dict(). Pass the dict under the "
                             "checkpoint's 'loss_scaler' key.")
        for key, value in state.items():
            setattr(self, key, value)
