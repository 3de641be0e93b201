"""What a round is made of: the tensors due, the round itself through its lifecycle, the record it
leaves, and what is checked before it is applied (see LocalUpdateSync, docs/design.md "A round").

A :class:`Round` lives through four stages, the same on every communicator:

1. *opened* for a step: what is due (:class:`SyncRound`), encoded (a copy of each tensor when
   the round is delayed, parameters as pseudo-gradients when quantized, error-feedback residuals
   advanced: their previous values are kept in the round);
2. *in flight*: the transport's work (:class:`~mtdao.sync.communicator.Averages`), for D steps
   when the round is delayed;
3. *landed*: the averages waited for, decoded and checked (NaN/inf), then *committed* (the
   communicator's last word) or *discarded*. Only a committed round is recorded;
4. *applied* at its landing step: assigned, or merged into the local progress by the delay rule.

A discarded round leaves every worker as if it had not been sent: nothing was written into the
tensors before the commit, so local progress stands, the anchors were not moved, and the
error-feedback residuals the round advanced are put back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from mtdao.sync.communicator import Averages
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


@dataclass
class Round:
    """One round, from opened to committed or discarded (see the module docstring)."""

    due: SyncRound
    sent: list[Tensor]
    """What was averaged (copies, for a delayed round): kept for a retry without a NaN worker."""
    snapshots: list[Tensor] | None
    """Each tensor's local value when the round opened (delayed rounds only)."""
    result: Averages
    """The transport's work, and what it sent per worker."""
    land_step: int
    """The step after which it is applied (its opening step plus the delay)."""
    advance_step: int
    """When the exchange's second stage is launched (quantized rounds have two)."""
    residuals_before: dict[int, Tensor | None] = field(default_factory=dict)
    """The error-feedback residuals of its parameters before it opened (None: none yet), put
    back when it is discarded."""
    excluded: list[int] = field(default_factory=list)
    """Workers left out of the average (NaN/inf): they take the average without a merge."""
    event: SyncEvent | None = None
    """Its record, made at the commit."""
    checked: CheckedRound | None = None
    """Set once landed and committed: what it applies."""
    recorded: bool = False
    """Whether its event is in the engine's record already."""

    @property
    def step(self) -> int:
        """The step it opened at."""
        return self.due.step

    @property
    def committed(self) -> bool:
        return self.checked is not None

    def state_dict(self) -> dict[str, Any]:
        """The round with its averages complete (waiting for them here changes no value)."""
        values = self.result.wait()
        return {
            "step": self.step,
            "sent": self.sent,
            "snapshots": self.snapshots,
            "averages": values,
            "bytes": self.result.bytes,
            "collectives": self.result.collectives,
            "finish_step": self.land_step,
            "advance_step": self.advance_step,
            "committed": self.committed,
            "excluded": list(self.excluded),
        }


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
