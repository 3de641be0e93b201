"""A method's settings, as one value: what ``mtdao train``'s method flags and the Hugging Face
integration's ``LocalUpdates`` both say, and the builders that turn it into an optimizer, an
engine and warm-ups.

:class:`SyncConfig` holds the method, its base optimizer, its periods, its round options and the
hyperparameters that depend on the method; the learning rate, its schedule, the weight decay and
the gradient-clipping norm belong to the training loop. The harness's config holds one as its
``sync`` section, each field the ``mtdao train`` flag of its name.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.optim import Optimizer

from mtdao.flags import choice, switch_off
from mtdao.optim.base import check_momenta
from mtdao.optim.named import BASE_OPTIMIZERS
from mtdao.optim.warmups import BetaWarmup, OmegaWarmup
from mtdao.sync.codecs.compression import SyncCodecs
from mtdao.sync.communicator import Communicator
from mtdao.sync.engine import LocalUpdateSync
from mtdao.sync.methods import (
    METHOD_TABLE,
    METHODS,
    STATE_AVERAGING_METHODS,
    SYNC_POLICIES,
    build_policy,
)
from mtdao.sync.optimizer_defaults import OPTIMIZER_DEFAULTS
from mtdao.sync.policy import OuterOptimizerConfig
from mtdao.sync.radial import RADIAL_GROUPS
from mtdao.sync.round_options import (
    check_delay_lands,
    check_delay_value,
    check_fragments,
    refuse_without_rounds,
)

NON_FINITE_ACTIONS = ("raise", "skip")
OUTER_STEPS = ("average", "nesterov")


@dataclass(frozen=True)
class SyncConfig:
    """The method and its options.

    ``None`` fields take the method's default (:meth:`resolved`). Each field is the ``mtdao
    train`` flag of its name, and its docstring that flag's help.
    """

    method: str = choice("mtdao", METHODS)
    """Training method (see the method table below)."""
    optimizer: str = choice("adam", BASE_OPTIMIZERS)
    """Base optimizer."""
    sync_period: int = 32
    """K: local steps between parameter averages (local methods)."""
    sync_policy: str | None = field(default=None, metadata={"choices": SYNC_POLICIES})
    """Period rule for the optimizer states of local methods."""
    state_sync_period: int | None = None
    """Average every optimizer state every N steps, whatever the period rule."""
    sync_delay: int = 0
    """D: apply each sync round D steps after it starts, its collectives running meanwhile and
    the local progress merged in (0: blocking rounds)."""
    sync_fragments: int = 1
    """P: split the layers and their states into P fragments synced at staggered steps."""
    sync_dtype: tuple[str, ...] | None = None
    """What crosses the link: one dtype for every kind, or KIND=DTYPE per kind (params, momenta,
    second-moment); dtypes fp32, bf16, fp8, int8, int4, int2, top<k> (k of every 256 values kept,
    e.g. top8; not for the second moment); parameters go as pseudo-gradients."""
    error_feedback: bool = False
    """Carry each worker's quantization error of the parameters into its next round."""
    final_round: bool = switch_off(
        "--no-final-round",
        "Do not average at the end: each worker keeps its own model.",
        resumable=True,
    )
    """When training ends, land the rounds in flight and average whatever is still apart, so
    every worker (or replica) holds the same global model (nothing is sent when the last step
    synced everything)."""
    betas: tuple[float, ...] | None = None
    """First-momentum decays, e.g. --betas 0.9 0.99."""
    omegas: tuple[float, ...] | None = None
    """Mixing weights of the momenta; the raw gradient gets 1 - sum."""
    beta2: float | None = None
    """Second-moment decay."""
    eps: float | None = None
    """Denominator epsilon."""
    omega_warmup: float = 0.0
    """Fraction of the run over which the omegas ramp linearly from 0 to their value."""
    beta_warmup: float | None = None
    """Fraction of the run over which each momentum decay above 0.9 rises from 0.9 to its value,
    its half-life growing linearly (AdEMAMix's schedule for its slow momentum)."""
    beta_ramp: float | None = None
    """C: each momentum decay above 0.9 is at most 1 - C / t at step t, so its half-life (about
    0.69 t / C) grows with the steps taken, not with --steps (0: off)."""
    outer_step: str = choice("average", OUTER_STEPS)
    """local-adam, desloc, mtdao: at each parameter sync take the plain worker average, or
    DiLoCo's Nesterov outer step on it (--outer-lr, --outer-momentum); diloco always takes it."""
    outer_lr: float = 0.7
    """Outer learning rate (diloco, or --outer-step nesterov)."""
    outer_momentum: float = 0.9
    """Outer Nesterov momentum (diloco, or --outer-step nesterov)."""
    outer_momentum_warmup: int = 0
    """W: the outer momentum rises linearly from --outer-momentum-start at the first parameter
    sync to --outer-momentum at sync W + 1 (0: off)."""
    outer_momentum_start: float = 0.0
    """The outer momentum at the first sync, with --outer-momentum-warmup."""
    outer_momentum_decay: float = 0.0
    """Fraction of the run, at its end, over which the outer momentum falls linearly to
    --outer-momentum-final (0: off)."""
    outer_momentum_final: float = 0.0
    """The outer momentum at the last step, with --outer-momentum-decay."""
    radial_directional: tuple[str, ...] = field(default=(), metadata={"choices": RADIAL_GROUPS})
    """Average each tensor's update of these kinds (params, momenta) as the workers' mean norm
    along their mean unit direction, not as a plain mean; one more scalar per tensor on the
    link (docs/design.md)."""
    on_non_finite: str = choice("raise", NON_FINITE_ACTIONS)
    """NaN/inf in a worker at a sync: stop (raise), or leave that worker out and heal it with the
    others' average of everything it holds (skip; evaluation and checkpoints meanwhile leave it
    out or heal it first). Large finite values are averaged like any other (docs/design.md)."""
    track_alignment: bool = switch_off(
        "--no-alignment", "Do not log the worker/global pseudo-gradient cosine and drift at syncs."
    )
    """Log worker/global pseudo-gradient cosine and drift at each parameter sync."""

    def resolved(self) -> SyncConfig:
        """Checked (a ValueError names the first bad field), every default filled in."""
        check_method(self)
        return dataclasses.replace(self, **method_defaults(self))


def check_method(config: SyncConfig) -> None:
    """Raise ValueError naming the first bad method setting of ``config`` (flags spelled as
    ``mtdao train`` spells them)."""
    for setting in dataclasses.fields(SyncConfig):
        check_choice(setting, getattr(config, setting.name))
    positive_int("sync_period", config.sync_period)
    if config.state_sync_period is not None:
        positive_int("state_sync_period", config.state_sync_period)
    if config.state_sync_period is not None and config.method not in STATE_AVERAGING_METHODS:
        raise ValueError(f"--state-sync-period: {config.method} does not average optimizer states")
    if config.sync_policy is not None and config.method not in STATE_AVERAGING_METHODS:
        raise ValueError(
            f"--sync-policy: {config.method} does not average optimizer states; "
            "a sync policy does not apply"
        )
    _check_round_options(config)
    if config.eps is not None:
        non_negative("eps", config.eps)
    if config.beta2 is not None and not 0.0 <= config.beta2 < 1.0:
        raise ValueError(f"--beta2: {config.beta2} is outside [0, 1)")
    for name in ("beta2", "eps"):
        if (
            getattr(config, name) is not None
            and getattr(OPTIMIZER_DEFAULTS[config.optimizer], name) is None
        ):
            raise ValueError(f"--{name}: {config.optimizer} has no {name}")
    positive("outer_lr", config.outer_lr)
    for name in ("outer_momentum", "outer_momentum_start", "outer_momentum_final"):
        if not 0.0 <= getattr(config, name) < 1.0:
            raise ValueError(f"--{flag(name)} must lie in [0, 1), got {getattr(config, name)}")
    _check_outer_schedule(config)
    if config.outer_step == "nesterov" and METHOD_TABLE[config.method].averages_gradients:
        raise ValueError(f"--outer-step: {config.method} averages gradients, not parameters")
    for name in ("omega_warmup", "beta_warmup"):
        value = getattr(config, name)
        if value is not None and not 0.0 <= value <= 1.0:
            raise ValueError(f"--{flag(name)} must lie in [0, 1], got {value}")
    if config.beta_ramp is not None and not (
        math.isfinite(config.beta_ramp) and config.beta_ramp >= 0
    ):
        raise ValueError(f"--beta-ramp must be a finite number >= 0, got {config.beta_ramp}")


def check_choice(setting: dataclasses.Field, value: Any) -> None:
    """Raise ValueError if ``value`` (or, a tuple, one of its values) is not among the
    ``choices`` of the field ``setting`` (None: unset, fine)."""
    choices = setting.metadata.get("choices")
    values = value if isinstance(value, tuple) else (value,)
    for unknown in [v for v in values if choices and v is not None and v not in choices]:
        raise ValueError(
            f"--{flag(setting.name)}: unknown value {unknown!r}; choose from {', '.join(choices)}"
        )


def _check_outer_schedule(config: SyncConfig) -> None:
    """The outer momentum's warm-up and decay, and radial-directional averaging."""
    warmup = config.outer_momentum_warmup
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"--outer-momentum-warmup must be an integer >= 0, got {warmup!r}")
    decay = config.outer_momentum_decay
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"--outer-momentum-decay must lie in [0, 1], got {decay}")
    has_outer = METHOD_TABLE[config.method].outer_step or config.outer_step == "nesterov"
    for name, value in (("outer_momentum_warmup", warmup), ("outer_momentum_decay", decay)):
        if value and not has_outer:
            raise ValueError(
                f"--{flag(name)}: {config.method} takes no outer step; add --outer-step nesterov"
            )
    radial = config.radial_directional
    if radial and METHOD_TABLE[config.method].averages_gradients:
        raise ValueError(
            f"--radial-directional: {config.method} averages gradients, not parameters or states"
        )


def _check_round_options(config: SyncConfig) -> None:
    """Delay, fragments and dtypes: the rules of :mod:`mtdao.sync.round_options` (one place, one
    message each), given what the config says of the method and its periods."""
    fragments = check_fragments(config.sync_fragments)
    delay = check_delay_value(config.sync_delay)
    codecs = SyncCodecs.parse(config.sync_dtype or (), config.error_feedback)
    if METHOD_TABLE[config.method].averages_gradients:
        refuse_without_rounds(config.method, delay=delay, fragments=fragments, codecs=codecs)
    periods = [config.sync_period, config.state_sync_period]
    shortest = min(p for p in periods if p is not None)
    which = "--sync-period" if shortest == config.sync_period else "--state-sync-period"
    check_delay_lands(delay, shortest, f"{which} {shortest}")


def method_defaults(config: SyncConfig) -> dict[str, Any]:
    """The method's defaults for the fields ``config`` leaves unset, and the canonical spelling
    of its dtypes: the fields to replace in a checked config."""
    table = OPTIMIZER_DEFAULTS[config.optimizer]
    method = METHOD_TABLE[config.method]
    betas = config.betas
    if betas is None:
        betas = table.mtdao_betas if method.multi_timescale else table.betas
    omegas = config.omegas
    if omegas is None and method.multi_timescale and config.betas is None:
        omegas = table.mtdao_omegas
    elif omegas is None:  # the user's own momenta share 0.9 (multi-timescale) or 1 equally
        share = 0.9 if method.multi_timescale else 1.0
        omegas = (share / len(betas),) * len(betas) if betas else ()
    try:
        betas, omegas = check_momenta(betas, omegas)
    except ValueError as error:
        raise ValueError(f"--betas/--omegas: {error}") from None
    # the default warm-ups belong to the default momenta, not a user's
    default_momenta = method.multi_timescale and config.betas is None
    beta_warmup = config.beta_warmup
    if beta_warmup is None:
        beta_warmup = table.mtdao_beta_warmup if default_momenta else 0.0
    beta_ramp = config.beta_ramp
    if beta_ramp is None:
        beta_ramp = table.mtdao_beta_ramp if default_momenta else 0.0
    return dict(
        betas=betas,
        omegas=omegas,
        beta_warmup=beta_warmup,
        beta_ramp=beta_ramp,
        beta2=config.beta2 if config.beta2 is not None else table.beta2,
        eps=config.eps if config.eps is not None else table.eps,
        sync_policy=config.sync_policy or method.period_rule,
        sync_dtype=SyncCodecs.parse(config.sync_dtype or (), config.error_feedback).spec(),
    )


def build_sync(
    config: SyncConfig,
    optimizer: Optimizer,
    communicator: Communicator,
    clip_gradients: Callable[[], object] | None = None,
    total_steps: int | None = None,
) -> LocalUpdateSync:
    """The engine carrying out a resolved config's method over ``communicator``;
    ``clip_gradients`` runs between gradient averaging and each step (on each worker);
    ``total_steps``: the run's length, which an outer momentum decay needs."""
    policy = build_policy(
        config.method,
        config.sync_period,
        optimizer,
        config.sync_policy,
        outer_step_of(config, total_steps),
        config.state_sync_period,
    )
    sync = LocalUpdateSync(
        optimizer,
        policy,
        communicator,
        on_non_finite=config.on_non_finite,
        track_alignment=config.track_alignment,
        fragments=config.sync_fragments,
        delay=config.sync_delay,
        codecs=SyncCodecs.parse(config.sync_dtype or (), config.error_feedback),
        radial_directional=config.radial_directional,
    )
    if clip_gradients is not None:
        sync.register_gradient_hook(clip_gradients)
    return sync


def outer_step_of(
    config: SyncConfig, total_steps: int | None = None
) -> OuterOptimizerConfig | None:
    """DiLoCo's outer step, or one a local method adds with ``outer_step="nesterov"``, with its
    momentum's warm-up and (over the last part of a run of ``total_steps``) decay."""
    if not (METHOD_TABLE[config.method].outer_step or config.outer_step == "nesterov"):
        return None
    decay_from = decay_to = None
    if config.outer_momentum_decay > 0:
        if total_steps is None:
            raise ValueError("--outer-momentum-decay needs the run's total steps to end at")
        decay_to = total_steps
        decay_from = min(round(total_steps * (1 - config.outer_momentum_decay)), total_steps - 1)
    return OuterOptimizerConfig(
        lr=config.outer_lr,
        momentum=config.outer_momentum,
        momentum_warmup=config.outer_momentum_warmup,
        momentum_start=config.outer_momentum_start,
        momentum_decay_from=decay_from,
        momentum_decay_to=decay_to,
        momentum_final=config.outer_momentum_final,
    )


def warmups_of(config: SyncConfig, total_steps: int) -> tuple[OmegaWarmup, BetaWarmup]:
    """The omega and beta warm-ups of a resolved config over a run of ``total_steps`` steps."""
    return (
        OmegaWarmup(config.omegas, round(config.omega_warmup * total_steps)),
        BetaWarmup(config.betas, round(config.beta_warmup * total_steps), config.beta_ramp),
    )


def flag(name: str) -> str:
    """A field's flag, as ``mtdao train`` spells it (without the dashes)."""
    return name.replace("_", "-")


def positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"--{flag(name)} must be a positive integer, got {value!r}")


def positive(name: str, value) -> None:
    if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
        raise ValueError(f"--{flag(name)} must be a finite number > 0, got {value!r}")


def non_negative(name: str, value) -> None:
    if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
        raise ValueError(f"--{flag(name)} must be a finite number >= 0, got {value!r}")
