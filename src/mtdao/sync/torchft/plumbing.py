"""What mtdao adds to torchft's pieces: a process group that knows who is in each quorum and
forms only with the members that prove they belong to the run (:mod:`.proofs`), the store and
gloo on the replica's ``--bind-host`` (its manager server: :mod:`.manager_front`), quiet logs,
and the lighthouse. Heal state travels over
:mod:`.safe_transport`.

This package is the only place that imports torchft.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

# torchft's native side logs every quorum at INFO; keep the terminal for progress lines
os.environ.setdefault("RUST_LOG", "warn")

from torchft import ProcessGroupGloo  # noqa: E402
from torchft.process_group import create_store_client  # noqa: E402

from mtdao.sync.torchft.auth import NO_TOKEN, RunKey  # noqa: E402
from mtdao.sync.torchft.proofs import Claim, exchange_claims  # noqa: E402

# torchft reports what went wrong to its manager, which hands it to us; its own log lines
# (tracebacks of every failed collective) would bury the one line that matters.
logging.getLogger("torchft").addHandler(logging.NullHandler())
logging.getLogger("torchft").propagate = False


class ReplicaRefused(ValueError):
    """This replica may not join the quorum: its replica id is taken, or its config differs."""


class QuorumError(ConnectionError):
    """The lighthouse cannot be reached, or no quorum formed within the timeout."""


@dataclass
class QuorumView:
    replicas: list[int] = field(default_factory=list)
    rank: int = 0
    quorum_id: int = -1


class MembershipGloo(ProcessGroupGloo):
    """torchft's reconfigurable gloo group, formed only with the members of each quorum that
    prove they belong to the run (see :mod:`.proofs`), and remembering who each configuration
    holds. A joining replica (torchft ``step`` 0) refuses a quorum in which its replica id is
    taken twice, or whose replicas shard differently from it (process s of each replica averages
    with process s of every other, so every replica needs the same number of processes); a
    replica already running discards that round instead. Gloo serves on ``bind_host``."""

    def __init__(
        self,
        replica_id: int,
        timeout: timedelta,
        key: RunKey | None = None,
        bind_host: str = "127.0.0.1",
        proof_wait_s: float = 30.0,
    ) -> None:
        super().__init__(timeout=timeout)
        self.replica_id = replica_id
        self.key = key or RunKey(NO_TOKEN)
        self.bind_host, self.proof_wait_s = bind_host, proof_wait_s
        self.quorum = QuorumView()
        self.group_rank = 0  # this process's rank in its replica
        self.replica_store: Any = None
        """The store this replica's processes share (set before a replica of several joins)."""
        self.step = 0
        """torchft's step of this replica at the quorum being formed (0: it is joining)."""
        self.training_step = 0
        """The training step this replica has taken, at the quorum being formed."""
        self.config_digest = ""
        self.refusal: ReplicaRefused | None = None
        self.refused: list[str] = []
        """The members of the last quorum that did not prove they belong to the run."""
        self._proven: set[int] = set()  # torchft quorum ranks of the proven members
        self._ranked: list[int] = []  # torchft quorum rank -> replica id

    def configure(
        self,
        store_addr,
        replica_id,
        rank,
        world_size,
        quorum_id=None,
        group_rank=None,
        group_world_size=None,
        global_ranks=None,
    ):
        shards, self.group_rank = group_world_size or 1, group_rank or 0
        # torchft numbers the processes of a quorum replica_id * shards + group_rank
        global_ranks = list(global_ranks or [])
        replicas = [(g - self.group_rank) // shards for g in global_ranks]
        quorum_id = quorum_id if quorum_id is not None else -1
        proven = self._prove(store_addr, replicas, rank, world_size, quorum_id)
        view = QuorumView([replicas[r] for r in proven], proven.index(rank), quorum_id)
        # members that prove different sets (one with another secret proves only itself) meet
        # under different keys: with one prefix they overwrote each other's gloo addresses and
        # shard counts, and no group formed
        members = "-".join(map(str, proven))
        self._check_shard_counts(store_addr, members, view, len(proven), shards)
        # join the group even when refusing: the others then see this replica leave at once,
        # instead of waiting for it until their collective timeout
        super().configure(
            f"{store_addr}/proven/{members}",
            replica_id,
            view.rank,
            len(proven),
            quorum_id,
            group_rank,
            group_world_size,
            [global_ranks[r] for r in proven],
        )
        self.quorum = view
        if self.step == 0 and view.replicas.count(self.replica_id) > 1:
            self.refusal = ReplicaRefused(
                f"replica id {self.replica_id} is already taken in the quorum (replicas "
                f"{', '.join(map(str, sorted(view.replicas)))}); give each replica its own "
                "--replica-id"
            )

    def _prove(
        self, store_addr: str, replicas: list[int], rank: int, world_size: int, quorum_id: int
    ) -> list[int]:
        """The torchft ranks of the quorum members that prove they belong to the run. The first
        process of each replica exchanges signed claims (every replica has one), and hands the
        verdict to the replica's other processes through the replica's store."""
        self._ranked = replicas
        verdict_key = f"proven/{quorum_id}"
        if self.group_rank == 0:
            proven = self._exchange_claims(store_addr, replicas, rank, world_size, quorum_id)
            if self.replica_store is not None:
                self.replica_store.set(verdict_key, json.dumps(proven))
        else:
            self.replica_store.wait([verdict_key], self._timeout)
            proven = json.loads(self.replica_store.get(verdict_key))
        self._proven = set(proven)
        self.refused = [
            f"{self._peer(r)}: it did not prove it belongs to the run (no claim signed with this "
            "run's secret: wrong or missing --auth-token-file / $MTDAO_AUTH_TOKEN); it is not "
            "averaged with nor healed from"
            for r in range(world_size)
            if r not in self._proven
        ]
        return proven

    def _exchange_claims(
        self, store_addr: str, replicas: list[int], rank: int, world_size: int, quorum_id: int
    ) -> list[int]:
        mine = Claim(self.replica_id, self.step, self.training_step, self.config_digest)
        store = create_store_client(f"{store_addr}/claims", self._timeout)
        context = f"{quorum_id}|{store_addr}|{','.join(map(str, replicas))}"
        claims = exchange_claims(
            store, self.key, context, rank, world_size, mine, self.proof_wait_s
        )
        proven = [  # a claim must name the replica at its place
            r for r, c in enumerate(claims) if c is not None and c.replica_id == replicas[r]
        ]
        if rank not in proven:
            raise RuntimeError("this replica's own claim did not verify in the quorum's store")
        return proven

    def _peer(self, rank: int) -> str:
        replica = self._ranked[rank] if rank < len(self._ranked) else "?"
        return f"the peer claiming replica id {replica} (quorum rank {rank})"

    def judge_heal_source(self, rank: int) -> tuple[str, str]:
        """Whether to take the state of torchft's heal source ``rank`` (see :mod:`.safe_transport`):
        ``take`` it from a proven member; from any other, ``keep`` this replica's own (its round
        then checks the step: a replica that was behind sits it out and heals at the next
        quorum, from a proven member)."""
        peer = self._peer(rank)
        if rank in self._proven:
            return "take", peer
        return "keep", f"{peer}: it did not prove it belongs to the run"

    def _create_pg(self, store, rank: int, world_size: int):
        """torchft's gloo group, its sockets on ``bind_host``."""
        from torchft.process_group import BaseProcessGroup, BaseProcessGroupGloo

        options = BaseProcessGroupGloo._Options()
        options._timeout = self._timeout
        host = self.bind_host.strip("[]")
        every_interface = host in ("0.0.0.0", "::", "")
        gloo = BaseProcessGroupGloo
        device = gloo.create_default_device() if every_interface else gloo.create_device(host)
        options._devices = [device]
        pg = BaseProcessGroup(store, rank, world_size)
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        backend = BaseProcessGroupGloo(store, rank, world_size, options)
        backend._set_sequence_number_for_group()
        if self._global_ranks:
            backend.options.global_ranks_in_group = self._global_ranks
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
        return pg

    def _check_shard_counts(
        self, store_addr: str, members: str, quorum: QuorumView, world_size: int, shards: int
    ):
        """Refuse to pair up with replicas that shard differently: a process with no partner
        would wait out its collective timeout. So nobody forms a group and the round fails
        everywhere; a joining replica refuses itself unless its count is the one of most
        replicas at the newest step (those it would heal from), the others retry at the next
        quorum.

        torchft gives group rank s of every replica a store of its own (that replicas with fewer
        processes never reach), so the first process of each replica compares the counts in
        group rank 0's store, and hands its verdict to the replica's other processes through the
        replica's own store (``replica_store``)."""
        verdict_key = f"shards/{quorum.quorum_id}"
        if self.group_rank == 0:
            verdict = self._compare_shard_counts(
                store_addr, members, quorum.rank, world_size, shards
            )
            if shards > 1:
                self.replica_store.set(verdict_key, verdict)
        else:
            self.replica_store.wait([verdict_key], self._timeout)
            verdict = self.replica_store.get(verdict_key).decode()
        if not verdict:
            return
        self.abort(errored=False)
        self.quorum = quorum
        decision, theirs = verdict.split(" ", 1)
        if decision == "refuse":
            self.refusal = ReplicaRefused(
                f"this replica has --shards {shards}, but {theirs} in the quorum: the processes "
                "of replicas pair up shard by shard, so every replica needs the same --shards"
            )
        raise RuntimeError(f"{theirs}, this replica {shards}")

    def _compare_shard_counts(
        self, store_addr: str, members: str, rank: int, world_size: int, shards: int
    ):
        """'' when every proven replica of the quorum has ``shards`` processes, else
        ``refuse|fail`` and who differs (each replica's first process posts its count and
        torchft step)."""
        # torchft's address of this group is <store>/torchft/<quorum>/<group rank>
        quorum_store = store_addr.rsplit("/", 1)[0]
        store = create_store_client(f"{quorum_store}/shards/{members}", self._timeout)
        store.set(str(rank), f"{self.replica_id} {shards} {self.step}")
        store.wait([str(r) for r in range(world_size)], self._timeout)
        posted = [store.get(str(r)).decode().split() for r in range(world_size)]
        counts = {int(replica): int(count) for replica, count, _ in posted}
        if all(count == shards for count in counts.values()):
            return ""
        theirs = ", ".join(
            f"replica {r} has --shards {n}" for r, n in sorted(counts.items()) if n != shards
        )
        refuse = self.step == 0 and reference_shard_count(posted) != shards
        return f"{'refuse' if refuse else 'fail'} {theirs}"


def reference_shard_count(posted: list[list[str]]) -> int | None:
    """The number of processes most replicas at the newest step have (None: no majority)."""
    newest = max(int(step) for _, _, step in posted)
    counts = [int(count) for _, count, step in posted if int(step) == newest]
    common = max(set(counts), key=counts.count)
    return common if 2 * counts.count(common) > len(counts) else None


def listening_store(bind_host: str) -> dist.TCPStore:
    """This replica's store (a TCPStore server), listening on ``bind_host`` only: torch's own
    server would listen on every interface, so it is handed a socket bound here."""
    host = bind_host.strip("[]")
    if host in ("0.0.0.0", "::", ""):
        return dist.TCPStore(socket.gethostname(), 0, is_master=True, wait_for_workers=False)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, 0), family=family, backlog=128)
    port = listener.getsockname()[1]
    return dist.TCPStore(
        host, port, is_master=True, wait_for_workers=False, master_listen_fd=listener.detach()
    )


def first_line(error: BaseException) -> str:
    """The first sentence of an error, without gloo's ``[path/file.cc:123] `` source location."""
    text = str(error).strip() or type(error).__name__
    return re.sub(r"^\[[^\]]*:\d+\]\s*", "", text.splitlines()[0]).split(". ")[0]


def start_lighthouse(
    bind: str,
    min_replicas: int,
    join_timeout: float,
    heartbeat_timeout: float,
    quorum_tick: float = 0.1,
):
    """torchft's lighthouse, serving in background threads; ``.address()`` and ``.shutdown()``."""
    from torchft._torchft import LighthouseServer

    try:
        return LighthouseServer(
            bind=bind,
            min_replicas=min_replicas,
            join_timeout_ms=round(join_timeout * 1000),
            quorum_tick_ms=max(1, round(quorum_tick * 1000)),
            heartbeat_timeout_ms=round(heartbeat_timeout * 1000),
        )
    except RuntimeError as error:
        raise QuorumError(f"cannot serve the lighthouse on {bind}: {first_line(error)}") from None


def tensors_in(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)
