"""The communicator of a fault-tolerant replica, and its layout (see the package docstring for
the round protocol)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
from mtdao.sync.torchft import connection, round_identity
from mtdao.sync.torchft.auth import NO_TOKEN, RunKey
from mtdao.sync.torchft.plumbing import (
    MembershipGloo,
    QuorumError,
    create_store_client,
    first_line,
    listening_store,
)
from mtdao.sync.torchft.safe_transport import SignedHealTransport, advertised_host
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
    bind_host: str = "127.0.0.1"
    """The address every listener of this replica serves on (manager, store, gloo, heal)."""
    key: RunKey = field(default_factory=lambda: RunKey(NO_TOKEN), repr=False)
    """The run's secret: what a peer proves it belongs to the run with (see :mod:`.auth`)."""
    config_digest: str = ""
    """Digest of the settings every replica must share: a member with another sits out."""

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
    stale: str | None = None
    """Why this replica sits out this round and heals at the next (None: it takes part)."""


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
            settings.replica_id,
            timedelta(seconds=settings.collective_timeout),
            settings.key,
            settings.bind_host,
            proof_wait_s=settings.connect_timeout,
        )
        self.process_group.config_digest = settings.config_digest
        self.manager: Manager | None = None
        self._tracked: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self.track_state("replica", self._identity, self._note_source)
        self._round_open = False
        self._fresh = False  # healed at this round's quorum: ran none of its local steps
        self._heal: Heal | None = None
        self._joined = False
        self._prepared_step: int | None = None  # the step whose round the last quorum opened
        self._stale: str | None = None  # why this replica sits the open round out
        self._sitting_out: list[int] = []  # the replicas that do
        self._lighthouse_away: int | None = None  # the step whose quorum found it away
        self.before_collective: Callable[[], None] | None = None
        """Called before each blocking sum of a round (a fault drill holds a replica there)."""
        self.before_quorum: Callable[[], None] | None = None
        """Called before each quorum request (a fault drill learns that a joiner has asked)."""

    def shard_over(self, shard_group: dist.ProcessGroup) -> None:
        """Make this replica the processes of ``shard_group`` (before :meth:`connect`)."""
        self.processes = ReplicaProcesses(shard_group)
        self.layout = ShardedReplicaLayout(self, shard_group)

    def connect(self) -> None:
        """Announce this replica to the lighthouse (heartbeats start): call it once the replica
        is ready to join, since a live replica that does not join holds up new quorums. In a
        replica of several processes every process calls it; group rank 0 first starts the
        replica's manager server and store, then the others connect to them."""
        if self.processes.rank == 0:
            self._store = listening_store(self.settings.bind_host)
        failure = self._start_managers()
        if failure is not None:
            raise QuorumError(failure)

    def _start_managers(self) -> str | None:
        """A heal transport and this process's manager (group rank 0's first); why not, if so."""
        settings = self.settings
        timeout = timedelta(seconds=settings.collective_timeout)
        judge = self.process_group.judge_heal_source
        self.heal_transport = SignedHealTransport(settings.key, settings.bind_host, timeout, judge)
        store, failure = None, None
        start = (settings, self.processes, self.process_group, self.heal_transport)
        if self.processes.rank == 0:
            store = (advertised_host(settings.bind_host), self._store.port)
            self.manager, failure = connection.start_manager(*start, *store)
        store, failure = self.processes.from_first((store, failure))
        if failure is None and self.processes.rank > 0:
            self.manager, failure = connection.start_manager(*start, *store)
        if failure is not None:
            self.heal_transport.shutdown(wait=False)
            return failure
        if self.processes.size > 1:
            address = f"{store[0]}:{store[1]}/mtdao"
            self.process_group.replica_store = create_store_client(address, timeout)
        self.heal_transport.own_progress = self.manager.state_dict
        for key, (state_dict, load_state_dict) in self._tracked.items():
            self.manager.register_state_dict_fn(
                key, connection.unless_kept(load_state_dict), state_dict
            )
        return None

    def _back_in_touch(self, step: int) -> bool:
        """Whether a quorum can be asked for: the lighthouse accepts connections, and after it
        was away a new manager has registered with it (see :mod:`.connection`). A step retried
        without a round (a gradient round cannot be skipped) asks once a second."""
        if self._lighthouse_away == step:
            time.sleep(1.0)
        reachable = (
            connection.lighthouse_reachable(self.settings) if self.processes.rank == 0 else None
        )
        if not self.processes.from_first(reachable):
            self._lighthouse_away = step
            return False
        if self._lighthouse_away is None:
            return True
        commits = self.manager.state_dict()
        self.manager.shutdown(wait=False)  # its heal server with it
        if self.processes.rank == 0:  # a new store: the restarted lighthouse counts quorum ids
            self._store = listening_store(self.settings.bind_host)  # anew, old keys would match
        failure = self._start_managers()
        if failure is None:
            self.manager.load_state_dict(commits)
            self._lighthouse_away = None
        return failure is None

    def listeners(self) -> str:
        """Where this process serves (after :meth:`connect`)."""
        store = self._store if self.processes.rank == 0 else None
        return connection.listeners(self.manager, self.heal_transport, store)

    # -- membership --------------------------------------------------------------------------

    @property
    def replicas(self) -> list[int]:
        """The replica ids of the current quorum, in rank order."""
        return self.process_group.quorum.replicas

    @property
    def contributors(self) -> list[int]:
        """The replicas of the current quorum whose state goes into its round (not the stale)."""
        return [r for r in self.replicas if r not in self._sitting_out]

    @property
    def refused(self) -> list[str]:
        """The peers of the last quorum formed that did not prove they belong to the run, also
        when that quorum's group then failed to form."""
        return list(self.process_group.refused)

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
        self.process_group.training_step = sync.step_count
        if self._joined and (self._prepared_step == coming or not sync.round_due(coming)):
            return None
        sync.settle_in_flight()  # the manager runs one quorum at a time: commit the last first
        if self._joined and not self._back_in_touch(coming):  # this round is skipped: train on
            return None
        try:
            start = self.start_round()
        except QuorumError:
            if not self._joined:
                raise
            self._lighthouse_away = coming  # the lighthouse went while this quorum waited
            return None
        if sync.step_count == 0:  # healed to the first step: no local step missed, it counts
            self._fresh = False
        self._prepared_step = sync.step_count + 1  # after a heal, the step its source takes next
        self.transport.check()  # a group that did not form (a peer's gloo timed out): discarded
        self._sitting_out, self._stale = round_identity.check(  # see round_identity
            self.sum_in_round, self.replicas, self.quorum_rank, sync.step_count, self.settings
        )
        start.stale = self._stale
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
        self._stale, self._sitting_out = None, []
        if self.before_quorum is not None:
            self.before_quorum()
        started = time.perf_counter()
        try:
            with connection.watching_the_lighthouse(self.settings, self.manager) as lost:
                self.manager.start_quorum()
        except ValueError:  # a refusal, or a peer's state that does not fit
            raise
        except Exception as error:  # the lighthouse is gone, or no quorum in time
            if lost.is_set():
                raise QuorumError(
                    f"no quorum: the lighthouse {self.settings.lighthouse_url} stopped accepting "
                    f"connections while this quorum waited ({time.perf_counter() - started:.1f} s)"
                ) from None
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
        # a healed replica's gradient is its own, its parameters and states its source's; a
        # replica at another step or config adds nothing (see round_identity)
        fresh = self._fresh and any(kind != "grads" for kind in kinds)
        return self._stale is None and not fresh

    def assign(self, tensors: Sequence[Tensor], values: Sequence[Tensor]) -> None:
        for tensor, value in zip(tensors, values):
            local_shard(tensor).copy_(value)  # a sharded tensor's average is its shard's

    def commit(self) -> None:
        if not self._round_open:  # a round restored from a checkpoint: its quorum is gone
            raise RoundNotCommitted("round discarded (its quorum ended before it committed)")
        if self._stale is not None:  # it added nothing; it heals at the next quorum
            self.fail(f"this replica sat the round out: {self._stale}")
        self._round_open = False
        if not self.manager.should_commit():
            self._prepared_step = None
            raise RoundNotCommitted(f"round discarded ({self.failure()})")
        self._fresh = False

    def sum_in_round(self, flat: Tensor) -> Tensor:
        """``flat`` summed over the quorum, through the manager; a failure discards the round."""
        if self.before_collective is not None:
            self.before_collective()
        return self.transport.sum(flat)

    def forget_prepared_round(self) -> None:
        """The coming due step needs a quorum again (a replica whose state went back in time)."""
        self._prepared_step = None

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
        if self._lighthouse_away is not None:
            raise RoundNotCommitted(
                f"no round: the lighthouse at {self.settings.lighthouse_url} is unreachable; "
                "training on locally until it is back"
            )
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
