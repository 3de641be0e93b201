"""Hyperparameter schedules: the learning rate and the warm-ups of the omegas and of the slow
momentum decays, as objects the harness applies to the optimizer before each step.

The multipliers are pure functions of the step (:func:`lr_multiplier`, :func:`ramp`,
:func:`warmed_beta`); the objects hold what they scale (the peak LR, the target omegas and betas)
so that nothing is stashed in the optimizer's param groups, and carry their definition in
``state_dict``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch.optim import Optimizer

if TYPE_CHECKING:
    from mtdao.train.config import TrainConfig


# The LR warm-up when neither --warmup nor --warmup-steps is given: a number of steps, not a
# fraction of --steps, so that every run of up to 3000 steps warms up as a longer one starts
# (on the defaults card 5% of --steps, 15 steps of a 300-step run, cost every method 11-16% of
# its loss, and 50 of a 1000-step run MT-DAO 4-6% and Local Adam 4-8%; docs/history.md, the
# warm-up's change). Longer runs keep 5%.
DEFAULT_WARMUP_STEPS = 150
DEFAULT_WARMUP_FRACTION = 0.05


def warmup_steps_of(config: TrainConfig, steps: int | None = None) -> int:
    """The LR warm-up's length in steps for a run of ``steps`` (default: the config's own):
    --warmup's fraction of them, else --warmup-steps, else the default: DEFAULT_WARMUP_STEPS,
    or DEFAULT_WARMUP_FRACTION of the run when that is longer, at most half the run."""
    steps = config.total_steps() if steps is None else steps
    if config.warmup is not None:
        return round(config.warmup * steps)
    if config.warmup_steps is not None:
        return config.warmup_steps
    default = max(DEFAULT_WARMUP_STEPS, round(DEFAULT_WARMUP_FRACTION * steps))
    return min(default, steps // 2)


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


# A warmed-up momentum decay starts from Adam's usual fast value.
BETA_WARMUP_START = 0.9


def warmed_beta(target: float, progress: float, start: float = BETA_WARMUP_START) -> float:
    """Momentum decay at ``progress`` (0 .. 1) of a warm-up from ``start`` to ``target``.

    As in AdEMAMix, the half-life ln(0.5) / ln(beta) grows linearly from start's to target's, so
    1 / ln(beta) is interpolated linearly. A target no slower than ``start`` is left unchanged,
    and the target itself is returned once the warm-up is over.
    """
    if progress >= 1.0 or target <= start:
        return target
    inverse_log = (1.0 - progress) / math.log(start) + progress / math.log(target)
    return math.exp(1.0 / inverse_log)


def step_capped_beta(
    target: float, steps_taken: int, ramp: float, floor: float = BETA_WARMUP_START
) -> float:
    """``min(target, max(floor, 1 - ramp / t))`` at step ``t`` (counted from 1).

    The half-life of ``1 - ramp / t`` is about ln 2 * t / ramp: a slow momentum never remembers
    more than a fixed fraction of the steps taken, whatever the planned length of the run, so a
    short run and the start of a long one use the same decays. A target no slower than ``floor``
    and ``ramp`` 0 leave ``target`` unchanged.
    """
    if ramp <= 0.0 or target <= floor:
        return target
    return min(target, max(floor, 1.0 - ramp / max(1, steps_taken)))


class _Definition:
    """``state_dict`` / ``load_state_dict`` of a schedule: its defining fields."""

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, tuple(value) if isinstance(value, list) else value)


@dataclass
class LRSchedule(_Definition):
    """Linear warmup to ``peak_lr``, then cosine, warmup-stable-decay (wsd) or constant."""

    peak_lr: float
    total_steps: int
    kind: str = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2

    def __call__(self, step: int) -> float:
        """The learning rate of 0-based ``step``."""
        return self.peak_lr * self.multiplier(step)

    def multiplier(self, step: int) -> float:
        return lr_multiplier(
            step,
            self.total_steps,
            self.kind,
            self.warmup_steps,
            self.min_lr_ratio,
            self.decay_fraction,
        )

    def apply(self, optimizer: Optimizer, step: int) -> None:
        lr = self(step)
        for group in optimizer.param_groups:
            group["lr"] = lr


@dataclass
class OmegaWarmup(_Definition):
    """The mixing weights ramp linearly from 0 to ``target_omegas`` over ``ramp_steps``."""

    target_omegas: tuple[float, ...]
    ramp_steps: int = 0

    def __call__(self, step: int) -> tuple[float, ...]:
        """The omegas of 0-based ``step``."""
        scale = ramp(step, self.ramp_steps)
        return tuple(w * scale for w in self.target_omegas)

    def apply(self, optimizer: Optimizer, step: int) -> None:
        omegas = self(step)
        for group in optimizer.param_groups:
            group["omegas"] = omegas


@dataclass
class BetaWarmup(_Definition):
    """Each momentum decay above 0.9 rises from 0.9 to its target over ``ramp_steps``
    (:func:`warmed_beta`) and, with ``step_ramp`` C, never exceeds 1 - C / t at step t
    (:func:`step_capped_beta`); the optimizer uses the current decay in its averages and its
    bias correction."""

    target_betas: tuple[float, ...]
    ramp_steps: int = 0
    step_ramp: float = 0.0

    def __call__(self, step: int) -> tuple[float, ...]:
        """The betas of 0-based ``step``."""
        progress = ramp(step, self.ramp_steps)
        return tuple(
            min(warmed_beta(beta, progress), step_capped_beta(beta, step + 1, self.step_ramp))
            for beta in self.target_betas
        )

    def apply(self, optimizer: Optimizer, step: int) -> None:
        betas = self(step)
        for group in optimizer.param_groups:
            group["betas"] = betas


def lr_schedule_of(config: TrainConfig) -> LRSchedule:
    """The learning-rate schedule of a resolved config."""
    steps = config.total_steps()
    return LRSchedule(
        config.lr,
        steps,
        config.schedule,
        warmup_steps_of(config),
        config.min_lr_ratio,
        config.decay_fraction,
    )


def omega_warmup_of(config: TrainConfig) -> OmegaWarmup:
    return OmegaWarmup(config.omegas, round(config.omega_warmup * config.total_steps()))


def beta_warmup_of(config: TrainConfig) -> BetaWarmup:
    steps = round(config.beta_warmup * config.total_steps())
    return BetaWarmup(config.betas, steps, config.beta_ramp)


# -- re-planning a run for other --steps (``--resume --extend``) --------------------------------


@dataclass(frozen=True)
class StepsChange:
    """What re-planning a run for other ``--steps`` does, seen from its checkpoint at ``step``.

    The resumed run follows the schedules of the new length from ``step`` on. It is exactly the
    run that had the new length from the start when both plans agree on every step already taken
    (``first_difference`` is None): a wsd schedule resumed in its stable phase, a constant one,
    with warmups of the same number of steps. Otherwise the steps taken followed another plan; if
    the learning rate of the next step changes too, it jumps.
    """

    schedule: str
    step: int
    old_steps: int
    new_steps: int
    lr_planned: float
    """The learning rate of the next step under the run's own plan."""
    lr_new: float
    """The learning rate of the next step under the new plan."""
    first_difference: int | None
    """The first step (counted from 1) taken under a learning rate, omegas or betas the new plan
    would not have used; None when there is none."""

    @property
    def exact(self) -> bool:
        return self.first_difference is None

    def consequence(self) -> str:
        """What the change does, in words, with the numbers."""
        new = self.new_steps
        if self.exact:
            return (
                f"exact here, the {self.schedule} schedule of {new} steps matching this run's on "
                f"all {self.step} steps taken (the same run as --steps {new} from the start)"
            )
        differs = (
            f"the result is not that of a {new}-step run (the plans differ from step "
            f"{self.first_difference} on)"
        )
        if self.lr_new != self.lr_planned:
            return (
                f"this re-stretches the {self.schedule} schedule: the learning rate jumps from "
                f"{self.lr_planned:.4g} to {self.lr_new:.4g} at step {self.step + 1}, and {differs}"
            )
        return f"the learning rate continues at {self.lr_new:.4g}, but {differs}"


def steps_change(old: TrainConfig, new: TrainConfig, step: int) -> StepsChange:
    """Compare the schedules of two resolved configs that differ in their length, at ``step``."""
    plans = [
        (lr_schedule_of(config), omega_warmup_of(config), beta_warmup_of(config))
        for config in (old, new)
    ]
    old_lr, new_lr = plans[0][0], plans[1][0]
    first_difference = next(
        (taken + 1 for taken in range(step) if any(o(taken) != n(taken) for o, n in zip(*plans))),
        None,
    )
    return StepsChange(
        schedule=new.schedule,
        step=step,
        old_steps=old.total_steps(),
        new_steps=new.total_steps(),
        lr_planned=old_lr(step),
        lr_new=new_lr(step),
        first_difference=first_difference,
    )
