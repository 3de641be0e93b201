"""A method's settings as one value, what ``mtdao train``'s method flags and the integrations'
``LocalUpdates`` both say. The learning rate, its schedule, the weight decay and the clipping
norm belong to the training loop."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from mtdao.flags import choice, switch_off
from mtdao.methods.checks import check_method, checked_defaults
from mtdao.methods.optimizers import BASE_OPTIMIZERS
from mtdao.methods.table import METHODS, SYNC_POLICIES
from mtdao.sync.radial import RADIAL_GROUPS

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
    sync_period: int | None = None
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
    outer_step: str | None = field(default=None, metadata={"choices": OUTER_STEPS})
    """local-adam, desloc, mtdao: at each parameter sync take the plain worker average, or
    DiLoCo's Nesterov outer step on it (--outer-lr, --outer-momentum; with momentum 0, a step
    past the average for a learning rate above 1); diloco always takes it."""
    outer_lr: float | None = None
    """Outer learning rate (diloco, or --outer-step nesterov)."""
    outer_momentum: float | None = None
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

    def resolved(self, workers: int = 1) -> SyncConfig:
        """Checked (a ValueError names the first bad field), every default filled in for a run
        of ``workers`` workers (MT-DAO's rounds depend on it: :func:`method_defaults`)."""
        check_method(self)
        return dataclasses.replace(self, **checked_defaults(self, workers))
