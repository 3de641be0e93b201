"""Learning-rate schedules as pure functions of the step: linear warmup, then cosine, WSD or flat."""

from __future__ import annotations

import math


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
