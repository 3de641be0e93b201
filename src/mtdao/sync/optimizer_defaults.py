"""The defaults that depend on the base optimizer: learning rate, momenta, second moment, epsilon.

One row per base optimizer (:data:`OPTIMIZER_DEFAULTS`); :func:`mtdao.train.config.resolve` fills
a config's unset fields from it, and the config checks refuse a --beta2 or --eps the optimizer
does not have.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimizerDefaults:
    """The defaults that depend on the base optimizer (and on the method family)."""

    lr: float
    """Peak learning rate of every method: each one's own best at 1000 steps (micro model)."""
    betas: tuple[float, ...]
    """First-momentum decays of the baselines (ddp, local-adam, diloco, desloc)."""
    mtdao_betas: tuple[float, ...]
    """Slow momenta of the multi-timescale methods (mtdao, qh-ddp)."""
    mtdao_omegas: tuple[float, ...]
    """Their mixing weights; the raw gradient gets 1 - sum."""
    beta2: float | None
    """Second-moment decay (None: the optimizer keeps no second moment)."""
    eps: float | None
    """Denominator epsilon (None: the optimizer has none)."""
    mtdao_beta_warmup: float = 0.0
    """Beta warm-up fraction of the multi-timescale methods' default momenta."""
    mtdao_beta_ramp: float = 0.0
    """Step-counted beta ramp C of the multi-timescale methods' default momenta."""


# MT-DAO-Adam's default is the paper's slow momentum (0.99, omega 0.9) whose decay follows
# min(0.99, 1 - 9 / t) at step t: its half-life grows with the steps taken (about t / 13, reaching
# 0.99 at step 900) whatever --steps is, so a short run gets the start of a long one's optimizer.
# The former warm-up over 30% of --steps gave short runs a fast ramp and lost to Local Adam at
# 1000 steps; at 3000 steps the two schedules nearly agree (both reach 0.99 near step 900).
# BENCHMARKS.md, the defaults card, has the measurements.
# Every method's default LR, 8e-3, is its own best at 1000 steps of the micro model.
# MT-DAO-ADOPT keeps the paper's code defaults (0.999, 0.9), not measured with the ramp here.
OPTIMIZER_DEFAULTS = {
    "adam": OptimizerDefaults(
        8e-3, (0.9,), (0.99,), (0.9,), beta2=0.95, eps=1e-8, mtdao_beta_ramp=9.0
    ),
    "adopt": OptimizerDefaults(4e-3, (0.9,), (0.999,), (0.9,), beta2=0.9999, eps=1e-6),
    "sgdm": OptimizerDefaults(0.3, (0.9,), (0.99,), (0.9,), beta2=None, eps=None),
}


def default_lr(method: str, optimizer: str) -> float:
    """The peak learning rate ``method`` runs with when --lr is not given: one per base optimizer
    today, since the sweeps found every method's best at the same value."""
    return OPTIMIZER_DEFAULTS[optimizer].lr
