"""The compared methods as settings of one machinery: a base optimizer, a sync policy, an outer step.

| method      | optimizer                    | what is averaged                                   |
|-------------|------------------------------|----------------------------------------------------|
| ddp         | Adam / ADOPT / SGDM (b1=0.9) | gradients, every step                              |
| qh-ddp      | MT-DAO optimizer             | gradients, every step                              |
| local-adam  | Adam / ADOPT / SGDM          | parameters and all states every K                  |
| diloco      | Adam / ADOPT / SGDM          | parameters every K through a Nesterov outer step   |
| desloc      | Adam / ADOPT / SGDM          | parameters every K, momenta 3K, second moment 6K   |
| mtdao       | MT-DAO optimizer             | parameters and states, unified or half-life        |

This module is the one home of the method and period-rule names (the base optimizers' are
:mod:`mtdao.optim.named`'s); the default hyperparameters of each live in
:mod:`mtdao.sync.optimizer_defaults`, a method's settings in :class:`mtdao.sync.config.SyncConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch.optim import Optimizer

from mtdao.sync import policy as policies
from mtdao.sync.policy import OuterOptimizerConfig, SyncPolicy


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


def build_policy(
    method: str,
    sync_period: int,
    optimizer: Optimizer,
    sync_policy: str | None = None,
    outer: OuterOptimizerConfig | None = None,
    state_sync_period: int | None = None,
) -> SyncPolicy:
    """The sync policy of ``method``: ``sync_policy`` overrides the period rule of local methods,
    ``outer`` configures (or, for a local method, adds) the outer step, ``state_sync_period`` puts
    every optimizer state on that one period."""
    if method not in METHOD_TABLE:
        raise ValueError(f"Unknown method {method!r}; choose from {', '.join(METHODS)}")
    spec = METHOD_TABLE[method]
    if sync_policy is not None and spec.period_rule is None:
        raise ValueError(
            f"{method} does not average optimizer states; a sync policy does not apply"
        )
    if spec.averages_gradients:
        return replace(policies.gradient_averaging(), name=method)
    if spec.outer_step:
        built = SyncPolicy(
            params=policies.SyncRule(policies.check_period(sync_period)),
            outer=outer or OuterOptimizerConfig(),
            name=f"diloco(K={sync_period})",
        )
    else:
        built = _period_rule(sync_policy or spec.period_rule, sync_period, optimizer)
        if outer is not None:  # a local method with an outer step on its parameter averages
            built = replace(built, outer=outer)
    if state_sync_period is not None:
        built = policies.with_state_period(built, state_sync_period)
    return built


def _period_rule(rule: str | None, sync_period: int, optimizer: Optimizer) -> SyncPolicy:
    if rule == "unified":
        return policies.unified(sync_period)
    if rule == "desloc":
        built = policies.desloc(sync_period)
        if "exp_avg_sq" not in policies.state_decays(optimizer):  # SGDM: no second moment
            built = replace(built, states={})
        return built
    if rule == "half-life":
        return policies.half_life_policy(sync_period, policies.state_decays(optimizer))
    raise ValueError(f"Unknown sync policy {rule!r}; choose from {', '.join(SYNC_POLICIES)}")
