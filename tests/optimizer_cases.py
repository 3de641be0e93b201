"""The optimizer cases the tests share, in one table (as torch's ``OptimizerInfo``), and one way
to make their parameters, gradients and training steps.

``OPTIMIZER_CASES``: each variant's class, literal reference step, own hyperparameters and the
peak learning rate the reference tests run it at; ``MOMENTA``: betas and omegas by number of
momenta N. :func:`make_params`, :func:`set_gradients` and :func:`train` are deterministic in
their seed and step, so two runs given the same arguments hold the same values bit for bit; a
test file binds the recipe it uses once (``functools.partial``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mtdao import MTSGD, MTAdam, MTAdopt
from mtdao.optim.reference import mt_adam_reference, mt_adopt_reference, mt_sgd_reference


@dataclass(frozen=True)
class OptimizerCase:
    optimizer_class: type[torch.optim.Optimizer]
    reference: Callable[..., Any]
    """The literal per-tensor step the fast paths are checked against."""
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    """The variant's own (beyond lr, betas, omegas and weight decay)."""
    peak_lr: float = 1e-2


OPTIMIZER_CASES = {
    "adam": OptimizerCase(MTAdam, mt_adam_reference, dict(beta2=0.99, eps=1e-8)),
    "adopt": OptimizerCase(MTAdopt, mt_adopt_reference, dict(beta2=0.999, eps=1e-6)),
    "sgd": OptimizerCase(MTSGD, mt_sgd_reference, {}, peak_lr=5e-2),
}
# N: (betas, omegas); N = 2 sums to 1 (no raw-gradient term), the others leave some weight for it.
MOMENTA = {
    1: ((0.9,), (0.7,)),
    2: ((0.9, 0.99), (0.5, 0.5)),
    3: ((0.5, 0.95, 0.999), (0.2, 0.3, 0.4)),
}

SPIKY = dict(drawn_in=torch.float64, spikes=True, pull=0.5)
"""Gradients with spikes (ADOPT's clip acts) and a pull towards zero, drawn in float64."""


def make_params(
    dtype: torch.dtype | None = None,
    seed: int = 0,
    *,
    shapes: Sequence[tuple[int, ...]],
    drawn_in: torch.dtype | None = None,
    transposed: bool = False,
) -> list[nn.Parameter]:
    """One parameter per shape, standard normal from ``seed``, drawn in ``drawn_in`` (default:
    ``dtype``) and stored in ``dtype`` (default: ``drawn_in``, else float32); ``transposed``
    adds a (4, 6) transposed leaf (dense, not contiguous)."""
    dtype = dtype or drawn_in or torch.float32
    drawn_in = drawn_in or dtype
    generator = torch.Generator().manual_seed(seed)
    drawn = [torch.randn(shape, generator=generator, dtype=drawn_in) for shape in shapes]
    if transposed:
        drawn.append(torch.randn(6, 4, generator=generator, dtype=drawn_in).t())
    return [nn.Parameter(p.to(dtype)) for p in drawn]


def set_gradients(
    params: Sequence[torch.Tensor],
    step: int,
    *,
    drawn_in: torch.dtype | None = None,
    spikes: bool = False,
    pull: float | None = None,
    skip: Sequence[int] = (),
) -> None:
    """Standard normal noise from seed ``100 + step``, drawn in ``drawn_in`` (default: each
    parameter's dtype); ``spikes``: times 20 at every fifth step from step 3; plus ``pull``
    times the parameter. A float64 draw is combined in float64 and rounded once to the
    parameter's dtype; any other is rounded to it first. Parameters ``skip`` names get none
    (their noise is drawn all the same)."""
    generator = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        noise = torch.randn(p.shape, generator=generator, dtype=drawn_in or p.dtype)
        if i in skip:
            p.grad = None
            continue
        work = torch.float64 if noise.dtype == torch.float64 else p.dtype
        gradient = noise.to(work)
        if spikes:
            gradient = (20.0 if step % 5 == 3 else 1.0) * gradient
        if pull is not None:
            gradient = gradient + pull * p.detach().to(work)
        p.grad = gradient.to(p.dtype)


def train(
    optimizer: Any,
    params: Sequence[torch.Tensor],
    steps: int,
    first_step: int = 0,
    *,
    changing_lr: bool = False,
    skip_at: dict[int, Sequence[int]] | None = None,
    **gradients: Any,
) -> None:
    """``steps`` steps of ``optimizer`` (or of an engine: anything with ``step()``) from step
    ``first_step`` on, each on that step's :func:`set_gradients` (``gradients`` its options;
    ``skip_at``: step -> the parameters without a gradient then). ``changing_lr``: a new
    learning rate every step (1e-2 times 1, 1.5 and 2 in turn)."""
    for step in range(first_step, first_step + steps):
        if changing_lr:
            optimizer.param_groups[0]["lr"] = 1e-2 * (1.0 + 0.5 * (step % 3))
        set_gradients(params, step, skip=(skip_at or {}).get(step, ()), **gradients)
        optimizer.step()
