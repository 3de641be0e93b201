"""The checks of a method's settings: one-line ValueErrors naming the field (`sync_period`), which
``mtdao train`` spells as its flag (--sync-period, :func:`mtdao.flags.as_flags`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from mtdao.methods.defaults import (
    DEFAULT_SYNC_PERIOD,
    OPTIMIZER_DEFAULTS,
    method_defaults,
    takes_default_rounds,
)
from mtdao.methods.table import METHOD_TABLE, STATE_AVERAGING_METHODS
from mtdao.sync.codecs.compression import SyncCodecs
from mtdao.sync.round_options import (
    check_delay_lands,
    check_delay_value,
    check_fragments,
    refuse_without_rounds,
)


def checked_defaults(config: Any, workers: int) -> dict[str, Any]:
    """:func:`~mtdao.methods.defaults.method_defaults` of a checked ``config`` in a run of
    ``workers`` workers, checked again with the user's settings (a delay within K)."""
    defaults = method_defaults(config, workers)
    try:
        check_method(dataclasses.replace(config, **defaults))
    except ValueError as error:
        if not takes_default_rounds(config, workers):
            raise
        raise ValueError(
            f"{error} (`sync_period` {defaults['sync_period']} is MT-DAO's default with more "
            "than one worker; give `sync_period` for another)"
        ) from None
    return defaults


def check_method(config: Any) -> None:
    """Raise ValueError naming the first bad setting of a :class:`~mtdao.methods.SyncConfig`."""
    for setting in dataclasses.fields(config):
        check_choice(setting, getattr(config, setting.name))
    if config.sync_period is not None:
        positive_int("sync_period", config.sync_period)
    if config.state_sync_period is not None:
        positive_int("state_sync_period", config.state_sync_period)
    if config.state_sync_period is not None and config.method not in STATE_AVERAGING_METHODS:
        raise ValueError(f"`state_sync_period`: {config.method} does not average optimizer states")
    if config.sync_policy is not None and config.method not in STATE_AVERAGING_METHODS:
        raise ValueError(
            f"`sync_policy`: {config.method} does not average optimizer states; "
            "a sync policy does not apply"
        )
    _check_round_options(config)
    _check_optimizer(config)
    if config.outer_lr is not None:
        positive("outer_lr", config.outer_lr)
    for name in ("outer_momentum", "outer_momentum_start", "outer_momentum_final"):
        value = getattr(config, name)  # None: unresolved, the default's
        if value is not None and not 0.0 <= value < 1.0:
            raise ValueError(f"`{name}` must lie in [0, 1), got {value}")
    _check_outer_schedule(config)
    if config.outer_step == "nesterov" and METHOD_TABLE[config.method].averages_gradients:
        raise ValueError(f"`outer_step`: {config.method} averages gradients, not parameters")


def check_choice(setting: dataclasses.Field, value: Any) -> None:
    """Raise ValueError if ``value`` (or, a tuple, one of its values) is not among the
    ``choices`` of the field ``setting`` (None: unset, fine)."""
    choices = setting.metadata.get("choices")
    values = value if isinstance(value, tuple) else (value,)
    for unknown in [v for v in values if choices and v is not None and v not in choices]:
        raise ValueError(
            f"`{setting.name}`: unknown value {unknown!r}; choose from {', '.join(choices)}"
        )


def _check_optimizer(config: Any) -> None:
    """The base optimizer's hyperparameters and their warm-ups."""
    if config.eps is not None:
        non_negative("eps", config.eps)
    if config.beta2 is not None and not 0.0 <= config.beta2 < 1.0:
        raise ValueError(f"`beta2`: {config.beta2} is outside [0, 1)")
    for name in ("beta2", "eps"):
        if (
            getattr(config, name) is not None
            and getattr(OPTIMIZER_DEFAULTS[config.optimizer], name) is None
        ):
            raise ValueError(f"`{name}`: the {config.optimizer} optimizer has none")
    for name in ("omega_warmup", "beta_warmup"):
        value = getattr(config, name)
        if value is not None and not 0.0 <= value <= 1.0:
            raise ValueError(f"`{name}` must lie in [0, 1], got {value}")
    if config.beta_ramp is not None and not (
        math.isfinite(config.beta_ramp) and config.beta_ramp >= 0
    ):
        raise ValueError(f"`beta_ramp` must be a finite number >= 0, got {config.beta_ramp}")


def _check_outer_schedule(config: Any) -> None:
    """The outer momentum's warm-up and decay, and radial-directional averaging."""
    warmup = config.outer_momentum_warmup
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"`outer_momentum_warmup` must be an integer >= 0, got {warmup!r}")
    decay = config.outer_momentum_decay
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"`outer_momentum_decay` must lie in [0, 1], got {decay}")
    has_outer = METHOD_TABLE[config.method].outer_step or config.outer_step == "nesterov"
    for name, value in (("outer_momentum_warmup", warmup), ("outer_momentum_decay", decay)):
        if value and not has_outer:
            raise ValueError(
                f"`{name}`: {config.method} takes no outer step; set `outer_step` to nesterov"
            )
    if config.radial_directional and METHOD_TABLE[config.method].averages_gradients:
        raise ValueError(
            f"`radial_directional`: {config.method} averages gradients, not parameters or states"
        )


def _check_round_options(config: Any) -> None:
    """Delay, fragments and dtypes: the rules of :mod:`mtdao.sync.round_options` (one place, one
    message each), given what the config says of the method and its periods."""
    fragments = check_fragments(config.sync_fragments)
    delay = check_delay_value(config.sync_delay)
    codecs = SyncCodecs.parse(config.sync_dtype or (), config.error_feedback)
    if METHOD_TABLE[config.method].averages_gradients:
        refuse_without_rounds(config.method, delay=delay, fragments=fragments, codecs=codecs)
    sync_period = config.sync_period or DEFAULT_SYNC_PERIOD
    periods = [sync_period, config.state_sync_period]
    shortest = min(p for p in periods if p is not None)
    which = "`sync_period`" if shortest == sync_period else "`state_sync_period`"
    check_delay_lands(delay, shortest, f"{which} {shortest}")


def positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value!r}")


def positive(name: str, value) -> None:
    if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
        raise ValueError(f"`{name}` must be a finite number > 0, got {value!r}")


def non_negative(name: str, value) -> None:
    if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
        raise ValueError(f"`{name}` must be a finite number >= 0, got {value!r}")
