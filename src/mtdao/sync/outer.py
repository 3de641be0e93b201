"""DiLoCo's outer optimizer: SGD with Nesterov momentum on the averaged pseudo-gradient.

At a parameter sync every worker holds the same anchor (the global parameters after the previous
sync) and the same averaged parameters, so the outer step, and its momentum, are identical on all
workers without extra communication.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from mtdao.sync.policy import OuterOptimizerConfig


class NesterovOuterStep:
    """``pseudo_gradient = anchor - mean(x)``; ``anchor -= lr * nesterov(pseudo_gradient)``."""

    def __init__(
        self, config: OuterOptimizerConfig, anchors: Sequence[Tensor], sync_period: int
    ) -> None:
        self.config = config
        self.sync_period = sync_period
        self.momentum_buffers = [torch.zeros_like(anchor) for anchor in anchors]

    @torch.no_grad()
    def apply(
        self,
        anchors: Sequence[Tensor],
        averages: Sequence[Tensor],
        indices: Sequence[int] | None,
        step: int,
    ) -> None:
        """Move ``anchors`` (in place) by one outer step towards the worker average; ``indices``
        name the parameters they are when only some are synced (fragments); ``step``: the step
        the sync belongs to, for the momentum's schedule."""
        lr, momentum = self.config.lr, self.config.momentum_at(step, self.sync_period)
        buffers = self.momentum_buffers
        if indices is not None:
            buffers = [buffers[i] for i in indices]
        for anchor, average, buffer in zip(anchors, averages, buffers):
            pseudo_gradient = anchor - average  # points uphill, like a gradient
            buffer.mul_(momentum).add_(pseudo_gradient)  # m = mu m + delta
            if self.config.nesterov:
                step = pseudo_gradient.add_(buffer, alpha=momentum)  # delta + mu m
            else:
                step = buffer
            anchor.add_(step, alpha=-lr)  # anchor -= lr * step

    def state_dict(self) -> dict:
        return {"momentum_buffers": [b.clone() for b in self.momentum_buffers]}

    def load_state_dict(self, state: dict) -> None:
        for buffer, saved in zip(self.momentum_buffers, state["momentum_buffers"], strict=True):
            buffer.copy_(saved)
