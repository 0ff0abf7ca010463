"""DeepSpeed's learning-rate schedules as torch LR schedulers, stepped once per optimizer step.

A DeepSpeed config's ``"scheduler": {"type": "WarmupLR", "params": {...}}`` names one of these
classes; the parameter names, their defaults and the learning rate at every step are DeepSpeed's
(v0.19), so a config means the same schedule here. They are ordinary ``LRScheduler`` subclasses:
Lightning steps them (``"interval": "step"``), checkpoints their ``state_dict()`` and its LR monitor
reads ``get_last_lr()``.

[Note: DeepSpeed's iteration count]
DeepSpeed's schedules are functions of ``last_batch_iteration``, which is -1 when the scheduler is
built and goes up by one at every ``step()``, called after each optimizer step. A torch scheduler
counts ``last_epoch`` from 0 after construction instead (its constructor takes one step). So the
learning rate here at ``last_epoch = e`` is DeepSpeed's at iteration ``e - 1``: the first optimizer
step runs with DeepSpeed's iteration -1 value (the warm-up's start), the second with iteration 0's,
and so on, exactly as under ``deepspeed.initialize``.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import math
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["LRRangeTest", "OneCycle", "SCHEDULERS", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR",
           "scheduler_from_config"]

log = logging.getLogger(__name__)

PerGroup = Union[float, Sequence[float]]
WARMUP_TYPES = ("log", "linear")
ONE_CYCLE_BETA2 = 0.99  # DeepSpeed's OneCycle writes (momentum, 0.99) into Adam's betas


def _per_group(optimizer: Optimizer, value: PerGroup, name: str) -> list[float]:
    """One value per param group: a scalar for all of them, or a list with one entry each."""
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"{name}={list(value)!r} has {len(value)} values but the optimizer has {groups} param "
                             f"groups; give one number for all groups or one per group.")
        return [float(v) for v in value]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number (or a list with one per param group).")
    return [float(value)] * groups


def _positive_int(value: object, name: str) -> int:
    if type(value) is not int or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer (a number of optimizer steps).")
    return value


def _warmup_type(value: str) -> str:
    # DeepSpeed falls back to "log" with a warning for any other name; a typo here is an error instead
    if value not in WARMUP_TYPES:
        raise ValueError(f"warmup_type={value!r} is not one of {WARMUP_TYPES}: 'log' rises like log(step), "
                         "'linear' in equal increments.")
    return value


def _warmup_fraction(iteration: int, warmup_steps: int, warmup_type: str) -> float:
    """How far warm-up has come at ``iteration`` (0 at iteration 0, 1 at ``warmup_steps``)."""
    if warmup_type == "log":
        return (1.0 / math.log(warmup_steps)) * math.log(iteration + 1)
    return iteration / warmup_steps


class _DeepSpeedSchedule(LRScheduler):
    """Learning rates as a function of DeepSpeed's iteration count (see [Note: DeepSpeed's iteration count])."""

    def get_lr(self) -> list[float]:
        return self.lrs_at(self.last_epoch - 1)

    def _get_closed_form_lr(self) -> list[float]:  # what step(epoch) uses
        return self.lrs_at(self.last_epoch - 1)

    def lrs_at(self, iteration: int) -> list[float]:
        """The learning rate of each param group at DeepSpeed's ``last_batch_iteration``."""
        raise NotImplementedError


class WarmupLR(_DeepSpeedSchedule):
    """From ``warmup_min_lr`` up to ``warmup_max_lr`` over ``warmup_num_steps`` steps, then constant.

    ``warmup_max_lr`` defaults to each group's learning rate at construction (DeepSpeed 0.19).
    ``warmup_type``: "log" (DeepSpeed's default) or "linear". Fewer than 2 warm-up steps count as 2.
    """

    def __init__(self, optimizer: Optimizer, warmup_min_lr: PerGroup = 0.0, warmup_max_lr: Optional[PerGroup] = None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_epoch: int = -1) -> None:
        if warmup_max_lr is None:
            warmup_max_lr = [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, _positive_int(warmup_num_steps, "warmup_num_steps"))  # log(1) would be 0
        self.warmup_type = _warmup_type(warmup_type)
        super().__init__(optimizer, last_epoch)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [low + (high - low) * gamma for low, high in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR's warm-up, then a linear decay to 0 at ``total_num_steps``.

    Unlike WarmupLR, ``warmup_max_lr`` defaults to 0.001 here (DeepSpeed's default for this class).
    """

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_lr: PerGroup = 0.0,
                 warmup_max_lr: PerGroup = 0.001, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_epoch: int = -1) -> None:
        self.total_num_steps = _positive_int(total_num_steps, "total_num_steps")
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_epoch)
        if self.total_num_steps < self.warmup_num_steps:
            log.warning("WarmupDecayLR: total_num_steps=%d is less than warmup_num_steps=%d, so the learning rate "
                        "drops to 0 right after warm-up", self.total_num_steps, self.warmup_num_steps)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        remaining = float(self.total_num_steps - iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_DeepSpeedSchedule):
    """Each group's learning rate at construction times a ratio that warms up from ``warmup_min_ratio``
    to 1 over ``warmup_num_steps`` steps, then follows a cosine down to ``cos_min_ratio`` at
    ``total_num_steps`` and stays there. The very first optimizer step runs at lr 0, as in DeepSpeed.
    """

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_epoch: int = -1) -> None:
        self.total_num_steps = _positive_int(total_num_steps, "total_num_steps")
        self.warmup_num_steps = max(2, _positive_int(warmup_num_steps, "warmup_num_steps"))
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = _warmup_type(warmup_type)
        if self.total_num_steps < self.warmup_num_steps:
            log.warning("WarmupCosineLR: total_num_steps=%d is less than warmup_num_steps=%d, so the ratio drops to "
                        "cos_min_ratio right after warm-up", self.total_num_steps, self.warmup_num_steps)
        super().__init__(optimizer, last_epoch)

    def ratio_at(self, iteration: int) -> float:
        """The multiplier of the initial learning rates at DeepSpeed's ``last_batch_iteration``."""
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            rising = _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + rising * (1.0 - self.warmup_min_ratio)
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (iteration - self.warmup_num_steps + 1) / decay_steps)  # stays at the floor after the end
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lrs_at(self, iteration: int) -> list[float]:
        ratio = self.ratio_at(iteration)
        return [base * ratio for base in self.base_lrs]


class OneCycle(_DeepSpeedSchedule):
    """The 1cycle policy: the learning rate rises from ``cycle_min_lr`` to ``cycle_max_lr`` over
    ``cycle_first_step_size`` steps and falls back over ``cycle_second_step_size`` (default: the same),
    optionally in stairs; after the cycle it stays at ``cycle_min_lr``, or decays as
    ``cycle_min_lr / (1 + decay_lr_rate * steps_after / decay_step_size)`` when both are non-zero.

    With ``cycle_momentum`` (the default) and an optimizer with ``betas`` (Adam and its kin), beta1
    moves inversely between ``cycle_max_mom`` and ``cycle_min_mom``, and beta2 is set to 0.99, as
    DeepSpeed's OneCycle does; optimizers without betas keep their momentum untouched.
    """

    def __init__(self, optimizer: Optimizer, cycle_min_lr: PerGroup, cycle_max_lr: PerGroup,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: Optional[int] = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: Optional[int] = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: PerGroup = 0.8, cycle_max_mom: PerGroup = 0.9,
                 decay_mom_rate: float = 0.0, last_epoch: int = -1) -> None:
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if not first > 0 or not second >= 0:
            raise ValueError(f"cycle_first_step_size={cycle_first_step_size!r} must be positive and "
                             f"cycle_second_step_size={cycle_second_step_size!r} non-negative (steps of each half).")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (cycle_first_stair_count if cycle_second_stair_count is None
                                   else cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        no_decay = math.isclose(decay_step_size, 0)
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = no_decay or math.isclose(decay_lr_rate, 0)
        self.decay_mom_rate = decay_mom_rate
        self.skip_mom_decay = no_decay or math.isclose(decay_mom_rate, 0)
        self.cycle_momentum = bool(cycle_momentum) and "betas" in optimizer.defaults
        if cycle_momentum and not self.cycle_momentum:
            log.info("OneCycle: %s has no betas, so its momentum is not cycled (as in DeepSpeed)",
                     type(optimizer).__name__)
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        super().__init__(optimizer, last_epoch)

    def _scale(self, iteration: int) -> float:
        """Where in the cycle ``iteration`` is: 0 at the low end, 1 at the peak."""
        batch = iteration + 1
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:  # hold the value flat within each stair, counted from the integer position in the cycle
            in_cycle = batch % self.total_size
            if in_cycle <= self.first_step_size:
                position = in_cycle * stairs / self.first_step_size
            else:
                position = (self.total_size - in_cycle) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * ((iteration - self.total_size + 1) / self.decay_step_size)
        return [low / factor for low in self.min_lrs]

    def momenta_at(self, iteration: int) -> list[float]:
        """beta1 of each param group at DeepSpeed's ``last_batch_iteration``."""
        if iteration < 0:  # DeepSpeed starts at the low end of the momentum range, not at the formula's value
            return list(self.min_moms)
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [high - (high - low) * scale for low, high in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * ((iteration - self.total_size + 1) / self.decay_step_size)
        return [high * factor for high in self.max_moms]

    def step(self, epoch: Optional[int] = None) -> None:
        super().step(epoch)
        if self.cycle_momentum:
            for group, beta1 in zip(self.optimizer.param_groups, self.momenta_at(self.last_epoch - 1)):
                group["betas"] = (beta1, ONE_CYCLE_BETA2)


class LRRangeTest(_DeepSpeedSchedule):
    """The learning-rate range test: ``lr_range_test_min_lr * (1 + lr_range_test_step_rate * steps /
    lr_range_test_step_size)``, growing continuously or, with ``lr_range_test_staircase``, in stairs."""

    def __init__(self, optimizer: Optimizer, lr_range_test_min_lr: PerGroup = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_epoch: int = -1) -> None:
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = _positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        super().__init__(optimizer, last_epoch)

    def lrs_at(self, iteration: int) -> list[float]:
        interval = (iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [low * (1 + self.step_rate * interval) for low in self.min_lrs]


SCHEDULERS: dict[str, type[LRScheduler]] = {
    cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)
}
"""DeepSpeed's schedule names (the config's ``scheduler.type``) and the classes that implement them."""


def scheduler_from_config(name: str, params: dict[str, Any]) -> tuple[Optional[type], dict[str, Any], list[str]]:
    """A config's ``scheduler`` section as (class, keyword arguments, problems): one of ``SCHEDULERS``
    or, as DeepSpeed allows, any torch scheduler by name (``"StepLR"``), also stepped every optimizer
    step. The problems name unknown names and arguments, missing required ones and HF's "auto"."""
    problems: list[str] = []
    cls = SCHEDULERS.get(name)
    torch_class = getattr(torch.optim.lr_scheduler, name, None) if isinstance(name, str) else None
    if cls is None and inspect.isclass(torch_class) and issubclass(torch_class, LRScheduler):
        cls = torch_class
    if cls is None:
        close = difflib.get_close_matches(str(name), sorted(SCHEDULERS), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"DeepSpeed's are {', '.join(SCHEDULERS)}"
        return None, {}, [f"scheduler.type={name!r}: no such scheduler in DeepSpeed or torch ({hint})"]
    kwargs = dict(params)
    if kwargs.get("last_batch_iteration", -1) != -1:
        problems.append("scheduler.params.last_batch_iteration: resume the schedule from a checkpoint instead")
    kwargs.pop("last_batch_iteration", None)
    signature = inspect.signature(cls).parameters
    accepted = [p for p in signature if p not in ("self", "optimizer", "last_epoch")]
    for key, value in kwargs.items():
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1)
            problems.append(f"scheduler.params.{key}: {name} takes no such argument"
                            + (f" (did you mean {close[0]!r}?)" if close else ""))
        elif isinstance(value, str) and value == "auto":
            problems.append(f"scheduler.params.{key}='auto': 'auto' is filled in by Hugging Face's Trainer; give "
                            "a value")
    problems += [f"scheduler.params.{p}: {name} needs it" for p in accepted
                 if signature[p].default is inspect.Parameter.empty
                 and signature[p].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and p not in kwargs]
    return cls, kwargs, problems
