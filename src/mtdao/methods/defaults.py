"""The defaults that depend on the method and the base optimizer: one row per base optimizer
(:data:`OPTIMIZER_DEFAULTS`), applied to a method's unset settings by :func:`method_defaults`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtdao.methods.table import METHOD_TABLE
from mtdao.optim.base import check_momenta
from mtdao.sync.codecs.compression import SyncCodecs


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


DEFAULT_SYNC_PERIOD = 32
# MT-DAO-Adam's rounds with more than one worker, unless the user sets any of ROUNDS_FIELDS: the
# parameters every 4 steps as 4-bit pseudo-gradients (error feedback), the states as int8 every 32.
# Half of K = 32's bytes in float32 (20x less than DDP), and lower at every run length and worker
# count measured: within 1% of DDP from 300 steps on at 4 workers, where K = 32 trailed it by 4-9%
# at 300 steps; 2-11% below K = 32 at 16 and 64 workers (BENCHMARKS.md: the defaults card, the
# workers study). With one worker there is nothing to average, and a round would only add its
# quantization error.
DEFAULT_ROUNDS = {
    "sync_period": 4,
    "state_sync_period": 32,
    "sync_dtype": ("params=int4", "momenta=int8", "second-moment=int8"),
    "error_feedback": True,
}
ROUNDS_FIELDS = ("sync_period", "state_sync_period", "sync_dtype", "sync_policy")


# With many workers each one's batch is small and its Adam normalizes a noisy gradient, so its
# steps are smaller than DDP's, while their average is far less noisy than any one of them. From
# 32 workers MT-DAO's default rounds therefore step past the average: an outer SGD step without
# momentum at OUTER_LR_BY_WORKERS[M] (the largest entry at or below M). At a global batch of 64
# sequences (micro, 3000 steps) it is 1.2-3.3% lower at 32 and 64 workers, but 0.7% higher at 16;
# at 128, 1.2% lower at 32 workers (4 sequences each) and 1.5-2.2% at 64 and 128 (BENCHMARKS.md,
# the workers study).
OUTER_LR_BY_WORKERS = {32: 1.5}
OUTER_FIELDS = ("outer_step", "outer_lr", "outer_momentum")
AVERAGE_OUTER_STEP = {"outer_step": "average", "outer_lr": 0.7, "outer_momentum": 0.9}
"""The outer settings when no rule applies: the plain average (DiLoCo's outer step, or one a local
method asks for, at learning rate 0.7 and Nesterov momentum 0.9)."""


def default_outer_step(config: Any, workers: int) -> dict[str, Any]:
    """The outer settings ``config`` leaves unset in a run of ``workers`` workers: a step past the
    average (:data:`OUTER_LR_BY_WORKERS`) where MT-DAO takes its default rounds and the user set
    none of :data:`OUTER_FIELDS`, else :data:`AVERAGE_OUTER_STEP`'s."""
    rule = [lr for fewest, lr in OUTER_LR_BY_WORKERS.items() if workers >= fewest]
    untouched = all(getattr(config, name) is None for name in OUTER_FIELDS)
    if rule and untouched and takes_default_rounds(config, workers):
        return {"outer_step": "nesterov", "outer_lr": rule[-1], "outer_momentum": 0.0}
    return {
        name: default if getattr(config, name) is None else getattr(config, name)
        for name, default in AVERAGE_OUTER_STEP.items()
    }


def takes_default_rounds(config: Any, workers: int) -> bool:
    """Whether ``config`` takes :data:`DEFAULT_ROUNDS` in a run of ``workers`` workers: MT-DAO with
    Adam and more than one worker, its rounds left to the defaults (parameters not sent as norm
    and direction, which refuse error feedback)."""
    return (
        config.method == "mtdao"
        and config.optimizer == "adam"
        and workers > 1
        and all(getattr(config, name) is None for name in ROUNDS_FIELDS)
        and "params" not in config.radial_directional
    )


def default_lr(method: str, optimizer: str) -> float:
    """The peak learning rate ``method`` runs with when none is given: one per base optimizer
    today, since the sweeps found every method's best at the same value."""
    return OPTIMIZER_DEFAULTS[optimizer].lr


def method_defaults(config: Any, workers: int = 1) -> dict[str, Any]:
    """The method's defaults for the fields ``config`` leaves unset in a run of ``workers``
    workers, and the canonical spelling of its dtypes: the fields to replace in a checked
    config."""
    rounds = DEFAULT_ROUNDS if takes_default_rounds(config, workers) else {}
    sync_period = config.sync_period or rounds.get("sync_period", DEFAULT_SYNC_PERIOD)
    state_sync_period = config.state_sync_period or rounds.get("state_sync_period")
    sync_dtype = config.sync_dtype or rounds.get("sync_dtype", ())
    error_feedback = config.error_feedback or rounds.get("error_feedback", False)
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
        raise ValueError(f"`betas`/`omegas`: {error}") from None
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
        sync_period=sync_period,
        state_sync_period=state_sync_period,
        sync_dtype=SyncCodecs.parse(sync_dtype, error_feedback).spec(),
        error_feedback=error_feedback,
        **default_outer_step(config, workers),
    )
