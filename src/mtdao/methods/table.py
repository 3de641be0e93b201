"""The compared methods by name, and what each is made of (``mtdao train --help`` lists them):
the one home of the method and period-rule names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    """What a method is made of."""

    multi_timescale: bool
    """Uses the MT-DAO optimizer (slow momenta mixed with the gradient), not the base one."""
    averages_gradients: bool
    """Averages gradients before every step (DDP); otherwise local steps and periodic syncs."""
    period_rule: str | None
    """Default rule for the optimizer states' periods; None: the states are never averaged."""
    outer_step: bool
    """Turns each parameter average into DiLoCo's Nesterov outer step."""
    summary: str
    """One line for ``mtdao train --help``."""


METHOD_TABLE = {
    "ddp": Method(False, True, None, False, "base optimizer, gradients averaged every step"),
    "qh-ddp": Method(True, True, None, False, "MT-DAO optimizer, gradients averaged every step"),
    "local-adam": Method(
        False, False, "unified", False, "base optimizer, parameters and all states every K"
    ),
    "diloco": Method(
        False, False, None, True, "base optimizer kept local; every K a Nesterov outer step"
    ),
    "desloc": Method(
        False,
        False,
        "desloc",
        False,
        "base optimizer; params every K, momenta 3K, second moment 6K",
    ),
    "mtdao": Method(
        True,
        False,
        "unified",
        False,
        "MT-DAO optimizer; params and states every K, or by half-life",
    ),
}
METHODS = tuple(METHOD_TABLE)
SYNC_POLICIES = ("unified", "half-life", "desloc")
MULTI_TIMESCALE_METHODS = tuple(m for m, spec in METHOD_TABLE.items() if spec.multi_timescale)
GRADIENT_AVERAGING_METHODS = tuple(m for m, spec in METHOD_TABLE.items() if spec.averages_gradients)
STATE_AVERAGING_METHODS = tuple(m for m, spec in METHOD_TABLE.items() if spec.period_rule)
