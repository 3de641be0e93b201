"""What a round is made of: the tensors due, the record it leaves, and what is checked before it
is applied (see LocalUpdateSync, docs/design.md "A round")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from mtdao.sync.dtensors import local_shard
from mtdao.sync.layout import WorkerLayout


@dataclass
class SyncEvent:
    """One averaging round as it happened: at which step, which kinds, what it sent per worker."""

    step: int
    kinds: list[str]
    bytes: int
    collectives: int


@dataclass
class SyncRound:
    """The tensors due at one step, averaged together in one communicator call: the parameters
    (``param_indices`` into the engine's list) first, then the states."""

    step: int
    tensors: list[Tensor]
    kinds: list[str]
    names: list[str]
    param_indices: list[int] = field(default_factory=list)


@dataclass
class CheckedRound:
    """A round's averages once checked for NaN/inf, and what the engine records and writes if it
    commits: the round's event, a skipped-workers record, alignment, and the heal of the workers
    left out (tensors, their averages over the others, and those workers)."""

    averages: list[Tensor]
    events: list[SyncEvent]
    skipped: dict[str, Any] | None = None
    alignment: dict[str, Any] | None = None
    heal: tuple[list[Tensor], list[Tensor], list[int]] | None = None


def alignment(
    layout: WorkerLayout,
    params: Sequence[Tensor],
    anchors: Sequence[Tensor],
    averages: Sequence[Tensor],
    step: int,
) -> dict[str, Any]:
    """Each worker's cosine similarity between its pseudo-gradient (anchor - its parameters) and
    the global one (anchor - average), and its parameter drift from the average."""
    dot = norm_local = norm_global = drift = 0.0
    for param, anchor, average in zip(params, anchors, averages):
        param = local_shard(param)  # anchors and averages of a sharded tensor are shards
        local_update = (anchor - param).float()  # each worker's pseudo-gradient
        global_update = (anchor - average).float()
        dot = dot + layout.per_worker_sum(local_update * global_update)
        norm_local = norm_local + layout.per_worker_sum(local_update.square())
        norm_global = norm_global + layout.global_sum(global_update.square())
        drift = drift + layout.per_worker_sum((param - average).float().square())
    cosine = dot / (norm_local.sqrt() * norm_global.sqrt()).clamp_min(1e-30)
    return {
        "step": step,
        "cosine": layout.gather(cosine).tolist(),
        "drift": layout.gather(drift.sqrt()).tolist(),
    }
