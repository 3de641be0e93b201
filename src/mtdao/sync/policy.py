"""Sync policies as data: which tensors are averaged across workers, and how often.

A policy names a rule for the parameters and one per optimizer state key (``exp_avg_0``,
``exp_avg_sq``, torch's ``exp_avg``, ...). The engine carries it out; nothing here talks to a
network or knows a model. The rules and why they are what they are: docs/design.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from torch.optim import Optimizer

from mtdao.timescales import half_life

# State entries that are counters, never tensors to average.
NON_AVERAGED_STATE_KEYS = frozenset({"step"})


@dataclass(frozen=True)
class OuterOptimizerConfig:
    """DiLoCo's outer step: SGD with Nesterov momentum on the averaged pseudo-gradient.

    The momentum may follow a schedule over the outer steps (:meth:`momentum_at`): a warm-up
    from ``momentum_start`` over the first ``momentum_warmup`` parameter syncs, and a linear
    decay to ``momentum_final`` between the steps ``momentum_decay_from`` and
    ``momentum_decay_to``. Both are off by default: the momentum is ``momentum`` throughout.
    """

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    momentum_warmup: int = 0
    """W: the momentum is ``momentum_start`` at the first sync and rises linearly to
    ``momentum`` at sync W + 1 (0: no warm-up)."""
    momentum_start: float = 0.0
    momentum_decay_from: int | None = None
    """The step after which the momentum falls linearly, reaching ``momentum_final`` at step
    ``momentum_decay_to`` (None: no decay)."""
    momentum_decay_to: int | None = None
    momentum_final: float = 0.0

    def __post_init__(self) -> None:
        if not self.lr > 0.0:
            raise ValueError(f"Invalid outer lr: {self.lr} (must be > 0)")
        for name in ("momentum", "momentum_start", "momentum_final"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"Invalid outer {name}: {value} (must lie in [0, 1))")
        warmup = self.momentum_warmup
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"Invalid outer momentum_warmup: {warmup!r} (must be an integer >= 0)")
        decay = (self.momentum_decay_from, self.momentum_decay_to)
        if (decay[0] is None) != (decay[1] is None) or (
            decay[0] is not None and not 0 <= decay[0] < decay[1]
        ):
            raise ValueError(
                f"Invalid outer momentum decay steps {decay} (both None, or 0 <= from < to)"
            )

    def momentum_at(self, step: int, sync_period: int) -> float:
        """The momentum of the outer step taken at ``step`` (a parameter sync every
        ``sync_period`` steps: that step's sync is the ``ceil(step / sync_period)``-th)."""
        momentum = self.momentum
        sync = -(-step // sync_period)
        if self.momentum_warmup and sync <= self.momentum_warmup:  # sync W + 1 reaches it
            start = self.momentum_start
            momentum = start + (self.momentum - start) * (sync - 1) / self.momentum_warmup
        begin, end = self.momentum_decay_from, self.momentum_decay_to
        if begin is not None and step > begin:
            fraction = min(1.0, (step - begin) / (end - begin))
            momentum = momentum + (self.momentum_final - momentum) * fraction
        return momentum


@dataclass(frozen=True)
class SyncRule:
    """How one tensor kind is synchronized: averaged every ``period`` steps, or never (None)."""

    period: int | None

    def __post_init__(self) -> None:
        period = self.period
        if period is not None and (
            isinstance(period, bool) or not isinstance(period, int) or period < 1
        ):
            raise ValueError(f"Invalid sync period: {self.period!r} (must be an integer >= 1)")

    def is_due(self, step: int) -> bool:
        return self.period is not None and step % self.period == 0


KEEP_LOCAL = SyncRule(period=None)


@dataclass(frozen=True)
class SyncPolicy:
    """Periods for the parameters and each optimizer state key.

    ``states`` maps a state key to its rule; keys it does not name follow ``other_states``.
    ``average_gradients`` averages gradients before every optimizer step (DDP). ``outer`` turns
    the parameter average into DiLoCo's outer optimizer step.
    """

    params: SyncRule
    states: Mapping[str, SyncRule] = field(default_factory=dict)
    other_states: SyncRule = KEEP_LOCAL
    average_gradients: bool = False
    outer: OuterOptimizerConfig | None = None
    name: str = "custom"

    def __post_init__(self) -> None:
        for key in self.states:
            if key in NON_AVERAGED_STATE_KEYS:
                raise ValueError(f"State {key!r} is a counter and cannot be given a sync period")
        if self.outer is not None and self.params.period is None:
            raise ValueError("An outer optimizer needs a parameter sync period")

    def state_rule(self, key: str) -> SyncRule:
        return self.states.get(key, self.other_states)

    def periods(self) -> dict[str, int | None]:
        """Human-readable summary: every named period (``params`` and state keys)."""
        summary = {"params": self.params.period}
        summary.update({key: rule.period for key, rule in self.states.items()})
        summary["other states"] = self.other_states.period
        return summary

    def check_state_keys(self, available: set[str]) -> None:
        """Refuse a policy that names a state the optimizer does not keep."""
        unknown = sorted(set(self.states) - available)
        if unknown:
            raise ValueError(
                f"Sync policy {self.name!r} names unknown optimizer state(s) {unknown}; "
                f"this optimizer keeps {sorted(available - NON_AVERAGED_STATE_KEYS)}"
            )


# -- built-in policies ------------------------------------------------------------------------


def check_period(sync_period: int) -> int:
    if isinstance(sync_period, bool) or not isinstance(sync_period, int) or sync_period < 1:
        raise ValueError(f"Invalid sync period: {sync_period!r} (must be an integer >= 1)")
    return sync_period


def unified(sync_period: int, outer: OuterOptimizerConfig | None = None) -> SyncPolicy:
    """Parameters and every state averaged every K steps (Local Adam, the paper's main setting)."""
    rule = SyncRule(check_period(sync_period))
    return SyncPolicy(params=rule, other_states=rule, outer=outer, name=f"unified(K={sync_period})")


def desloc(sync_period: int, outer: OuterOptimizerConfig | None = None) -> SyncPolicy:
    """DES-LOC's recommendation: first momenta every 3K steps, second moment every 6K."""
    k = check_period(sync_period)
    return SyncPolicy(
        params=SyncRule(k),
        states={"exp_avg_sq": SyncRule(6 * k)},
        other_states=SyncRule(3 * k),
        outer=outer,
        name=f"desloc(K={k})",
    )


def half_life_period(sync_period: int, beta: float, max_multiple: int = 16) -> int:
    """K_s = K * clamp(round(half_life(beta) / K), 1, max_multiple): slow states sync less often."""
    k = check_period(sync_period)
    if max_multiple < 1:
        raise ValueError(f"Invalid max_multiple: {max_multiple} (must be >= 1)")
    multiple = round(half_life(beta) / k)
    return k * min(max(multiple, 1), max_multiple)


def half_life_policy(
    sync_period: int,
    decays: Mapping[str, float],
    max_multiple: int = 16,
    outer: OuterOptimizerConfig | None = None,
) -> SyncPolicy:
    """Each state's period grows with its half-life, capped at 16 K (see :func:`half_life_period`).

    A state that forgets slowly changes little within a round, so averaging it less often loses
    little and saves its bytes.

    ``decays`` maps state keys to their EMA decay, e.g. from :func:`state_decays`.
    """
    k = check_period(sync_period)
    states = {
        key: SyncRule(half_life_period(k, beta, max_multiple)) for key, beta in decays.items()
    }
    return SyncPolicy(
        params=SyncRule(k),
        states=states,
        other_states=SyncRule(k),
        outer=outer,
        name=f"half-life(K={k})",
    )


def explicit(
    params: int | None,
    states: Mapping[str, int | None] | None = None,
    other_states: int | None = None,
    outer: OuterOptimizerConfig | None = None,
) -> SyncPolicy:
    """Any period per state name; None keeps that state local."""
    return SyncPolicy(
        params=SyncRule(params),
        states={key: SyncRule(period) for key, period in (states or {}).items()},
        other_states=SyncRule(other_states),
        outer=outer,
        name="explicit",
    )


def with_state_period(policy: SyncPolicy, period: int) -> SyncPolicy:
    """``policy`` with every optimizer state averaged every ``period`` steps instead.

    The paper's sync-period ablation holds K_u = K_v = 16 while the parameter period K grows.
    """
    rule = SyncRule(check_period(period))
    return replace(
        policy, states={}, other_states=rule, name=f"{policy.name}, states every {period}"
    )


def keep_local() -> SyncPolicy:
    """No parameter or state averaging (gradient averaging may be added by the caller)."""
    return SyncPolicy(params=KEEP_LOCAL, name="local")


def gradient_averaging() -> SyncPolicy:
    """DDP: gradients averaged every step, so parameters and states never drift apart."""
    return SyncPolicy(params=KEEP_LOCAL, average_gradients=True, name="gradient-averaging")


# -- decays of known optimizers -----------------------------------------------------------------


def state_decays(optimizer: Optimizer) -> dict[str, float]:
    """EMA decay of each state key of ``optimizer`` (first param group), for half-life periods.

    Knows the MT-DAO optimizers (``betas`` + ``beta2``) and torch's Adam family (``betas``).
    """
    group: dict[str, Any] = optimizer.param_groups[0]
    betas = tuple(group.get("betas", ()))
    if "omegas" in group:  # MT-DAO optimizers: exp_avg_j decays with betas[j]
        decays = {f"exp_avg_{j}": beta for j, beta in enumerate(betas)}
        if "beta2" in group:
            decays["exp_avg_sq"] = group["beta2"]
        return decays
    if len(betas) == 2:  # torch.optim.Adam / AdamW / NAdam / RAdam
        return {"exp_avg": betas[0], "exp_avg_sq": betas[1]}
    if "momentum" in group and group["momentum"] > 0:
        return {"momentum_buffer": group["momentum"]}
    raise ValueError(
        f"Cannot tell the state decays of {type(optimizer).__name__}; pass them explicitly"
    )


def communication_per_step(policy: SyncPolicy, state_keys: list[str]) -> float:
    """Model-sized transfers per step relative to DDP (1.0), counting each state as one model.

    That is 1/K_x + sum_j 1/K_j + 1/K_v: exact in bytes when every state has the parameter dtype.
    """
    if policy.average_gradients:
        return 1.0
    total = 0.0 if policy.params.period is None else 1.0 / policy.params.period
    for key in state_keys:
        period = policy.state_rule(key).period
        if key not in NON_AVERAGED_STATE_KEYS and period is not None:
            total += 1.0 / period
    return total


def full_cycle(policy: SyncPolicy, state_keys: list[str]) -> int:
    """Steps after which every rule of ``policy`` is due at once again: the least common multiple
    of its periods over the parameters and ``state_keys`` (1 for gradient averaging)."""
    if policy.average_gradients:
        return 1
    periods = [policy.params.period] + [
        policy.state_rule(key).period for key in state_keys if key not in NON_AVERAGED_STATE_KEYS
    ]
    return math.lcm(*[period for period in periods if period is not None] or [1])
