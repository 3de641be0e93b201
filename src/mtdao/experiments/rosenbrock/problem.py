"""The Rosenbrock toy's problem: the function, its gradient, the optimum, what counts as converged
and the methods compared. The run (:mod:`.run`), its summary and its report all read them
from here.
"""

from __future__ import annotations

import torch
from torch import Tensor

METHODS = ("local-adam", "mtdao", "ddp")
OPTIMUM = (1.0, 1.0)
CONVERGED_DISTANCE = 0.25  # a run "converged" if the global point ends this close to (1, 1)


def rosenbrock(x):
    """f(x1, x2) = (1 - x1)^2 + 100 (x2 - x1^2)^2 over the last dimension of ``x`` (a tensor or
    an array)."""
    x1, x2 = x[..., 0], x[..., 1]
    return (1 - x1) ** 2 + 100 * (x2 - x1**2) ** 2


def rosenbrock_grad(x: Tensor) -> Tensor:
    """df/dx1 = -2 (1 - x1) - 400 x1 (x2 - x1^2),  df/dx2 = 200 (x2 - x1^2)."""
    x1, x2 = x[..., 0], x[..., 1]
    valley = x2 - x1**2
    return torch.stack([-2 * (1 - x1) - 400 * x1 * valley, 200 * valley], dim=-1)
