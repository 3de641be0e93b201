"""The learning-rate schedule the harness applies before each step (a pure function of the step,
:func:`lr_multiplier`), and the re-planning of a run for other --steps. The warm-ups of the
omegas and betas are the library's (:mod:`mtdao.optim.warmups`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from torch.optim import Optimizer

from mtdao.methods.optimizers import warmups_of
from mtdao.optim.warmups import DefinedSchedule


class PlannedRun(Protocol):
    """What the schedules read of a :class:`~mtdao.train.config.TrainConfig` (which imports this
    module for its defaults, so this one names only what it reads)."""

    lr_schedule: Any
    sync: Any

    def total_steps(self) -> int: ...


# The LR warm-up when neither --warmup nor --warmup-steps is given: a number of steps, not a
# fraction of --steps, so that every run of up to 3000 steps warms up as a longer one starts
# (on the defaults card 5% of --steps, 15 steps of a 300-step run, cost every method 11-16% of
# its loss, and 50 of a 1000-step run MT-DAO 4-6% and Local Adam 4-8%; docs/history.md, the
# warm-up's change). Longer runs keep 5%.
DEFAULT_WARMUP_STEPS = 150
DEFAULT_WARMUP_FRACTION = 0.05


def warmup_steps_of(config: PlannedRun, steps: int | None = None) -> int:
    """The LR warm-up's length in steps for a run of ``steps`` (default: the config's own):
    --warmup's fraction of them, else --warmup-steps, else the default: DEFAULT_WARMUP_STEPS,
    or DEFAULT_WARMUP_FRACTION of the run when that is longer, at most half the run."""
    steps = config.total_steps() if steps is None else steps
    if config.lr_schedule.warmup is not None:
        return round(config.lr_schedule.warmup * steps)
    if config.lr_schedule.warmup_steps is not None:
        return config.lr_schedule.warmup_steps
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


@dataclass
class LRSchedule(DefinedSchedule):
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


def lr_schedule_of(config: PlannedRun) -> LRSchedule:
    """The learning-rate schedule of a resolved config."""
    steps = config.total_steps()
    return LRSchedule(
        config.lr_schedule.lr,
        steps,
        config.lr_schedule.schedule,
        warmup_steps_of(config),
        config.lr_schedule.min_lr_ratio,
        config.lr_schedule.decay_fraction,
    )


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


def steps_change(old: PlannedRun, new: PlannedRun, step: int) -> StepsChange:
    """Compare the schedules of two resolved configs that differ in their length, at ``step``."""
    plans = [
        (lr_schedule_of(config), *warmups_of(config.sync, config.total_steps()))
        for config in (old, new)
    ]
    old_lr, new_lr = plans[0][0], plans[1][0]
    first_difference = next(
        (taken + 1 for taken in range(step) if any(o(taken) != n(taken) for o, n in zip(*plans))),
        None,
    )
    return StepsChange(
        schedule=new.lr_schedule.schedule,
        step=step,
        old_steps=old.total_steps(),
        new_steps=new.total_steps(),
        lr_planned=old_lr(step),
        lr_new=new_lr(step),
        first_difference=first_difference,
    )
