"""Delayed rounds: a round sent at step t - D is applied at t, keeping the local progress made in
between.

A delayed round lands at the policy's step t, where a blocking round would have been applied, so
the steps at which workers take the global values (and at which a run is evaluated) stay the same;
it is sent D steps earlier. At t - D the engine copies the tensors due (the *snapshot*) and sends
the copy; workers keep training while it travels. At t the average of the snapshots is there, and
each worker's tensor s (which has moved on from its snapshot s0) becomes

    s <- s + c (mean(s0) - s0)

the local progress since the snapshot on top of the new global value, where the correction is
weighted by how much of the snapshot the tensor still carries:

* parameters: c = 1 (Streaming DiLoCo's merge: the global value plus the local change);
* a state that is an exponential moving average with decay beta (Adam's and MT-DAO's momenta,
  the second moment, SGD's momentum buffer): c = beta^D. After D steps such a state holds
  beta^D of its snapshot plus what the new gradients added, so replacing that share of the
  snapshot by the average is exactly the state it would hold had the average been applied when
  the snapshot was taken (for the same gradients);
* the second moment is kept >= c mean(v0) >= 0: in exact arithmetic the merge is
  (v - c v0) + c mean(v0), a sum of squares plus a positive average, and the bound absorbs
  rounding, so the merged value never loses its sign.

The merge leaves the workers' mean unchanged (mean(s) + c (mean(s0) - mean(s0))): it only removes
the spread the workers had at the snapshot. With D = 0 no merge happens: the average is assigned,
as a blocking round always did. A worker left out of a round (NaN/inf) takes the plain average.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

POSITIVE_STATE_KEYS = frozenset({"exp_avg_sq"})
"""States that are averages of squares, kept non-negative by the merge."""


def merge_factor(kind: str, delay: int, decays: Mapping[str, float]) -> float:
    """c of the merge: 1 for parameters (and states of unknown decay), beta^D for an EMA state."""
    if kind == "params" or kind not in decays:
        return 1.0
    return float(decays[kind]) ** delay


@torch.no_grad()
def merge(
    tensor: Tensor,
    average: Tensor,
    snapshot: Tensor,
    factor: float,
    positive: bool = False,
    healed: Tensor | None = None,
) -> None:
    """``tensor <- tensor + factor (average - snapshot)`` in place (see the module docstring).

    ``average`` is the global value (broadcast over stacked workers); ``healed``, a boolean mask
    broadcastable to ``tensor``, marks workers that take ``average`` itself. Each operation is
    rounded on its own (no fused multiply-add), so every layout computes the same bits.
    """
    correction = average - snapshot
    if factor != 1.0:
        correction.mul_(factor)
    if healed is None:
        tensor.add_(correction)
    else:
        merged = torch.where(healed, average.to(tensor.dtype), tensor + correction)
        tensor.copy_(merged)
    if positive:  # (a healed worker's average is above its floor already: factor <= 1)
        torch.maximum(tensor, average * factor, out=tensor)
