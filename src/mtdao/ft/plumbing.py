"""What mtdao adds to torchft's pieces: the replica's store on ``--bind-host``, the lighthouse, and
the errors a replica raises."""

from __future__ import annotations

import socket

import torch.distributed as dist

from mtdao.ft.lines import first_line
from mtdao.ft.security.torchft_internals import LighthouseServer


class ReplicaRefused(ValueError):
    """This replica may not join the quorum: its replica id is taken, or its config differs."""


class QuorumError(ConnectionError):
    """The lighthouse cannot be reached, or no quorum formed within the timeout."""


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
