"""A replica's line to the lighthouse, probed before and during each quorum since torchft's manager
neither finds a restarted lighthouse nor notices one that died under a waiting quorum (the replica
starts a new manager once it is back)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from mtdao.ft.collective_watch import accepts
from mtdao.ft.security.torchft_internals import Manager, ManagerInternals

if TYPE_CHECKING:
    from mtdao.ft.config import ReplicaConfig


def lighthouse_reachable(config: ReplicaConfig, timeout: float | None = None) -> bool:
    """Whether the lighthouse accepts a connection within ``timeout`` (the connect timeout)."""
    address = urlsplit(config.lighthouse_url)
    timeout = config.connect_timeout if timeout is None else timeout
    return accepts(address.hostname, address.port or 80, timeout)


WATCH_GRACE_S = 2.0  # most quorums end sooner: no probe at all
WATCH_EVERY_S = 1.0
WATCH_MISSES = 2  # failed probes in a row that mean the lighthouse is gone, not slow


@contextmanager
def watching_the_lighthouse(config: ReplicaConfig, manager: Manager) -> Iterator[threading.Event]:
    """While the block waits for a quorum, probe the lighthouse; once it is gone, end the calls
    waiting on this replica's manager server (its first process's) and set the event yielded."""
    lost, done = threading.Event(), threading.Event()
    server = ManagerInternals(manager).server  # a FrontedManagerServer
    probe_timeout = min(config.connect_timeout, 2.0)

    def watch() -> None:
        misses = 0
        done.wait(WATCH_GRACE_S)
        while not done.is_set():
            misses = 0 if lighthouse_reachable(config, probe_timeout) else misses + 1
            if misses >= WATCH_MISSES and not done.is_set():
                lost.set()
                server.end_calls()
                return
            done.wait(WATCH_EVERY_S)

    thread = threading.Thread(target=watch, name="mtdao-lighthouse-watch", daemon=True)
    if hasattr(server, "end_calls"):
        thread.start()
    try:
        yield lost
    finally:
        done.set()
        if thread.is_alive():
            thread.join()
