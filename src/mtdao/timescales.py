"""Half-lives of exponential moving averages, the unit the whole method reasons in.

An EMA with decay beta keeps beta**k of a value's weight after k steps, so its half-life is
ln 0.5 / ln beta steps. Adam's beta1 = 0.9 forgets half of the global direction in 6.6 steps;
beta = 0.999 keeps it for 693.
"""

from __future__ import annotations

import math


def half_life(beta: float) -> float:
    """Steps after which an EMA with decay ``beta`` keeps half the weight of a value."""
    beta = float(beta)
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"half_life needs a decay in [0, 1), got beta={beta}")
    if beta == 0.0:
        return 0.0
    return math.log(0.5) / math.log(beta)


def beta_for_half_life(steps: float) -> float:
    """The EMA decay whose half-life is ``steps`` (the inverse of :func:`half_life`)."""
    steps = float(steps)
    if not steps > 0.0 or math.isinf(steps):
        raise ValueError(
            f"beta_for_half_life needs a positive, finite number of steps, got {steps}"
        )
    return 0.5 ** (1.0 / steps)


def weight_left(beta: float, steps: int) -> float:
    """Fraction of a value's weight an EMA with decay ``beta`` still holds after ``steps`` updates."""
    return float(beta) ** int(steps)
