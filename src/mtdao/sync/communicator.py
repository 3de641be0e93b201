"""How bytes move between workers, behind the narrow interface the sync engine needs.

A communicator does four things: average a list of tensors over the workers (optionally leaving
some workers out), assign averaged values back to every worker's copy, broadcast worker 0's values
at start-up, and keep the account of what averaging costs (:class:`Traffic`). A communicator whose
rounds can fail part-way (a peer dies mid-round) also says, in :meth:`Communicator.commit`, whether
the round the engine has checked may be applied. Where each worker's
copy of a tensor lives (stacked along a leading dimension in one process, or one per process) is
the communicator's :class:`~mtdao.sync.layout.WorkerLayout`; everything else that depends on it
(per-worker norms, locating a NaN, gathering per-worker scalars) lives there.

Implementations:

* :class:`SingleWorker`: world size 1, nothing to send;
* :class:`mtdao.sync.simulated.SimulatedWorkers`: M workers in one process, stacked tensors;
* :class:`mtdao.sync.process_group.ProcessGroupWorkers`: a ``torch.distributed`` process group;
* :class:`mtdao.sync.torchft.ReplicaGroups`: fault-tolerant replica groups (torchft, optional);
* :mod:`mtdao.sync.testing`: recording and scripted doubles for tests.

Averaging is split from assigning so that the engine can check the averages (NaN/inf) before
anything is overwritten. :meth:`Communicator.average` returns an :class:`Averages`; a blocking
communicator returns it complete, one that overlaps communication with compute could return it
early and finish it in :meth:`Averages.wait`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import Tensor

from mtdao.sync.layout import WorkerLayout


def format_bytes(num_bytes: float) -> str:
    """1536 -> '1.5 kB', 2.5e9 -> '2.5 GB' (decimal units, as links are rated)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes:.0f} B"


@dataclass
class Traffic:
    """What one worker sent by averaging (payloads of counted collectives only).

    ``steps`` and ``ddp_bytes_per_step`` are filled in by the engine that uses the communicator, so
    that the account can say how it compares with DDP (one gradient all-reduce per step).
    """

    collectives: int = 0
    bytes: int = 0
    rounds: int = 0
    bytes_by_kind: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    ddp_bytes_per_step: int | None = None

    def record_round(self, sizes: Sequence[tuple[str, int]], collectives: int) -> None:
        """One averaging call: (kind, bytes) per tensor, sent in ``collectives`` calls."""
        for kind, num_bytes in sizes:
            self.bytes += num_bytes
            self.bytes_by_kind[kind] = self.bytes_by_kind.get(kind, 0) + num_bytes
        self.collectives += collectives
        self.rounds += 1

    @property
    def ddp_bytes(self) -> int | None:
        """What DDP would have sent per worker over the same steps (None when unknown)."""
        return None if self.ddp_bytes_per_step is None else self.ddp_bytes_per_step * self.steps

    def reduction_vs_ddp(self) -> float | None:
        """DDP's bytes over these bytes (None when unknown or nothing was sent)."""
        ddp = self.ddp_bytes
        return ddp / self.bytes if ddp is not None and self.bytes else None

    def __str__(self) -> str:
        text = (
            f"{format_bytes(self.bytes)} sent per worker in {self.rounds} rounds "
            f"({self.collectives} collectives)"
        )
        if self.steps:
            text += f" over {self.steps} steps"
        reduction = self.reduction_vs_ddp()
        if reduction is not None:
            text += f"; DDP would send {format_bytes(self.ddp_bytes)}: {reduction:.1f}x more"
        return text

    def state_dict(self) -> dict:
        return {
            "collectives": self.collectives,
            "bytes": self.bytes,
            "rounds": self.rounds,
            "bytes_by_kind": dict(self.bytes_by_kind),
            "steps": self.steps,
            "ddp_bytes_per_step": self.ddp_bytes_per_step,
        }

    def load_state_dict(self, state: dict) -> None:
        self.collectives = int(state["collectives"])
        self.bytes = int(state["bytes"])
        self.rounds = int(state["rounds"])
        self.bytes_by_kind = {str(k): int(v) for k, v in state["bytes_by_kind"].items()}
        self.steps = int(state.get("steps", 0))
        self.ddp_bytes_per_step = state.get("ddp_bytes_per_step")


class RoundNotCommitted(RuntimeError):
    """A round that must be discarded (a peer failed during it): the engine applies none of it."""


@dataclass
class Averages:
    """The result of one averaging call and what it sent per worker."""

    values: list[Tensor]
    bytes: int = 0
    collectives: int = 0

    def wait(self) -> list[Tensor]:
        """The global averages (complete at once for a blocking communicator)."""
        return self.values


class Communicator:
    """Averages tensors over workers and counts what that costs each worker.

    A "global" tensor is one value shared by all workers: the shape of one worker's copy.
    """

    layout: WorkerLayout

    def __init__(self, layout: WorkerLayout) -> None:
        self.layout = layout
        self.traffic = Traffic()

    @property
    def num_workers(self) -> int:
        return self.layout.num_workers

    @property
    def rank(self) -> int:
        return self.layout.rank

    def average(
        self, tensors: Sequence[Tensor], kinds: Sequence[str], excluded: Sequence[int] = ()
    ) -> Averages:
        """Global averages of ``tensors`` over the workers not in ``excluded``, inputs untouched.

        ``kinds`` labels each tensor for the traffic account (``params``, ``exp_avg_0``, ...).
        """
        raise NotImplementedError

    def assign(self, tensors: Sequence[Tensor], values: Sequence[Tensor]) -> None:
        """Set every worker's copy of each tensor to the matching global value."""
        for tensor, value in zip(tensors, values):
            tensor.copy_(value)

    def broadcast_from_first(self, tensors: Sequence[Tensor]) -> None:
        """Make every worker start from worker 0's values (set-up traffic, uncounted)."""

    def commit(self) -> None:
        """Called once per round, after the engine has checked the averages and before it applies
        any: raise :class:`RoundNotCommitted` if the round must be discarded. The communicators
        here either complete a round on every worker or raise inside it, so they accept it."""

    def _account(self, tensors: Sequence[Tensor], kinds: Sequence[str], collectives: int):
        """Record one averaging call in the traffic account; returns its (bytes, collectives)."""
        sizes = [(kind, self.layout.worker_bytes(t)) for t, kind in zip(tensors, kinds)]
        self.traffic.record_round(sizes, collectives)
        return sum(size for _, size in sizes), collectives


class SingleWorker(Communicator):
    """World size 1: every average is the tensor itself and nothing is sent."""

    def __init__(self) -> None:
        super().__init__(WorkerLayout())

    def average(
        self, tensors: Sequence[Tensor], kinds: Sequence[str], excluded: Sequence[int] = ()
    ) -> Averages:
        return Averages(list(tensors))

    def assign(self, tensors: Sequence[Tensor], values: Sequence[Tensor]) -> None:
        # An average is the tensor itself; an outer step's new parameters are not.
        for tensor, value in zip(tensors, values):
            if value is not tensor:
                tensor.copy_(value)
