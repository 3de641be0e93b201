"""How bytes move between workers, behind the narrow interface the sync engine needs.

A communicator does four things: average a list of tensors over the workers (optionally leaving
some workers out), assign averaged values back to every worker's copy, broadcast worker 0's values
at start-up, and keep the account of what averaging costs (:class:`Traffic`). A communicator whose
rounds can fail part-way (a peer dies mid-round) also says, in :meth:`Communicator.commit`, whether
the round the engine has checked may be applied. The bytes move over its
:class:`~mtdao.sync.transport.Transport` (a process group, the simulator's stacked rows, a
torchft manager); how each kind is encoded on the way does not depend on which. Where each worker's
copy of a tensor lives (stacked along a leading dimension in one process, or one per process) is
the communicator's :class:`~mtdao.sync.layout.WorkerLayout`; everything else that depends on it
(per-worker norms, locating a NaN, gathering per-worker scalars) lives there.

Implementations:

* :class:`SingleWorker`: world size 1, nothing to send;
* :class:`mtdao.sync.simulated.SimulatedWorkers`: M workers in one process, stacked tensors;
* :class:`mtdao.sync.process_group.ProcessGroupWorkers`: a ``torch.distributed`` process group;
* :class:`mtdao.ft.ReplicaGroups`: fault-tolerant replica groups (torchft, optional);
* :mod:`mtdao.sync.testing`: recording and scripted doubles for tests.

Averaging is split from assigning so that the engine can check the averages (NaN/inf) before
anything is overwritten; what :meth:`Communicator.average` returns may still be in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from mtdao.sync.codecs.quantize import Codec
from mtdao.sync.collectives import InFlightMean
from mtdao.sync.dtensors import local_shard
from mtdao.sync.exchange import payload_sizes, quantized_mean
from mtdao.sync.layout import WorkerLayout
from mtdao.sync.transport import Transport
from mtdao.units import format_bytes


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
    process_bytes: int | None = None
    """What this process sent, where a worker is several processes each sending its shards
    (None: one process per worker, which sent ``bytes``)."""

    def record_round(
        self,
        sizes: Sequence[tuple[str, int]],
        collectives: int,
        process_bytes: int | None = None,
    ) -> None:
        """One averaging call: (kind, bytes per worker) per tensor, sent in ``collectives``
        calls; ``process_bytes``: this process's part, when a worker is several processes."""
        for kind, num_bytes in sizes:
            self.bytes += num_bytes
            self.bytes_by_kind[kind] = self.bytes_by_kind.get(kind, 0) + num_bytes
        if process_bytes is not None:
            self.process_bytes = (self.process_bytes or 0) + process_bytes
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
            "process_bytes": self.process_bytes,
        }

    def load_state_dict(self, state: dict) -> None:
        self.collectives = int(state["collectives"])
        self.bytes = int(state["bytes"])
        self.rounds = int(state["rounds"])
        self.bytes_by_kind = {str(k): int(v) for k, v in state["bytes_by_kind"].items()}
        self.steps = int(state.get("steps", 0))
        self.ddp_bytes_per_step = state.get("ddp_bytes_per_step")
        self.process_bytes = state.get("process_bytes")


class Stateful(Protocol):
    """Anything whose state can be saved and restored: a module, an optimizer, a data loader's
    position, an LR scheduler."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class RoundNotCommitted(RuntimeError):
    """A round that must be discarded (a peer failed during it): the engine applies none of it."""


class FinalRoundNotCommitted(RuntimeError):
    """No try of the final round committed: the workers do not hold the same model."""


class InFlight(Protocol):
    """Collectives launched for some of a round's tensors, not yet complete."""

    collectives: int

    def advance(self) -> None:
        """Run the next stage (wait for what the last one launched, launch what follows)."""

    def wait(self) -> list[Tensor]:
        """Run every remaining stage; the averages of this part's tensors."""


@dataclass
class Averages:
    """The result of one averaging call and what it sent per worker.

    A blocking communicator gives the ``values`` at once. One that overlaps communication with
    compute gives ``in_flight`` parts instead, each with the positions of its tensors in the call;
    :meth:`advance` moves them on and :meth:`wait` completes them.
    """

    values: list[Tensor] | None = None
    bytes: int = 0
    collectives: int = 0
    in_flight: list[tuple[list[int], InFlight]] = field(default_factory=list)

    def advance(self) -> None:
        """Launch whatever next stage the in-flight parts have (a no-op when blocking)."""
        for _, part in self.in_flight:
            part.advance()

    def wait(self) -> list[Tensor]:
        """The global averages, in the order of the tensors averaged."""
        if self.values is None:
            count = sum(len(indices) for indices, _ in self.in_flight)
            values: list[Tensor | None] = [None] * count
            for indices, part in self.in_flight:
                for index, value in zip(indices, part.wait()):
                    values[index] = value
            self.values = values  # type: ignore[assignment]
            self.in_flight = []
        return self.values  # type: ignore[return-value]


class Communicator:
    """Averages tensors over workers and counts what that costs each worker.

    A "global" tensor is one value shared by all workers: the shape of one worker's copy. The
    collectives run over the communicator's :class:`~mtdao.sync.transport.Transport`; the
    encoding of each kind (float32, or a codec) is the same over every transport.
    """

    layout: WorkerLayout
    transport: Transport
    prepares_rounds = False
    """Whether each round is prepared ahead, before the forward pass of the step that opens it
    (a quorum of the live replicas): the engine then calls :meth:`prepare`."""
    heals_joiners = False
    """Whether a worker may join late and take a live one's trained state: the engine then
    hands its state over (:meth:`attach_trained_state`)."""

    def __init__(self, layout: WorkerLayout) -> None:
        self.layout = layout
        self.traffic = Traffic()
        self.transport = Transport()  # world size 1; each communicator sets its own

    @property
    def num_workers(self) -> int:
        return self.layout.num_workers

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def alone(self) -> bool:
        """True where there is no other worker to send to (a transport of one worker), so a
        round sends nothing. A test double standing in for one process of many keeps False."""
        return False

    @property
    def rounds_overlap(self) -> bool:
        """Whether a round may open while another is in flight (see the transport)."""
        return self.transport.rounds_overlap

    def average(
        self,
        tensors: Sequence[Tensor],
        kinds: Sequence[str],
        excluded: Sequence[int] = (),
        codecs: Sequence[Codec | None] | None = None,
    ) -> Averages:
        """Global averages of ``tensors`` over the workers not in ``excluded``, inputs untouched
        (and free to change once this returns: what is sent has been copied or encoded).

        ``kinds`` labels each tensor for the traffic account (``params``, ``exp_avg_0``, ...).
        ``codecs`` gives each tensor's :class:`~mtdao.sync.codecs.quantize.Codec` on the link (None:
        float32, averaged exactly); every worker receives bit-identical averages either way.
        The collectives are launched here and complete in :meth:`Averages.wait`.
        """
        in_flight: list[tuple[list[int], InFlight]] = []
        sizes: list[tuple[str, int]] = []
        process_bytes = 0  # this process's part of what its worker sends
        contributes = self._contributes(kinds)
        for exchange in exchanges(codec_groups(len(tensors), codecs)):
            codec, indices = exchange[0]
            part: InFlight
            if codec is None:
                group, group_kinds = [tensors[i] for i in indices], [kinds[i] for i in indices]
                part = InFlightMean(group, self.transport, excluded, contributes)
                sizes += [
                    (kind, self.layout.worker_bytes(t)) for t, kind in zip(group, group_kinds)
                ]
                process_bytes += sum(local_shard(t).numel() * t.element_size() for t in group)
                in_flight.append((indices, part))
                continue
            groups = [([tensors[i] for i in indices], codec) for codec, indices in exchange]
            part = quantized_mean(groups, self.transport, excluded, contributes)
            for codec, indices in exchange:
                parts = [self.layout.worker_parts(tensors[i]) for i in indices]
                group_sizes, sent = payload_sizes(
                    parts,
                    [kinds[i] for i in indices],
                    codec,
                    self.num_workers,
                    self.layout.shard_rank,
                )
                sizes += group_sizes
                process_bytes += sent
            in_flight.append(([i for _, indices in exchange for i in indices], part))
        collectives = sum(part.collectives for _, part in in_flight)
        sharded = self.layout.num_shards > 1
        num_bytes, collectives = self._account_sizes(
            sizes, collectives, process_bytes if sharded else None
        )
        return Averages(None, num_bytes, collectives, in_flight)

    def _contributes(self, kinds: Sequence[str]) -> bool:
        """Whether this process's workers' values count in an average of ``kinds`` (besides
        ``excluded``): always, but on a fault-tolerant replica healed for this round."""
        return True

    def assign(self, tensors: Sequence[Tensor], values: Sequence[Tensor]) -> None:
        """Set every worker's copy of each tensor to the matching global value."""
        for tensor, value in zip(tensors, values):
            tensor.copy_(value)

    def broadcast_from_first(self, tensors: Sequence[Tensor]) -> None:
        """Make every worker start from worker 0's values (set-up traffic, uncounted)."""

    def prepare(self, step: int, round_due: Callable[[int], bool], final: bool = False) -> Any:
        """Called by the engine before step ``step``'s forward pass (``final``: once the last
        step is taken, before the final round) when :attr:`prepares_rounds`, rounds in flight
        settled first if they do not overlap. ``round_due(s)`` says whether step ``s`` opens a
        round (for ``final``: whether the final round averages anything). Returns what the
        communicator reports of it (None: nothing)."""
        return None

    def attach_trained_state(self, trained: Stateful) -> None:
        """Keep the engine's trained state (a :class:`~mtdao.sync.trained_state.TrainedState`),
        to hand a joining worker (when :attr:`heals_joiners`)."""

    def commit(self) -> None:
        """Called once per round, after the engine has checked the averages and before it applies
        any: raise :class:`RoundNotCommitted` if the round must be discarded. The communicators
        here either complete a round on every worker or raise inside it, so they accept it."""

    def _account_sizes(
        self,
        sizes: Sequence[tuple[str, int]],
        collectives: int,
        process_bytes: int | None = None,
    ):
        """Record (kind, bytes per worker) of everything one averaging call sent (and this
        process's part, when a worker is several processes). Where :attr:`alone`, nothing
        crossed a link, whatever the call did locally: the round counts, no bytes nor
        collectives."""
        if self.alone:
            sizes = [(kind, 0) for kind, _ in sizes]
            collectives, process_bytes = 0, 0 if process_bytes is not None else None
        self.traffic.record_round(sizes, collectives, process_bytes)
        return sum(size for _, size in sizes), collectives


def codec_groups(
    count: int, codecs: Sequence[Codec | None] | None
) -> list[tuple[Codec | None, list[int]]]:
    """Positions of a call's tensors grouped by codec, float32 (None) first, then each codec in
    order of first appearance (how they travel: :func:`exchanges`)."""
    groups: dict[Codec | None, list[int]] = {}
    if codecs is None or all(codec is None for codec in codecs):
        return [(None, list(range(count)))] if count else []
    if None in codecs:
        groups[None] = []
    for index, codec in enumerate(codecs):
        groups.setdefault(codec, []).append(index)
    return list(groups.items())


def exchanges(
    groups: list[tuple[Codec | None, list[int]]],
) -> list[list[tuple[Codec | None, list[int]]]]:
    """The codec groups of a call as they travel: float32 in its all-reduce, every dense codec
    together in one exchange (its all-to-all and all-gather carry them side by side), each
    gathered (top-k) codec in its own."""
    float32 = [[group] for group in groups if group[0] is None]
    dense = [group for group in groups if group[0] is not None and not group[0].gathered]
    gathered = [[group] for group in groups if group[0] is not None and group[0].gathered]
    return float32 + ([dense] if dense else []) + gathered


class SingleWorker(Communicator):
    """World size 1: every average is the tensor itself and nothing is sent."""

    def __init__(self) -> None:
        super().__init__(WorkerLayout())

    def average(
        self,
        tensors: Sequence[Tensor],
        kinds: Sequence[str],
        excluded: Sequence[int] = (),
        codecs: Sequence[Codec | None] | None = None,
    ) -> Averages:
        return Averages(list(tensors))

    def assign(self, tensors: Sequence[Tensor], values: Sequence[Tensor]) -> None:
        # An average is the tensor itself; an outer step's new parameters are not.
        for tensor, value in zip(tensors, values):
            if value is not tensor:
                tensor.copy_(value)
