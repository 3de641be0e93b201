"""A replica's torchft manager server on loopback, behind a front on ``--bind-host`` at the port
torchft advertises, serving only ``ShouldCommit`` from this machine (torchft's ``Kill`` cannot be
turned off): docs/security.md, "The replica's manager"."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from mtdao.ft.security.grpc_front import GrpcFront
from mtdao.ft.security.torchft_internals import ManagerServer, replace_manager_server

SERVICE = "/torchft.ManagerService/"
OWN_PROCESS_CALLS = frozenset({SERVICE + "ShouldCommit"})  # all it serves, to this machine only


class FrontUnavailable(Exception):
    """torchft's manager cannot be kept behind its front on this host."""


class FrontedManagerServer:
    """torchft's ``ManagerServer`` on loopback behind its front on the bind host; what torchft's
    ``Manager`` uses of its server (``address``, ``shutdown``)."""

    def __init__(self, server: Any, front: GrpcFront, internal: str) -> None:
        self.server, self.front, self.internal = server, front, internal

    def address(self) -> str:
        """torchft's ``http://host:port`` at the front's port: what the replica's other processes
        and its quorum requests are given (torchft's own quorum call, which would hand out the
        server's port, is refused at the front)."""
        return f"{self.server.address().rsplit(':', 1)[0]}:{self.front.port}"

    def shutdown(self) -> None:
        self.front.shutdown()
        self.server.shutdown()

    def end_calls(self) -> int:
        """Fail every call waiting on the server now (torchft's cannot); how many there were."""
        return self.front.end_calls()


def start_fronted(
    start_server: Callable[[str], Any], bind_host: str, port: int
) -> FrontedManagerServer:
    """``start_server(bind)`` (torchft's ``ManagerServer``) on a free loopback port, behind a
    front on ``bind_host`` at ``port`` (0: any free one). Raises FrontUnavailable."""
    try:
        front = GrpcFront(
            "manager", bind_host, port, OWN_PROCESS_CALLS, local_only=OWN_PROCESS_CALLS
        )
    except OSError as error:
        raise FrontUnavailable(
            f"cannot serve torchft's manager on {bind_host}:{port} ({error.strerror}): it is not "
            "started rather than serve its unauthenticated Kill call"
        ) from None
    loopback = "[::1]" if ":" in front.host else "127.0.0.1"  # the front's address family
    try:
        server = start_server(f"{loopback}:0")
    except BaseException:
        front.shutdown()
        raise
    internal = f"{loopback}:{server.address().rsplit(':', 1)[1]}"
    front.start(internal)
    return FrontedManagerServer(server, front, internal)


@contextmanager
def manager_bound_to(bind_host: str) -> Iterator[None]:
    """A Manager built in this thread meanwhile gets a :class:`FrontedManagerServer` on
    ``bind_host``, not torchft's on ``[::]``. The bind host is the thread's own: replicas may
    start in several threads of one process at once."""
    replace_manager_server(_server_for_this_thread)
    previous = getattr(_bound, "host", None)
    _bound.host = bind_host
    try:
        yield
    finally:
        _bound.host = previous


_bound = threading.local()


def _server_for_this_thread(**kwargs: Any) -> Any:
    host = getattr(_bound, "host", None)
    if host is None:
        return ManagerServer(**kwargs)
    port = int(kwargs["bind"].rsplit(":", 1)[1])
    start = lambda bind: ManagerServer(**{**kwargs, "bind": bind})  # noqa: E731
    return start_fronted(start, host, port)
