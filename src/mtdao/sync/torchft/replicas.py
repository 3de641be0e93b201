"""The communicator of a fault-tolerant replica, and its layout (see the package docstring for
the round protocol)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchft import Manager

from mtdao.sync.collectives import DEFAULT_BUCKET_BYTES, InFlightMean
from mtdao.sync.communicator import Communicator, RoundNotCommitted
from mtdao.sync.dtensors import local_shard
from mtdao.sync.layout import WorkerLayout
from mtdao.sync.sharded_layout import ShardGroupSums
from mtdao.sync.torchft.plumbing import (
    HealTransport,
    MembershipGloo,
    QuorumError,
    create_store_client,
    first_line,
)
from mtdao.sync.torchft.shards import ReplicaProcesses
from mtdao.sync.torchft.transport import ManagerTransport

if TYPE_CHECKING:
    from mtdao.sync.engine import LocalUpdateSync


@dataclass(frozen=True)
class ReplicaSettings:
    """How one replica group reaches the others; timeouts in seconds."""

    replica_id: int
    lighthouse: str
    """``http://host:port`` or ``host:port`` of the lighthouse."""
    connect_timeout: float = 30.0
    """Reaching the lighthouse, and a peer to heal from."""
    quorum_timeout: float = 600.0
    """Waiting for a quorum: longer than the time between two rounds, or a late joiner gives up."""
    collective_timeout: float = 300.0
    """One collective or heal transfer; a peer slower than this counts as failed."""
    heartbeat_interval: float = 0.1
    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    @property
    def lighthouse_url(self) -> str:
        return self.lighthouse if "://" in self.lighthouse else f"http://{self.lighthouse}"


@dataclass
class Heal:
    """A state transfer from a live peer to this replica."""

    source: int
    """The replica the state came from."""
    bytes: int
    seconds: float
    """The whole quorum that carried it: waiting, transfer and loading."""


@dataclass
class RoundStart:
    """What a quorum found: who takes part in this round, who came and went, and any heal."""

    replicas: list[int]
    joined: list[int]
    left: list[int]
    quorum_id: int
    seconds: float
    heal: Heal | None = None


class ReplicaLayout(WorkerLayout):
    """This replica among the replicas of the current quorum; its gathers go through the manager
    and belong to the round in progress (a failure discards the round)."""

    def __init__(self, communicator: ReplicaGroups) -> None:
        self.communicator = communicator

    @property
    def num_workers(self) -> int:  # type: ignore[override]
        return max(1, len(self.communicator.replicas))

    @property
    def rank(self) -> int:  # type: ignore[override]
        return self.communicator.quorum_rank

    def gather(self, values: Tensor) -> Tensor:
        """Inside a round, every replica's value; between rounds (no coordination) this
        replica's own, and NaN for the others."""
        in_round = self.communicator.in_round
        slots = torch.full((self.num_workers,), 0.0 if in_round else float("nan"))
        slots = slots.to(dtype=torch.float64, device=values.device)
        slots[self.rank] = values.reshape(()).to(torch.float64)
        return self.communicator.sum_in_round(slots) if in_round else slots

    def global_mean(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        return InFlightMean(tensors, self.communicator.transport).wait()


class ShardedReplicaLayout(ShardGroupSums, ReplicaLayout):
    """A replica of ``shard_group``'s processes among the replicas of the current quorum: a sum
    over a worker adds the replica's shards first (see :mod:`.shards`)."""

    def __init__(self, communicator: ReplicaGroups, shard_group: dist.ProcessGroup) -> None:
        super().__init__(communicator)
        self._join_shard_group(shard_group)


class ReplicaGroups(Communicator):
    """One replica group of a fault-tolerant run: a worker of the engine, averaging with whichever
    replicas are alive in each round. See the module docstring for the round protocol.

    With ``shard_group``, the replica is that group of processes sharding its tensors (FSDP2),
    each averaging its shards with the same process of the other replicas (see :mod:`.shards`).
    """

    layout: ReplicaLayout
    transport: ManagerTransport

    def __init__(
        self, settings: ReplicaSettings, shard_group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__(ReplicaLayout(self))
        self.transport = ManagerTransport(self)
        self.processes = ReplicaProcesses()
        if shard_group is not None:
            self.shard_over(shard_group)
        self.settings = settings
        self.replica_id = settings.replica_id
        self.process_group = MembershipGloo(
            settings.replica_id, timedelta(seconds=settings.collective_timeout)
        )
        self.manager: Manager | None = None
        self._tracked: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self.track_state("replica", self._identity, self._note_source)
        self._round_open = False
        self._fresh = False  # healed at this round's quorum: ran none of its local steps
        self._heal: Heal | None = None
        self._joined = False
        self._prepared_step: int | None = None  # the step whose round the last quorum opened

    def shard_over(self, shard_group: dist.ProcessGroup) -> None:
        """Make this replica the processes of ``shard_group`` (before :meth:`connect`)."""
        self.processes = ReplicaProcesses(shard_group)
        self.layout = ShardedReplicaLayout(self, shard_group)

    def connect(self) -> None:
        """Announce this replica to the lighthouse (heartbeats start): call it once the replica
        is ready to join, since a live replica that does not join holds up new quorums. In a
        replica of several processes every process calls it; group rank 0 first starts the
        replica's manager server and store, then the others connect to them."""
        self.heal_transport = HealTransport(timedelta(seconds=self.settings.collective_timeout))
        store, failure = None, None
        if self.processes.rank == 0:
            host = socket.gethostname()
            self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            store = (host, self._store.port)
            failure = self._start_manager(*store)
        store, failure = self.processes.from_first((store, failure))
        if failure is None and self.processes.rank > 0:
            failure = self._start_manager(*store)
        if failure is not None:
            self.heal_transport.shutdown(wait=False)
            raise QuorumError(failure)
        if self.processes.size > 1:
            address = f"{store[0]}:{store[1]}/mtdao"
            timeout = timedelta(seconds=self.settings.collective_timeout)
            self.process_group.replica_store = create_store_client(address, timeout)
        for key, (state_dict, load_state_dict) in self._tracked.items():
            self.manager.register_state_dict_fn(key, load_state_dict, state_dict)

    def _start_manager(self, store_host: str, store_port: int) -> str | None:
        """This process's torchft manager; the reason it could not start, if so."""
        settings = self.settings
        collective = timedelta(seconds=settings.collective_timeout)
        try:
            self.manager = Manager(
                pg=self.process_group,
                load_state_dict=None,
                state_dict=None,
                min_replica_size=1,
                use_async_quorum=False,  # heal before the step, not during it
                timeout=collective,
                quorum_timeout=timedelta(seconds=settings.quorum_timeout),
                connect_timeout=timedelta(seconds=settings.connect_timeout),
                rank=self.processes.rank,
                world_size=self.processes.size,
                store_addr=store_host,
                store_port=store_port,
                lighthouse_addr=settings.lighthouse_url,
                replica_id=str(settings.replica_id),
                hostname=store_host,
                heartbeat_interval=timedelta(seconds=settings.heartbeat_interval),
                checkpoint_transport=self.heal_transport,
            )
        except RuntimeError as error:
            reason = first_line(error).rsplit(": ", 1)[-1]  # the innermost cause
            if self.processes.rank > 0:
                return f"cannot reach this replica's manager on {store_host} ({reason})"
            return (
                f"cannot reach the lighthouse at {settings.lighthouse_url} within "
                f"--connect-timeout {settings.connect_timeout:g} s ({reason})"
            )
        return None

    # -- membership --------------------------------------------------------------------------

    @property
    def replicas(self) -> list[int]:
        """The replica ids of the current quorum, in rank order."""
        return self.process_group.quorum.replicas

    @property
    def quorum_rank(self) -> int:
        return self.process_group.quorum.rank

    @property
    def in_round(self) -> bool:
        """Whether a round is open (between its quorum and its commit)."""
        return self._round_open

    def track_state(
        self, key: str, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]
    ) -> None:
        """State a healing replica receives from a live peer, loaded in registration order
        (before :meth:`connect`)."""
        if self.manager is not None:
            raise RuntimeError("track_state() comes before connect()")
        self._tracked[key] = (state_dict, load_state_dict)

    def before_step(self, sync: LocalUpdateSync) -> RoundStart | None:
        """Call before each step's forward pass: a quorum when this replica has not joined yet or
        a round opens at the coming step (None otherwise: no coordination between rounds). A
        round still in flight (delayed) is settled first: the manager runs one quorum at a
        time; it is still applied at its own step."""
        coming = sync.step_count + 1
        if self._joined and (self._prepared_step == coming or not sync.round_due(coming)):
            return None
        sync.settle_in_flight()
        start = self.start_round()
        if sync.step_count == 0:  # healed to the first step: no local step missed, it counts
            self._fresh = False
        self._prepared_step = sync.step_count + 1  # after a heal, the step its source takes next
        if not sync.round_due(self._prepared_step):
            self._empty_round()
        self._joined = True  # not before: a joiner whose first quorum failed asks again at once
        return start

    def _empty_round(self) -> None:
        """Commit a quorum that no round follows: the one-element sum completes only once every
        healing replica has loaded its state (the sources stop serving it at the commit)."""
        self.sum_in_round(torch.zeros(1))
        self.commit()

    def start_round(self) -> RoundStart:
        """A quorum for the round ahead, healing this replica if it is new or fell behind."""
        before = list(self.replicas)
        self.process_group.step = self.manager.current_step()
        self._heal, self._fresh = None, False
        started = time.perf_counter()
        try:
            self.manager.start_quorum()
        except ValueError:  # a refusal, or a peer's state that does not fit
            raise
        except Exception as error:  # the lighthouse is gone, or no quorum in time
            raise QuorumError(
                f"no quorum (lighthouse {self.settings.lighthouse_url}, --quorum-timeout "
                f"{self.settings.quorum_timeout:g} s): {first_line(error)}"
            ) from None
        if self.process_group.refusal is not None:
            raise self.process_group.refusal
        self._round_open = True
        seconds = time.perf_counter() - started
        received = self.heal_transport.received_bytes if self._heal is not None else 0
        received = self.processes.sum(received)  # a sharded replica: over its processes
        if self._heal is not None:
            self._heal.bytes, self._heal.seconds = received, seconds
            self._fresh = True
        after = self.replicas
        return RoundStart(
            replicas=list(after),
            joined=sorted(set(after) - set(before)),
            left=sorted(set(before) - set(after)),
            quorum_id=self.process_group.quorum.quorum_id,
            seconds=seconds,
            heal=self._heal,
        )

    def _identity(self) -> dict[str, int]:
        return {"replica_id": self.replica_id}

    def _note_source(self, state: dict[str, int]) -> None:
        if self.process_group.refusal is not None:  # load nothing: this replica leaves
            raise self.process_group.refusal
        self._heal = Heal(source=int(state["replica_id"]), bytes=0, seconds=0.0)

    # -- the round ---------------------------------------------------------------------------

    def _contributes(self, kinds: Sequence[str]) -> bool:
        # a healed replica's gradient is its own, its parameters and states its source's
        return not (self._fresh and any(kind != "grads" for kind in kinds))

    def assign(self, tensors: Sequence[Tensor], values: Sequence[Tensor]) -> None:
        for tensor, value in zip(tensors, values):
            local_shard(tensor).copy_(value)  # a sharded tensor's average is its shard's

    def commit(self) -> None:
        if not self._round_open:  # a round restored from a checkpoint: its quorum is gone
            raise RoundNotCommitted("round discarded (its quorum ended before it committed)")
        self._round_open = False
        if not self.manager.should_commit():
            self._prepared_step = None
            raise RoundNotCommitted(f"round discarded ({self.failure()})")
        self._fresh = False

    def sum_in_round(self, flat: Tensor) -> Tensor:
        """``flat`` summed over the quorum, through the manager; a failure discards the round."""
        return self.transport.sum(flat)

    def fail(self, reason: str) -> None:
        """Tell torchft the round failed (the next quorum rebuilds the group), then raise."""
        self.manager.report_error(RuntimeError(reason))
        self._round_open, self._prepared_step = False, None  # a retried step needs a new quorum
        self.manager.should_commit()
        raise RoundNotCommitted(f"round discarded ({reason})")

    def failure(self) -> str:
        error = self.manager.errored()
        if error is None:
            return "too few replicas"
        return first_line(error.original_exception)

    def require_round(self) -> None:
        if not self._round_open:
            raise RuntimeError(
                "no round in progress: call start_round() before a step whose round is due "
                "(LocalUpdateSync.round_due), then let the engine average and commit"
            )

    def broadcast_from_first(self, tensors: Sequence[Tensor]) -> None:
        """Nothing: the first quorum heals every replica from one of them (torchft's init sync)."""

    def shutdown(self) -> None:
        """Leave: stop heartbeats and the state server (the lighthouse drops us after its
        heartbeat timeout)."""
        if self.manager is not None:
            self.manager.shutdown(wait=False)
        self.process_group.abort(errored=False)  # peers in a round with us fail now, not later
