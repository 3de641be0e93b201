"""What mtdao adds to torchft's pieces: a process group that knows who is in each quorum, a state
transport that counts and frees what it sends, quiet logs, and the lighthouse.

This package is the only place that imports torchft.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from torch import Tensor

# torchft's native side logs every quorum at INFO; keep the terminal for progress lines
os.environ.setdefault("RUST_LOG", "warn")

from torchft import ProcessGroupGloo  # noqa: E402
from torchft.checkpointing import HTTPTransport  # noqa: E402
from torchft.process_group import create_store_client  # noqa: E402

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
    """torchft's reconfigurable gloo group, remembering who each configuration holds. A joining
    replica (torchft ``step`` 0) refuses a quorum in which its replica id is taken twice, or whose
    replicas shard differently from it (process s of each replica averages with process s of
    every other, so every replica needs the same number of processes); a replica already running
    discards that round instead."""

    def __init__(self, replica_id: int, timeout: timedelta) -> None:
        super().__init__(timeout=timeout)
        self.replica_id = replica_id
        self.quorum = QuorumView()
        self.group_rank = 0  # this process's rank in its replica
        self.replica_store: Any = None
        """The store this replica's processes share (set before a replica of several joins)."""
        self.step = 0
        """torchft's step of this replica at the quorum being formed (0: it is joining)."""
        self.refusal: ReplicaRefused | None = None

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
        replicas = [(g - self.group_rank) // shards for g in global_ranks or []]
        view = QuorumView(replicas, rank, quorum_id if quorum_id is not None else -1)
        self._check_shard_counts(store_addr, view, world_size, shards)
        # join the group even when refusing: the others then see this replica leave at once,
        # instead of waiting for it until their collective timeout
        super().configure(
            store_addr,
            replica_id,
            rank,
            world_size,
            quorum_id,
            group_rank,
            group_world_size,
            global_ranks,
        )
        self.quorum = view
        if self.step == 0 and replicas.count(self.replica_id) > 1:
            self.refusal = ReplicaRefused(
                f"replica id {self.replica_id} is already taken in the quorum (replicas "
                f"{', '.join(map(str, sorted(replicas)))}); give each replica its own --replica-id"
            )

    def _check_shard_counts(
        self, store_addr: str, quorum: QuorumView, world_size: int, shards: int
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
            verdict = self._compare_shard_counts(store_addr, quorum.rank, world_size, shards)
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

    def _compare_shard_counts(self, store_addr: str, rank: int, world_size: int, shards: int):
        """'' when every replica of the quorum has ``shards`` processes, else ``refuse|fail``
        and who differs (each replica's first process posts its count and torchft step)."""
        # torchft's address of this group is <store>/torchft/<quorum>/<group rank>
        store = create_store_client(f"{store_addr.rsplit('/', 1)[0]}/shards", self._timeout)
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


class HealTransport(HTTPTransport):
    """torchft's HTTP state transfer, counting bytes and dropping a sent state once the round it
    healed is over (it is a full copy: see :func:`engine_state`)."""

    def __init__(self, timeout: timedelta) -> None:
        super().__init__(timeout=timeout, num_chunks=0)
        self.received_bytes = 0
        handler = self._server.RequestHandlerClass  # one access-log line per transfer otherwise
        self._server.RequestHandlerClass = type("QuietHandler", (handler,), {"log_message": quiet})

    def disallow_checkpoint(self) -> None:
        super().disallow_checkpoint()
        self._state_dict = self._chunks = None  # the healed peers have it by now

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta):
        with (
            warnings.catch_warnings()
        ):  # torch reads the stream into a read-only buffer, then copies
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            state = super().recv_checkpoint(src_rank, metadata, step, timeout)
        self.received_bytes = sum(t.numel() * t.element_size() for t in tensors_in(state))
        return state


def quiet(*args: Any) -> None:
    pass


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
