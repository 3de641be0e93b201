"""The communicator of a fault-tolerant replica (see the package docstring for the round
protocol)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from mtdao.ft import connection, round_identity
from mtdao.ft.config import ReplicaConfig
from mtdao.ft.healing import HealedState
from mtdao.ft.identity import ReplicaIdentity
from mtdao.ft.layouts import ReplicaLayout, ShardedReplicaLayout
from mtdao.ft.lines import advertised_host, first_line
from mtdao.ft.parity import ParityCheck
from mtdao.ft.plumbing import QuorumError, listening_store
from mtdao.ft.quorum import Quorum
from mtdao.ft.refusals import Refusal
from mtdao.ft.security.auth import RunKey, run_key
from mtdao.ft.security.heal_checks import REPLICA_RECORD
from mtdao.ft.security.manager_front import FrontUnavailable, manager_bound_to
from mtdao.ft.security.proven_manager import ProvenManager
from mtdao.ft.security.safe_transport import SignedHealTransport
from mtdao.ft.security.torchft_internals import GlooGroup, Manager, ManagerInternals
from mtdao.ft.shards import ReplicaProcesses
from mtdao.sync.collectives import DEFAULT_BUCKET_BYTES
from mtdao.sync.communicator import Communicator, RoundNotCommitted, Stateful
from mtdao.sync.dtensors import local_shard

if TYPE_CHECKING:
    from mtdao.sync.trained_state import TrainedState

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.1


@dataclass
class Heal:
    """A state transfer from a live peer (``source``) to this replica; ``seconds``: its whole
    quorum, waiting, transfer and loading."""

    source: int
    bytes: int
    seconds: float


@dataclass
class RoundStart:
    """What a quorum found: who takes part in this round, who came and went, and any heal."""

    replicas: list[int]
    joined: list[int]
    left: list[int]
    quorum_id: int
    seconds: float
    heal: Heal | None = None
    stale: str | None = None  # why this replica sits this round out (and heals at the next)


class ReplicaGroups(Communicator):
    """One replica of a fault-tolerant run: a worker of the engine, averaging with whichever
    replicas are alive in each round; with ``shard_group``, that group of FSDP2 processes."""

    layout: ReplicaLayout
    transport: Quorum
    prepares_rounds = True
    heals_joiners = True

    def __init__(
        self,
        config: ReplicaConfig,
        *,
        key: RunKey | None = None,
        config_digest: str = "",
        collective_timeout: float = 300.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        allow_non_finite: bool = False,
        shard_group: dist.ProcessGroup | None = None,
    ) -> None:
        """``key``: the run's secret (None: this account's, on loopback only); ``config_digest``:
        of the settings every replica must share; the rest as ``fault_tolerant_replica`` says."""
        self.config = config
        self.collective_timeout = timedelta(seconds=collective_timeout)
        self.allow_non_finite = allow_non_finite
        key = key or run_key(None, config.bind_host)
        self.identity = ReplicaIdentity(config.replica_id, key, config_digest)
        self.process_group = GlooGroup(
            config.bind_host, self.collective_timeout, config.connect_timeout
        )
        quorum = Quorum(self.process_group, self.identity, ReplicaProcesses(), bucket_bytes)
        super().__init__(ReplicaLayout(quorum))
        self.quorum = self.transport = quorum  # a round's collectives run in its quorum
        if shard_group is not None:
            self.shard_over(shard_group)
        self._tracked: dict[str, Stateful] = {}
        # tracked first: a healing replica learns its source from it
        self.track_state(
            REPLICA_RECORD,
            SimpleNamespace(state_dict=self._identity, load_state_dict=self._note_source),
        )
        self._fresh = False  # healed at this round's quorum: ran none of its local steps
        self._heal: Heal | None = None
        self._joined = False
        self._final = False  # whether the open quorum is for the final round
        self._stale: str | None = None  # why this replica sits the open round out
        self._sitting_out: list[int] = []  # the replicas that do
        self._lighthouse_away: int | None = None  # the step whose quorum found it away
        self.before_quorum: Callable[[], None] | None = None  # a fault drill's hook
        # called with each quorum formed and the step this replica then stands at (a heal moves it)
        self.on_quorum: Callable[[RoundStart, int], None] | None = None
        self.parity = ParityCheck()

    @property
    def replica_id(self) -> int:
        return self.identity.replica_id

    @property
    def manager(self) -> Manager | None:
        return self.quorum.manager

    def shard_over(self, shard_group: dist.ProcessGroup) -> None:
        """Make this replica the processes of ``shard_group`` (before :meth:`connect`)."""
        self.quorum.processes = ReplicaProcesses(shard_group)
        self.layout = ShardedReplicaLayout(self.transport, shard_group)

    @property
    def processes(self) -> ReplicaProcesses:
        return self.quorum.processes

    def connect(self) -> None:
        """Announce this replica to the lighthouse (heartbeats start) once it is ready to join:
        a live replica that does not join holds up new quorums. Every process calls it."""
        origin = self.identity.key.origin
        if self.processes.rank == 0 and origin != "the run's secret":  # once a replica
            logger.warning(  # what a run without a secret protects from this machine's accounts
                "replica %d: no auth token file or $MTDAO_AUTH_TOKEN: replicas prove themselves "
                "with %s; only this account's processes on this machine can join its rounds; other "
                "accounts here can still reach torchft's servers on loopback (stop or stall a "
                "replica, list replica ids): on a shared machine give the run a network namespace "
                "of its own (see docs/security.md)", self.config.replica_id, origin,
            )  # fmt: skip
        failure = self._start_managers()
        if failure is not None:
            raise QuorumError(failure)

    def _start_managers(self) -> str | None:
        """A store, a heal transport and this process's manager (group rank 0's first); why not,
        if so. The store is new each time: a restarted lighthouse counts quorum ids anew, and an
        old store's keys would match."""
        key, bind_host = self.identity.key, self.config.bind_host
        if self.processes.rank == 0:
            self._store = listening_store(bind_host)
        self.heal_transport = SignedHealTransport(key, bind_host, self.collective_timeout)
        store, failure, manager = None, None, None
        if self.processes.rank == 0:
            store = (advertised_host(bind_host), self._store.port)
            manager, failure = self._start_manager(*store)
        store, failure = self.processes.from_first((store, failure))
        if failure is None and self.processes.rank > 0:
            manager, failure = self._start_manager(*store)
        if failure is not None:
            self.heal_transport.shutdown(wait=False)
            return failure
        self.quorum.manager = manager
        for key, state in self._tracked.items():
            manager.register_state_dict_fn(key, state.load_state_dict, state.state_dict)
        return None

    def _start_manager(self, store_host: str, store_port: int) -> tuple[Manager | None, str | None]:
        """This process's torchft manager, or the reason it could not start."""
        config = self.config
        with manager_bound_to(config.bind_host):
            try:
                manager = ProvenManager(  # its quorums hold proven members only
                    identity=self.identity,
                    allow_non_finite=self.allow_non_finite,
                    pg=self.process_group,
                    load_state_dict=None,
                    state_dict=None,
                    min_replica_size=1,
                    use_async_quorum=False,  # heal before the step, not during it
                    timeout=self.collective_timeout,
                    quorum_timeout=timedelta(seconds=config.quorum_timeout),
                    connect_timeout=timedelta(seconds=config.connect_timeout),
                    rank=self.processes.rank,
                    world_size=self.processes.size,
                    store_addr=store_host,
                    store_port=store_port,
                    lighthouse_addr=config.lighthouse_url,
                    replica_id=str(config.replica_id),
                    hostname=store_host,
                    heartbeat_interval=timedelta(seconds=HEARTBEAT_INTERVAL_S),
                    checkpoint_transport=self.heal_transport,
                )
            except FrontUnavailable as error:
                return None, str(error)
            except RuntimeError as error:
                reason = first_line(error).rsplit(": ", 1)[-1]  # the innermost cause
                if self.processes.rank > 0:
                    return None, f"cannot reach this replica's manager on {store_host} ({reason})"
                return None, (
                    f"cannot reach the lighthouse at {config.lighthouse_url} within "
                    f"--connect-timeout {config.connect_timeout:g} s ({reason})"
                )
        return manager, None

    def _back_in_touch(self, step: int) -> bool:
        """Whether the lighthouse accepts connections (after it was away, a new manager has
        registered with it); a step retried without a round asks once a second."""
        if self._lighthouse_away == step:
            time.sleep(1.0)
        reachable = (
            connection.lighthouse_reachable(self.config) if self.processes.rank == 0 else None
        )
        if not self.processes.from_first(reachable):
            self._away_at(step)
            return False
        if self._lighthouse_away is None:
            return True
        commits = self.manager.state_dict()
        self.manager.shutdown(wait=False)  # its heal server with it
        failure = self._start_managers()
        if failure is None:
            self.manager.load_state_dict(commits)
            self._lighthouse_away, self.quorum.unreachable = None, None
        return failure is None

    def _away_at(self, step: int) -> None:
        """The lighthouse is away at ``step``: its rounds are discarded until it is back."""
        self._lighthouse_away = step
        self.quorum.unreachable = (
            f"the lighthouse at {self.config.lighthouse_url} is unreachable; training on "
            "locally until it is back"
        )

    def listeners(self) -> str:
        """Where this process serves (after :meth:`connect`; the first also its manager and store)."""
        heal_host, heal_port = self.heal_transport.address
        parts = [f"heal state {heal_host}:{heal_port}"]
        if self.processes.rank == 0:
            server = ManagerInternals(self.manager).server  # a FrontedManagerServer
            served = server.address().split("://")[-1]
            behind = f"a front refusing Kill, torchft's server behind it on {server.internal}"
            parts = [f"manager {served} ({behind})", f"store port {self._store.port}", *parts]
        return ", ".join(parts) + " (collectives on the same address)"

    # -- membership --------------------------------------------------------------------------

    @property
    def replicas(self) -> list[int]:
        """The replica ids of the current quorum, in rank order."""
        return self.quorum.members

    @property
    def contributors(self) -> list[int]:
        """The replicas of the current quorum whose state goes into its round (not the stale)."""
        return [r for r in self.replicas if r not in self._sitting_out]

    def refused(self) -> list[Refusal]:
        """The peers refused by the quorums since the last call, each refusal once."""
        refused, self.identity.refused = self.identity.refused, []
        return refused

    def notes(self) -> list[str]:
        """What the quorums since the last call did that this replica should say, each once."""
        notes, self.identity.notes = self.identity.notes, []
        return notes

    def track_state(self, key: str, state: Stateful) -> None:
        """State a healing replica also receives (a data position, a schedule, RNG), loaded in
        registration order after the replica's identity (before :meth:`connect`)."""
        if self.manager is not None:
            raise RuntimeError("track_state() comes before connect()")
        if key in self._tracked:
            raise ValueError(f"a state named {key!r} is tracked already")
        self._tracked[key] = state

    def attach_trained_state(self, trained: TrainedState) -> None:
        self.track_state("engine", HealedState(trained))
        self.parity.sync = trained.sync

    def prepare(
        self, step: int, round_due: Callable[[int], bool], final: bool = False
    ) -> RoundStart | None:
        """Before step ``step``'s forward pass (``final``: before the final round): a quorum when
        this replica has not joined yet or ``round_due(step)``, else None. A heal here moves
        this replica to its source's step."""
        self.identity.training_step = step - 1  # a heal moves it to its source's
        if self._joined and self.quorum.prepared == step:  # formed already (after the last step)
            if final and not round_due(step):  # a quorum no round follows: close it
                self._empty_round()
            self._final = final
            return None
        if not round_due(step) and (self._joined or final):
            return None
        if self.manager is None:
            self.connect()
        if self._joined and not self._back_in_touch(step):  # this round is skipped: train on
            return None
        self._final = final
        try:
            start = self.start_round()
        except QuorumError:
            if not self._joined:
                raise
            self._away_at(step)  # the lighthouse went while this quorum waited
            return None
        if self.identity.training_step == 0:  # healed to the first step: missed nothing, counts
            self._fresh = False
        coming = self.identity.training_step + 1  # after a heal, the step its source takes next
        self.quorum.prepared = coming
        try:
            self.quorum.check()  # a group that did not form (a member did not come)
            self._sitting_out, self._stale = round_identity.check(  # see round_identity
                self.quorum.sum, self.replicas, self.quorum.rank, self.identity.training_step,
                self.identity.config_digest, self.parity,
            )  # fmt: skip
            if not (self._final or round_due(coming)):
                self._empty_round()
        except RoundNotCommitted as failure:
            if not self._joined:  # a joiner asks again at once (not before: see below)
                raise
            self.quorum.discarded, self.quorum.prepared = str(failure), coming
            return start  # the step trains on locally; its round is discarded in it
        start.stale = self._stale
        self._joined = True  # not before: a joiner whose first quorum failed asks again at once
        if self.on_quorum is not None:
            self.on_quorum(start, self.identity.training_step)
        return start

    def _empty_round(self) -> None:
        """Commit a quorum that no round follows: the one-element sum completes only once every
        healing replica has loaded its state (the sources stop serving it at the commit)."""
        self.quorum.sum(torch.zeros(1))
        self.commit()

    def start_round(self) -> RoundStart:
        """A quorum for the round ahead, healing this replica if it is new or fell behind."""
        before = list(self.replicas)
        self._heal, self._fresh = None, False
        self._stale, self._sitting_out, self.quorum.discarded = None, [], None
        if self.before_quorum is not None:
            self.before_quorum()
        started = time.perf_counter()
        try:
            with connection.watching_the_lighthouse(self.config, self.manager) as lost:
                self.manager.start_quorum()
        except ValueError:  # a refusal, or a peer's state that does not fit
            raise
        except Exception as error:  # the lighthouse is gone, or no quorum in time
            if lost.is_set():
                raise QuorumError(
                    f"no quorum: the lighthouse {self.config.lighthouse_url} stopped accepting "
                    f"connections while this quorum waited ({time.perf_counter() - started:.1f} s)"
                ) from None
            raise QuorumError(
                f"no quorum (lighthouse {self.config.lighthouse_url}, --quorum-timeout "
                f"{self.config.quorum_timeout:g} s): {first_line(error)}"
            ) from None
        if self.identity.refusal is not None:
            raise self.identity.refusal
        self.quorum.open = True
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
            quorum_id=self.identity.quorum_id,
            seconds=seconds,
            heal=self._heal,
        )

    def _identity(self) -> dict[str, Any]:
        """Who this replica is, its step, and whether this quorum is for the final round."""
        step = self.identity.training_step
        return {"replica_id": self.replica_id, "step": step, "final": self._final}

    def _note_source(self, state: dict[str, Any]) -> None:
        if self.identity.refusal is not None:  # load nothing: this replica leaves
            raise self.identity.refusal
        self._heal = Heal(source=int(state["replica_id"]), bytes=0, seconds=0.0)
        self.parity.last = None  # what it assigned is gone: it holds its source's state now
        self.identity.training_step, self._final = int(state["step"]), bool(state["final"])

    # -- the round ---------------------------------------------------------------------------

    def _contributes(self, kinds: Sequence[str]) -> bool:
        # a healed replica's gradient is its own, its parameters and states its source's; a
        # replica at another step or config adds nothing (see round_identity)
        fresh = self._fresh and any(kind != "grads" for kind in kinds)
        return self._stale is None and not fresh

    def assign(self, tensors: Sequence[Tensor], values: Sequence[Tensor]) -> None:
        for tensor, value in zip(tensors, values):
            local_shard(tensor).copy_(value)  # a sharded tensor's average is its shard's
        final = self._final and not self._sitting_out  # (every member is in the final round)
        self.parity.assigned(tensors, self.quorum, final)  # the round committed: see parity

    def commit(self) -> None:
        if self._stale is not None and self.quorum.open:  # it added nothing; it heals next
            self.quorum.fail(f"this replica sat the round out: {self._stale}")
        self.quorum.commit()
        self._fresh = False

    def broadcast_from_first(self, tensors: Sequence[Tensor]) -> None:
        """Nothing: the first quorum heals every replica from one of them (torchft's init sync)."""

    def shutdown(self) -> None:
        """Leave: stop heartbeats and the state server."""
        if self.manager is not None:
            self.manager.shutdown(wait=False)
        self.process_group.abort(errored=False)  # peers in a round with us fail now, not later
