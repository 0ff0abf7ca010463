"""fp16 loss scaling with the knobs DeepSpeed users know."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class LossScaler:
    """Multiplies the loss before backward so small fp16 gradients do not flush to zero.

    Dynamic (the default): every ``window`` steps without overflow the scale doubles; an overflow
    (a non-finite gradient on any rank) skips the step and, once ``hysteresis`` overflows have
    been seen since the last change, halves the scale, never below ``min_scale``. Static
    (``dynamic=False``): the scale never changes, and overflowing steps are still skipped.
    """

    scale: float = 2.0**16  # DeepSpeed's initial_scale_power = 16
    dynamic: bool = True
    window: int = 1000  # DeepSpeed's loss_scale_window
    hysteresis: int = 2  # overflows tolerated before the scale drops
    min_scale: float = 1.0
    skipped_steps: int = 0
    good_steps: int = 0  # since the last overflow or growth
    overflows_left: int = field(default=-1)  # until the scale halves; -1: start at hysteresis

    def __post_init__(self) -> None:
        if not self.scale > 0 or self.window < 1 or self.hysteresis < 1 or not self.min_scale > 0:
            raise ValueError(f"loss scaling needs scale > 0, window >= 1, hysteresis >= 1 and min_scale > 0; got "
                             f"scale={self.scale}, window={self.window}, hysteresis={self.hysteresis}, "
                             f"min_scale={self.min_scale}")
        if self.overflows_left < 0:
            self.overflows_left = self.hysteresis

    def update(self, overflow: bool) -> None:
        """Account for one step that did (skipped) or did not overflow."""
        if overflow:
            self.skipped_steps += 1
            self.good_steps = 0
            if not self.dynamic:
                return
            self.overflows_left -= 1
            if self.overflows_left <= 0:
                self.scale = max(self.scale / 2, self.min_scale)
                self.overflows_left = self.hysteresis
            return
        self.good_steps += 1
        if self.dynamic and self.good_steps % self.window == 0:
            self.scale *= 2
            self.overflows_left = self.hysteresis

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
