"""A replica's line to the run: its fronted torchft manager, and the lighthouse, probed before and
during each quorum since torchft's manager neither finds a restarted lighthouse nor notices one
that died under a waiting quorum (a new manager is started once it is back)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from mtdao.ft.collective_watch import accepts
from mtdao.ft.lines import first_line
from mtdao.ft.security.manager_front import FrontUnavailable, manager_bound_to
from mtdao.ft.security.proven_manager import ProvenManager
from mtdao.ft.security.torchft_internals import Manager, ManagerInternals

if TYPE_CHECKING:
    from mtdao.ft.config import ReplicaConfig
    from mtdao.ft.identity import ReplicaIdentity
    from mtdao.ft.shards import ReplicaProcesses


class ManagerOwner(Protocol):
    """What starting a manager reads of the replica's groups (``ReplicaGroups``)."""

    config: ReplicaConfig
    processes: ReplicaProcesses
    identity: ReplicaIdentity
    allow_non_finite: bool
    process_group: Any
    collective_timeout: timedelta
    heal_transport: Any


HEARTBEAT_INTERVAL_S = 0.1


def start_manager(
    replicas: ManagerOwner, store_host: str, store_port: int
) -> tuple[Manager | None, str | None]:
    """This process's torchft manager for ``replicas``, or the reason it could not start."""
    config, processes = replicas.config, replicas.processes
    with manager_bound_to(config.bind_host):
        try:
            manager = ProvenManager(  # its quorums hold proven members only
                identity=replicas.identity,
                allow_non_finite=replicas.allow_non_finite,
                pg=replicas.process_group,
                load_state_dict=None,
                state_dict=None,
                min_replica_size=1,
                use_async_quorum=False,  # heal before the step, not during it
                timeout=replicas.collective_timeout,
                quorum_timeout=timedelta(seconds=config.quorum_timeout),
                connect_timeout=timedelta(seconds=config.connect_timeout),
                rank=processes.rank,
                world_size=processes.size,
                store_addr=store_host,
                store_port=store_port,
                lighthouse_addr=config.lighthouse_url,
                replica_id=str(config.replica_id),
                hostname=store_host,
                heartbeat_interval=timedelta(seconds=HEARTBEAT_INTERVAL_S),
                checkpoint_transport=replicas.heal_transport,
            )
        except FrontUnavailable as error:
            return None, str(error)
        except RuntimeError as error:
            reason = first_line(error).rsplit(": ", 1)[-1]  # the innermost cause
            if processes.rank > 0:
                return None, f"cannot reach this replica's manager on {store_host} ({reason})"
            return None, (
                f"cannot reach the lighthouse at {config.lighthouse_url} within "
                f"--connect-timeout {config.connect_timeout:g} s ({reason})"
            )
    return manager, None


def listeners(manager: Manager, transport, store) -> str:
    """Where a process serves (a replica's first process, ``store`` given: manager and store)."""
    heal_host, heal_port = transport.address
    parts = [f"heal state {heal_host}:{heal_port}"]
    if store is not None:
        server = ManagerInternals(manager).server  # a FrontedManagerServer
        served = server.address().split("://")[-1]
        behind = f"a front refusing Kill, torchft's server behind it on {server.internal}"
        parts = [f"manager {served} ({behind})", f"store port {store.port}", *parts]
    return ", ".join(parts) + " (collectives on the same address)"


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
