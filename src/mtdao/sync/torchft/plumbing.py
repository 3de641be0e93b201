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
    """torchft's reconfigurable gloo group, remembering who each configuration holds, and noting
    a quorum in which this replica's id is taken twice (a new replica then refuses to join)."""

    def __init__(self, replica_id: int, timeout: timedelta) -> None:
        super().__init__(timeout=timeout)
        self.replica_id = replica_id
        self.quorum = QuorumView()
        self.refuse_duplicates = True
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
        replicas = list(global_ranks or [])
        self.quorum = QuorumView(replicas, rank, quorum_id if quorum_id is not None else -1)
        if self.refuse_duplicates and replicas.count(self.replica_id) > 1:
            self.refusal = ReplicaRefused(
                f"replica id {self.replica_id} is already taken in the quorum (replicas "
                f"{', '.join(map(str, sorted(replicas)))}); give each replica its own --replica-id"
            )


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
