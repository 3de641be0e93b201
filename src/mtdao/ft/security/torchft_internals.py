"""Every use of torchft beyond its public API, and the only module that imports torchft: an
upgrade is checked against this module alone (tests/test_ft_torchft_internals.py)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# torchft's native side logs every quorum at INFO; keep the terminal for progress lines
os.environ.setdefault("RUST_LOG", "warn")

import torchft.manager  # noqa: E402
from torchft import Manager, ProcessGroupGloo  # noqa: E402
from torchft._torchft import LighthouseClient, LighthouseServer, ManagerServer  # noqa: E402
from torchft.checkpointing.transport import CheckpointTransport  # noqa: E402
from torchft.manager import REPLICA_ID_KEY  # noqa: E402
from torchft.process_group import (  # noqa: E402
    BaseProcessGroup,
    BaseProcessGroupGloo,
    create_store_client,
)

# torchft reports what went wrong to its manager, which hands it to us; its own log lines
# (tracebacks of every failed collective) would bury the one line that matters.
logging.getLogger("torchft").addHandler(logging.NullHandler())
logging.getLogger("torchft").propagate = False

WRITTEN_AGAINST = ("0.2.0",)  # the torchft versions whose private names are used here
NATIVE = ("LighthouseClient", "LighthouseServer", "ManagerServer")  # of torchft._torchft

__all__ = [
    "REPLICA_ID_KEY",
    "CheckpointTransport",
    "GlooGroup",
    "LighthouseClient",
    "LighthouseServer",
    "Manager",
    "ManagerInternals",
    "ManagerServer",
    "QuorumStepManager",
    "create_store_client",
    "replace_manager_server",
]


class _Private:
    """A private attribute of torchft's object, read and set under mtdao's name."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, internals: Any, owner: type | None = None) -> Any:
        return self if internals is None else getattr(internals.manager, self.name)

    def __set__(self, internals: Any, value: Any) -> None:
        setattr(internals.manager, self.name, value)


class ManagerInternals:
    """torchft's ``Manager``'s private state, as mtdao's quorum step reads and sets it."""

    store = _Private("_store")  # the replica's store (a TCPStore client)
    server = _Private("_manager")  # the manager's gRPC server (mtdao's fronted one)
    connect_timeout = _Private("_connect_timeout")
    timeout = _Private("_timeout")
    group_rank = _Private("_group_rank")  # this process's rank in its replica
    group_world_size = _Private("_group_world_size")  # the replica's processes
    commits = _Private("_step")  # rounds committed (torchft's step)
    commit_failures = _Private("_commit_failures")
    heal_transport = _Private("_checkpoint_transport")
    user_state_dicts = _Private("_user_state_dicts")
    process_group = _Private("_pg")
    healing = _Private("_healing")
    pending_state_dict = _Private("_pending_state_dict")
    replica_rank = _Private("_participating_replica_rank")
    replica_world_size = _Private("_participating_replica_world_size")
    quorum_id = _Private("_quorum_id")

    METHODS = {  # the private methods used (overridden or called), with their parameters
        "_async_quorum": ("allow_heal", "shrink_only", "quorum_timeout", "curr_device"),
        "_manager_state_dict": (),
    }

    def __init__(self, manager: Manager) -> None:
        self.manager = manager

    def state_to_serve(self) -> dict[str, Any]:
        """What a healing peer receives: torchft's commit count and every tracked state."""
        return self.manager._manager_state_dict()

    @classmethod
    def attributes(cls) -> dict[str, str]:
        """mtdao's name -> torchft's, of every private attribute used."""
        return {name: v.name for name, v in vars(cls).items() if isinstance(v, _Private)}


class QuorumStepManager(Manager):
    """torchft's ``Manager`` whose quorum step (its private ``_async_quorum``) is
    :meth:`quorum_step`; its private state is :attr:`internals`."""

    def __init__(self, **kwargs: Any) -> None:
        self.internals = ManagerInternals(self)  # before torchft's __init__: it may quorum
        super().__init__(**kwargs)

    def _async_quorum(
        self, allow_heal: bool, shrink_only: bool, quorum_timeout: timedelta, curr_device: int
    ) -> None:
        self.quorum_step(allow_heal, shrink_only, quorum_timeout)

    def quorum_step(self, allow_heal: bool, shrink_only: bool, quorum_timeout: timedelta) -> None:
        raise NotImplementedError


class GlooGroup(ProcessGroupGloo):
    """torchft's reconfigurable gloo group of each quorum's proven members, its sockets on
    ``bind_host``, the collectives in flight kept so that leaving never blocks."""

    PRIVATE = ("_pg", "_timeout", "_global_ranks")  # the private attributes used
    METHODS = {  # the private methods overridden, with their parameters
        "_wrap_work": ("work", "opts"),
        "_opts_hook": ("opts",),
        "_create_pg": ("store", "rank", "world_size"),
    }

    def __init__(
        self, bind_host: str, collective_timeout: timedelta, rendezvous_timeout: float
    ) -> None:
        super().__init__(timeout=timedelta(seconds=rendezvous_timeout))
        self.bind_host, self.collective_timeout = bind_host, collective_timeout
        self._in_flight: list[Any] = []  # futures of collectives that may still be running

    def abort(self, errored: bool = True) -> None:
        """Leave the current group. One with a collective still in flight (a lost peer's) is
        aborted in a thread that holds it until they end: torch's abort waits for them, and
        dropping it blocks the process in its destructor. Not a daemon: gloo would end the
        process."""
        group, self._pg = self._pg, None
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

    def _wrap_work(self, work: Any, opts: object) -> Any:
        self._in_flight = [f for f in self._in_flight if not f.done()]
        self._in_flight.append(work.get_future())
        return work

    def _opts_hook(self, opts: Any) -> Any:
        if hasattr(opts, "timeout") and opts.timeout.total_seconds() <= 0:
            opts.timeout = self.collective_timeout
        return opts

    def _create_pg(self, store, rank: int, world_size: int):
        """torchft's own, but with gloo's device on ``bind_host`` (torch's private API)."""
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


LEAVE_POLL_S = 0.05


def _leave_group(group: Any, pending: list[Any], linger_s: float) -> None:
    """Abort ``group`` and keep it until the collectives ``pending`` on it end, ``linger_s`` at
    most."""
    group.abort()
    deadline = time.monotonic() + linger_s
    while time.monotonic() < deadline and not all(future.done() for future in pending):
        time.sleep(LEAVE_POLL_S)


def replace_manager_server(start: Callable[..., Any]) -> None:
    """Make torchft's Manager start its gRPC server with ``start`` (it offers no other way)."""
    torchft.manager.ManagerServer = start
