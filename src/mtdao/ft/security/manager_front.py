"""A replica's torchft manager server on loopback, behind a front on ``--bind-host`` at the port
torchft advertises, serving only ``ShouldCommit`` from this machine (torchft's ``Kill`` cannot be
turned off): docs/security.md, "The replica's manager"."""

from __future__ import annotations

import ipaddress
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from mtdao.ft.security.grpc_front import GrpcFront, numeric_host
from mtdao.ft.security.torchft_internals import ManagerServer, replace_manager_server

SERVICE = "/torchft.ManagerService/"
OWN_PROCESS_CALLS = frozenset({SERVICE + "ShouldCommit"})  # all it serves, to this machine only
LOOPBACK_CANDIDATES = ("127.0.0.1", "127.0.0.2", "::1")
PORT_ATTEMPTS = 20


class FrontUnavailable(Exception):
    """torchft's manager cannot be kept behind its front on this host."""


def loopbacks_beside(front_host: str) -> list[str]:
    """The loopback addresses on which a server can share a port with a front on
    ``front_host`` (an IP address), best first."""
    front = ipaddress.ip_address(front_host.split("%", 1)[0])
    if front.is_unspecified:  # 0.0.0.0 covers all of IPv4, :: everything
        return ["::1"] if front.version == 4 else []
    return [h for h in LOOPBACK_CANDIDATES if ipaddress.ip_address(h) != front]


class FrontedManagerServer:
    """torchft's ``ManagerServer`` on loopback and its front on the bind host, at one port; what
    torchft's ``Manager`` uses of its server (``address``, ``shutdown``)."""

    def __init__(self, server: Any, front: GrpcFront, internal: str) -> None:
        self.server, self.front, self.internal = server, front, internal

    def address(self) -> str:
        return self.server.address()

    def shutdown(self) -> None:
        self.front.shutdown()
        self.server.shutdown()

    def end_calls(self) -> int:
        """Fail every call waiting on the server now (torchft's cannot); how many there were."""
        return self.front.end_calls()


def start_fronted(
    start_server: Callable[[str], Any], bind_host: str, port: int
) -> FrontedManagerServer:
    """``start_server(bind)`` (torchft's ``ManagerServer``) behind a front on ``bind_host`` at
    ``port`` (0: any free one). Raises FrontUnavailable."""
    last = "none was usable"
    beside = loopbacks_beside(numeric_host(bind_host))
    for _ in range(1 if port else PORT_ATTEMPTS):
        for internal in beside:
            try:
                held = _hold_port(internal, port)
            except OSError as error:
                last = f"{internal} port {port}: {(error.strerror or str(error)).lower()}"
                continue
            chosen = held.getsockname()[1]
            bind = f"[{internal}]:{chosen}" if ":" in internal else f"{internal}:{chosen}"
            try:
                front = GrpcFront(
                    "manager", bind_host, chosen, OWN_PROCESS_CALLS, local_only=OWN_PROCESS_CALLS
                )
            except OSError as error:
                if port:
                    raise FrontUnavailable(
                        f"cannot serve torchft's manager on {bind_host}:{port}: {error.strerror}"
                    ) from None
                last = f"{bind_host}:{chosen}: {error.strerror}"
                continue
            finally:
                held.close()
            try:
                server = start_server(bind)
            except RuntimeError as error:
                front.shutdown()
                if "os error 98" not in str(error):  # not EADDRINUSE: the lighthouse, say
                    raise
                last = f"{bind}: address already in use"
                continue
            front.start(bind)
            return FrontedManagerServer(server, front, bind)
        if not beside:
            last = "it covers every loopback address"
            break
    raise FrontUnavailable(
        f"cannot keep torchft's manager behind its front on {bind_host}: no loopback address "
        f"beside it could take the front's port (last: {last}); it is not started rather than "
        "serve its unauthenticated Kill call"
    )


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


def _hold_port(host: str, port: int) -> socket.socket:
    """A socket listening on ``host``:``port`` (0: any free port), to hold it. Raises OSError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    held = socket.socket(family, socket.SOCK_STREAM)
    try:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # torchft's server takes it
        held.bind((host, port))
        held.listen(1)
    except OSError:
        held.close()
        raise
    return held
