"""Warm-ups of MT-DAO's omegas and slow betas, as objects applied to the optimizer's param groups
before each step (``warmup.apply(optimizer, step)``): pure functions of the step, holding their
targets and carrying their definition in ``state_dict``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from torch.optim import Optimizer


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


class DefinedSchedule:
    """``state_dict`` / ``load_state_dict`` of a schedule: its defining fields."""

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, tuple(value) if isinstance(value, list) else value)


@dataclass
class OmegaWarmup(DefinedSchedule):
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
class BetaWarmup(DefinedSchedule):
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
