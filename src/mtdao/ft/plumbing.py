"""What mtdao adds to torchft's pieces: a process group of each quorum's proven members (bounded
rendezvous, sockets on ``--bind-host``), the store, and the errors a replica raises."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from mtdao.ft.lines import first_line
from mtdao.ft.security.torchft_internals import GlooGroup, LighthouseServer


class ReplicaRefused(ValueError):
    """This replica may not join the quorum: its replica id is taken, or its config differs."""


class QuorumError(ConnectionError):
    """The lighthouse cannot be reached, or no quorum formed within the timeout."""


@dataclass
class QuorumView:
    replicas: list[int] = field(default_factory=list)
    rank: int = 0
    quorum_id: int = -1


LEAVE_POLL_S = 0.05


def _leave_group(group: Any, pending: list[Any], linger_s: float) -> None:
    """Abort ``group`` and keep it until the collectives ``pending`` on it end, ``linger_s`` at
    most."""
    group.abort()
    deadline = time.monotonic() + linger_s
    while time.monotonic() < deadline and not all(future.done() for future in pending):
        time.sleep(LEAVE_POLL_S)


class MembershipGloo(GlooGroup):
    """torchft's reconfigurable gloo group of each quorum's proven members, on ``bind_host``."""

    def __init__(
        self, bind_host: str, collective_timeout: timedelta, rendezvous_timeout: float
    ) -> None:
        super().__init__(bind_host, collective_timeout, rendezvous_timeout)
        self._in_flight: list[Any] = []  # futures of collectives that may still be running

    def abort(self, errored: bool = True) -> None:
        """Leave the current group. One with a collective still in flight (a lost peer's) is
        aborted in a thread that holds it until they end: torch's abort waits for them, and
        dropping it blocks the process in its destructor. Not a daemon: gloo would end the
        process."""
        group = self.take_group()
        pending, self._in_flight = [f for f in self._in_flight if not f.done()], []
        if group is None:
            return
        if not pending:
            group.abort()
            return
        linger_s = self.collective_timeout.total_seconds()
        threading.Thread(
            target=_leave_group, args=(group, pending, linger_s), name="mtdao-gloo-leave"
        ).start()

    def launched(self, work: Any) -> None:
        """Remember the collectives in flight (see :meth:`abort`)."""
        self._in_flight = [f for f in self._in_flight if not f.done()]
        self._in_flight.append(work.get_future())


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


def start_lighthouse(
    bind: str,
    min_replicas: int,
    join_timeout: float,
    heartbeat_timeout: float,
    quorum_tick: float = 0.1,
):
    """torchft's lighthouse, serving in background threads; ``.address()`` and ``.shutdown()``."""
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
