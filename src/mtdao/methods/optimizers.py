"""The base optimizers by name, as a method's configuration names them (``optimizer="adam"``),
built with the method's momenta, and the warm-ups of those momenta."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch.optim import Optimizer

from mtdao.optim.mt_adam import MTAdam
from mtdao.optim.mt_adopt import MTAdopt
from mtdao.optim.mt_sgd import MTSGD
from mtdao.optim.warmups import BetaWarmup, OmegaWarmup

BASE_OPTIMIZERS = ("adam", "adopt", "sgdm")


def build_optimizer(
    param_groups: Iterable, config: Any, lr: float, weight_decay: float = 0.0
) -> Optimizer:
    """The optimizer ``config.optimizer`` names, with the ``betas``, ``omegas``, ``beta2`` and
    ``eps`` of ``config`` (a resolved :class:`mtdao.methods.SyncConfig`), the peak ``lr`` and
    the ``weight_decay`` of groups that do not set their own."""
    common = dict(lr=lr, betas=config.betas, omegas=config.omegas, weight_decay=weight_decay)
    if config.optimizer == "adam":
        return MTAdam(param_groups, beta2=config.beta2, eps=config.eps, **common)
    if config.optimizer == "adopt":
        return MTAdopt(param_groups, beta2=config.beta2, eps=config.eps, **common)
    if config.optimizer == "sgdm":
        return MTSGD(param_groups, **common)
    raise ValueError(
        f"`optimizer`: unknown value {config.optimizer!r}; choose from {', '.join(BASE_OPTIMIZERS)}"
    )


def warmups_of(config: Any, total_steps: int) -> tuple[OmegaWarmup, BetaWarmup]:
    """The omega and beta warm-ups of a resolved config over a run of ``total_steps`` steps."""
    return (
        OmegaWarmup(config.omegas, round(config.omega_warmup * total_steps)),
        BetaWarmup(config.betas, round(config.beta_warmup * total_steps), config.beta_ramp),
    )
