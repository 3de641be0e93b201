"""What a round is made of: the tensors due, the round itself through its lifecycle, the record it
leaves, and what is checked before it is applied.

A :class:`Round` carries its stage (:class:`Stage`) and the methods that move it (opened,
:meth:`Round.launch`, :meth:`Round.land`, :meth:`Round.commit` or :meth:`Round.discard`,
:meth:`Round.applied`), the same on every communicator; what each stage does, and why a discarded
round leaves every worker as if it had not been sent, is in docs/design.md ("A round").
:class:`RoundsInFlight` holds the rounds sent and not yet applied, oldest first.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from mtdao.sync.communicator import Averages, Communicator, RoundNotCommitted
from mtdao.sync.dtensors import local_shard
from mtdao.sync.layout import WorkerLayout
from mtdao.sync.transport import Work

if TYPE_CHECKING:
    from mtdao.sync.codecs.compression import PseudoGradients


@dataclass
class SyncEvent:
    """One averaging round as it happened: at which step, which kinds, what it sent per worker."""

    step: int
    kinds: list[str]
    bytes: int
    collectives: int
    final: bool = False
    """The final round, after the last step (``LocalUpdateSync.finish``)."""


@dataclass
class SyncRound:
    """The tensors due at one step, averaged together in one communicator call: the parameters
    (``param_indices`` into the engine's list) first, then the states."""

    step: int
    tensors: list[Tensor]
    kinds: list[str]
    names: list[str]
    param_indices: list[int] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)
    """The index of the parameter each tensor belongs to (itself, or its state)."""


@dataclass
class CheckedRound:
    """A round's averages once checked for NaN/inf, and what the engine records and writes if it
    commits: the round's event, a skipped-workers record, alignment, and the heal of the workers
    left out (tensors, their averages over the others, and those workers)."""

    averages: list[Tensor]
    events: list[SyncEvent]
    skipped: dict[str, Any] | None = None
    alignment: PendingAlignment | None = None
    heal: tuple[list[Tensor], list[Tensor], list[int]] | None = None


class Stage(enum.Enum):
    """Where a round is in its lifecycle (see the module docstring)."""

    OPENED = "opened"
    IN_FLIGHT = "in flight"
    LANDED = "landed"
    COMMITTED = "committed"
    DISCARDED = "discarded"
    APPLIED = "applied"


NEXT_STAGES = {
    Stage.OPENED: {Stage.IN_FLIGHT, Stage.DISCARDED},
    Stage.IN_FLIGHT: {Stage.LANDED, Stage.DISCARDED},
    Stage.LANDED: {Stage.COMMITTED, Stage.DISCARDED},
    Stage.COMMITTED: {Stage.APPLIED},
    Stage.DISCARDED: set(),
    Stage.APPLIED: set(),
}


@dataclass(eq=False)
class Round:
    """One round, from opened to applied or discarded (see the module docstring)."""

    due: SyncRound
    sent: list[Tensor]
    """What was averaged (copies, for a delayed round): kept for a retry without a NaN worker."""
    snapshots: list[Tensor] | None
    """Each tensor's local value when the round opened (delayed rounds only)."""
    land_step: int
    """The step after which it is applied (its opening step plus the delay)."""
    advance_step: int
    """When the exchange's second stage is launched (quantized rounds have two)."""
    feedback: PseudoGradients | None = None
    """The error feedback whose residuals opening the round advanced (None: none)."""
    residuals_before: dict[int, Tensor | None] = field(default_factory=dict)
    """The error-feedback residuals of its parameters before it opened (None: none yet), put
    back when it is discarded."""
    result: Averages = field(default_factory=Averages)
    """The transport's work, and what it sent per worker."""
    excluded: list[int] = field(default_factory=list)
    """Workers left out of the average (NaN/inf): they take the average without a merge."""
    event: SyncEvent | None = None
    """Its record, made at the commit."""
    checked: CheckedRound | None = None
    """Set once landed and committed: what it applies."""
    recorded: bool = False
    """Whether its event is in the engine's record already."""
    stage: Stage = Stage.OPENED

    @property
    def step(self) -> int:
        """The step it opened at."""
        return self.due.step

    @property
    def committed(self) -> bool:
        return self.stage in (Stage.COMMITTED, Stage.APPLIED)

    def _move(self, stage: Stage) -> None:
        if stage not in NEXT_STAGES[self.stage]:
            raise RuntimeError(
                f"the round opened at step {self.step} is {self.stage.value}: it cannot be "
                f"{stage.value}"
            )
        self.stage = stage

    def launch(self, result: Averages) -> None:
        """Opened -> in flight: ``result`` holds the transport's work."""
        self.result = result
        self._move(Stage.IN_FLIGHT)

    def advance(self) -> None:
        """Launch the exchange's next stage (a peer lost in the first one discards the round)."""
        try:
            self.result.advance()
        except RoundNotCommitted:
            self.discard()
            raise

    def land(self) -> list[Tensor]:
        """In flight -> landed: the averages, waited for and decoded (a failure the wait sees
        discards the round). A landed round is checked, then committed or discarded."""
        try:
            averages = self.result.wait()
        except RoundNotCommitted:
            self.discard()
            raise
        self._move(Stage.LANDED)
        return averages

    def commit(self, communicator: Communicator, checked: CheckedRound) -> None:
        """Landed -> committed, if ``communicator`` commits it (then ``checked`` is what it
        applies); else discarded, and ``RoundNotCommitted`` raised."""
        try:
            communicator.commit()
        except RoundNotCommitted:
            self.discard()
            raise
        self.checked = checked
        self._move(Stage.COMMITTED)

    def restore_committed(self) -> None:
        """A round restored (from a checkpoint or a heal) as committed where it was saved: it
        lands at once and is only to be applied."""
        self.checked = CheckedRound(self.land(), [])
        self._move(Stage.COMMITTED)

    def discard(self) -> None:
        """Undo what opening the round changed (nothing else was written): its parameters'
        error-feedback residuals are put back. Discarding a discarded round does nothing."""
        if self.stage is Stage.DISCARDED:
            return
        self._move(Stage.DISCARDED)
        if self.feedback is None:
            return
        for index, residual in self.residuals_before.items():
            if residual is None:
                self.feedback.residuals.pop(index, None)
            else:
                self.feedback.residuals[index] = residual

    def applied(self) -> None:
        """Committed -> applied: its values are in the tensors."""
        self._move(Stage.APPLIED)

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


@dataclass
class RoundsInFlight:
    """The rounds sent and not yet applied, oldest first."""

    rounds: list[Round] = field(default_factory=list)

    def add(self, opened: Round) -> None:
        self.rounds.append(opened)

    def pop_landing(self, step: int | None) -> list[Round]:
        """The rounds to apply at ``step`` (every round, with ``step`` None), removed."""
        landing = [r for r in self.rounds if step is None or r.land_step <= step]
        self.rounds = [r for r in self.rounds if not any(r is other for other in landing)]
        return landing

    def remove(self, discarded: Round) -> None:
        self.rounds = [r for r in self.rounds if r is not discarded]

    def to_advance(self, step: int) -> list[Round]:
        """The rounds whose exchange launches its second stage at ``step``."""
        return [r for r in self.rounds if r.advance_step == step]

    def __len__(self) -> int:
        return len(self.rounds)


def alignment(
    layout: WorkerLayout,
    params: Sequence[Tensor],
    anchors: Sequence[Tensor],
    averages: Sequence[Tensor],
    step: int,
) -> PendingAlignment:
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
    return PendingAlignment(step, layout.gather_later(torch.stack([cosine, drift.sqrt()], -1)))


@dataclass
class PendingAlignment:
    """One sync's alignment, its gather launched: on a process group it travels behind the next
    steps rather than holding up the round (a gather pays the link's latency once per hop: over
    a 100 ms link, as much as a small model's quantized round)."""

    step: int
    gathered: Work
    """Each worker's [cosine, drift]."""

    def record(self) -> dict[str, Any]:
        """``{"step", "cosine", "drift"}``, one value per worker (waits for the gather)."""
        cosine, drift = self.gathered.wait()[0].unbind(-1)
        return {"step": self.step, "cosine": cosine.tolist(), "drift": drift.tolist()}
