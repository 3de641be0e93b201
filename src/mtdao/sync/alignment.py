"""Worker alignment at a parameter sync: how well each worker's pseudo-gradient agrees with the
global one (cosine similarity), and how far its parameters drifted from the average."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from mtdao.sync.layout import WorkerLayout


def alignment(
    layout: WorkerLayout,
    params: Sequence[Tensor],
    anchors: Sequence[Tensor],
    averages: Sequence[Tensor],
    step: int,
) -> dict[str, Any]:
    """One record per sync: per worker, the cosine between ``anchor - param`` (its
    pseudo-gradient) and ``anchor - average`` (the global one), and ``|param - average|``."""
    dot = norm_local = norm_global = drift = 0.0
    for param, anchor, average in zip(params, anchors, averages):
        local_update = (anchor - param).float()  # each worker's pseudo-gradient
        global_update = (anchor - average).float()
        dot = dot + layout.per_worker_sum(local_update * global_update)
        norm_local = norm_local + layout.per_worker_sum(local_update.square())
        norm_global = norm_global + global_update.square().sum()
        drift = drift + layout.per_worker_sum((param - average).float().square())
    cosine = dot / (norm_local.sqrt() * norm_global.sqrt()).clamp_min(1e-30)
    return {
        "step": step,
        "cosine": layout.gather(cosine).tolist(),
        "drift": layout.gather(drift.sqrt()).tolist(),
    }
