"""Hyperparameter schedules: the learning rate and the omega warm-up, as objects the harness
applies to the optimizer before each step.

The multipliers are pure functions of the step (:func:`lr_multiplier`, :func:`ramp`); the objects
hold what they scale (the peak LR, the target omegas) so that nothing is stashed in the
optimizer's param groups, and carry their definition in ``state_dict``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from torch.optim import Optimizer


def lr_multiplier(
    step: int,
    total_steps: int,
    schedule: str,
    warmup_steps: int,
    min_lr_ratio: float,
    decay_fraction: float = 0.2,
) -> float:
    """Multiplier of the peak LR at ``step`` (counted from 0) of ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "wsd":  # warmup-stable-decay: flat, then linear decay over the last fraction
        decay_steps = max(1, round(decay_fraction * total_steps))
        decay_start = total_steps - decay_steps
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start + 1) / decay_steps)
        return 1.0 - (1.0 - min_lr_ratio) * progress
    raise ValueError(f"unknown schedule {schedule!r}")


def ramp(step: int, ramp_steps: int) -> float:
    """Linear ramp from 0 to 1 over ``ramp_steps`` (1 everywhere when ramp_steps is 0)."""
    if ramp_steps <= 0:
        return 1.0
    return min(1.0, (step + 1) / ramp_steps)


class _Definition:
    """``state_dict`` / ``load_state_dict`` of a schedule: its defining fields."""

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, tuple(value) if isinstance(value, list) else value)


@dataclass
class LRSchedule(_Definition):
    """Linear warmup to ``peak_lr``, then cosine, warmup-stable-decay (wsd) or constant."""

    peak_lr: float
    total_steps: int
    kind: str = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2

    def __call__(self, step: int) -> float:
        """The learning rate of 0-based ``step``."""
        return self.peak_lr * self.multiplier(step)

    def multiplier(self, step: int) -> float:
        return lr_multiplier(
            step,
            self.total_steps,
            self.kind,
            self.warmup_steps,
            self.min_lr_ratio,
            self.decay_fraction,
        )

    def apply(self, optimizer: Optimizer, step: int) -> None:
        lr = self(step)
        for group in optimizer.param_groups:
            group["lr"] = lr


@dataclass
class OmegaWarmup(_Definition):
    """The mixing weights ramp linearly from 0 to ``target_omegas`` over ``ramp_steps``."""

    target_omegas: tuple[float, ...]
    ramp_steps: int = 0

    def __call__(self, step: int) -> tuple[float, ...]:
        """The omegas of 0-based ``step``."""
        scale = ramp(step, self.ramp_steps)
        return tuple(w * scale for w in self.target_omegas)

    def apply(self, optimizer: Optimizer, step: int) -> None:
        omegas = self(step)
        for group in optimizer.param_groups:
            group["omegas"] = omegas
