"""A front for one of torchft's gRPC servers that lets a fixed set of its calls through and
nothing else.

torchft's servers answer calls nobody authenticates and that mtdao cannot turn off: the
lighthouse's port also serves a web dashboard (``GET /status`` lists every replica's addresses,
``POST /replica/<id>/kill`` stops one), and every replica's manager serves the gRPC call
``torchft.ManagerService/Kill``, which ends the replica's process. So mtdao runs each such server
on a loopback address and serves the address its peers use through a :class:`GrpcFront`, which
forwards a connection only when it speaks HTTP/2 (gRPC) and each request on it calls one of the
allowed methods (its ``:path``, read from the request's headers before they are forwarded);
some of them may be served only to processes on this machine (``local_only``: a connection
whose source is a loopback address or the very address it reached), and some only when their
request message passes a check (``inspect``: the message is read whole before anything of the
request goes on, e.g. the lighthouse's check of a replica's signed claim). An HTTP/1 request gets
a 403; a forbidden HTTP/2 request ends its connection (from a host refused ten times within a
second, a connection refused at its first request ends after a second in which nothing more of
it goes on, so a flood is refused at that pace, not as fast as it can reconnect). Every refusal is
counted (``refused``) and reported in one line naming the front, the peer and what it asked for
(the first ten, then every tenfold count, so a flood cannot fill the log).

This module knows nothing of torchft: its users name the calls (``mtdao lighthouse``;
:mod:`mtdao.sync.torchft.manager_front`).
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import socket
import sys
import threading
import time
from collections.abc import Callable

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, CONTINUATION = 0x0, 0x1, 0x9
END_STREAM, END_HEADERS, PADDED, PRIORITY = 0x1, 0x4, 0x8, 0x20
MAX_INSPECTED_BYTES = 1 << 20  # a request message the front reads whole before it decides
REFUSAL_HOLD_S = 1.0
"""How long a refused HTTP/2 connection is held open before it ends (see GrpcFront._hold)."""
HOLD_AFTER = 10
"""Refusals of one host within a second from which its refused connections are held."""
MAX_HOSTS_TRACKED = 4096
SHOWN_PATH_CHARS = 80


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host`` (an address or a name; brackets allowed) and ``port``
    (0: any free one). Raises OSError."""
    host = host.strip("[]")
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.create_server(address[:2], family=family, backlog=128)
    return listener


class GrpcFront:
    """Serves ``listener`` and forwards each allowed connection to ``upstream`` (host, port).

    ``name`` says whose front it is in refusal lines (``lighthouse``, ``manager``); ``allowed``
    holds the full gRPC paths that may be called (``/package.Service/Method``), ``local_only``
    those of them served only to connections from this machine; ``inspect`` maps some of them
    to a check of the request's message (its protobuf bytes, and the peer) that returns whether
    it may go on (the check says why not itself); ``report`` receives each refusal line (by
    default, standard error)."""

    def __init__(
        self,
        name: str,
        listener: socket.socket,
        upstream: tuple[str, int],
        allowed: frozenset[bytes],
        report: Callable[[str], None] | None = None,
        local_only: frozenset[bytes] = frozenset(),
        inspect: dict[bytes, Callable[[bytes, object], bool]] | None = None,
    ) -> None:
        self.name, self.listener, self.upstream, self.allowed = name, listener, upstream, allowed
        self.local_only = local_only & allowed
        self.inspect = inspect or {}
        self.report = report or _to_stderr
        self.refusal_hold_s = REFUSAL_HOLD_S
        self.hold_after = HOLD_AFTER
        self._recent: dict[str, collections.deque] = {}  # each host's last refusal times
        self.refused = 0
        self._count_lock = threading.Lock()
        self._open: set[socket.socket] = set()  # the client's end of every connection served
        self._open_lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self.listener.getsockname()[1]

    @property
    def host(self) -> str:
        return self.listener.getsockname()[0]

    def shutdown(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()

    def end_connections(self) -> int:
        """End every connection forwarded now (a call waiting on one fails at once); the
        listener stays. How many were open."""
        with self._open_lock:
            ends = list(self._open)
        for end in ends:
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
        return len(ends)

    def _accept(self) -> None:
        while True:
            try:
                client, peer = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client, peer), daemon=True).start()

    def _serve(self, client: socket.socket, peer) -> None:
        with client:
            client.settimeout(30.0)
            preface = _read(client, len(PREFACE))
            if not preface:
                return  # it left without asking anything: a check that the port is open
            if preface != PREFACE:
                self._refuse(peer, "a request that is not HTTP/2 (gRPC)", self.allowed)
                with contextlib.suppress(OSError):
                    client.sendall(self._http1_refusal())
                return
            client.settimeout(None)
            with contextlib.suppress(OSError):  # frames go on one by one (see _Upstream)
                client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            server = _Upstream(self.upstream, client)
            with self._forwarding(client), server:
                local = from_this_machine(client, peer)
                allowed = self.allowed if local else self.allowed - self.local_only
                forbidden = None
                if server.send(preface):
                    forbidden = self._forward_requests(client, server, allowed, peer)
                if forbidden is not None and forbidden is not INSPECTED:
                    mine = forbidden in self.local_only
                    where = " (served to this machine's processes only)" if mine else ""
                    self._refuse(peer, f"a call of {_shown(forbidden)}{where}", allowed)
                if forbidden is not None and server.socket is None and self._flooding(peer):
                    self._hold(client)
                with contextlib.suppress(OSError):
                    client.shutdown(socket.SHUT_RDWR)

    def _flooding(self, peer) -> bool:
        """Whether ``peer``'s host had ``hold_after`` refusals within the last second, this one
        included: a replica's own first heartbeats, refused before its first quorum, are a few
        and go unheld; a flood is held."""
        host, now = peer[0] if isinstance(peer, tuple) else str(peer), time.monotonic()
        with self._count_lock:
            if len(self._recent) > MAX_HOSTS_TRACKED:  # many hosts: forget the quiet ones
                self._recent = {h: t for h, t in self._recent.items() if now - t[-1] < 1.0}
            recent = self._recent.setdefault(host, collections.deque(maxlen=self.hold_after))
            recent.append(now)
            return len(recent) == self.hold_after and now - recent[0] < 1.0

    def _hold(self, client: socket.socket) -> None:
        """Keep a connection refused at its first request open for ``refusal_hold_s``,
        forwarding nothing (what it sends meanwhile is dropped): a caller that asks again at
        once (a client retrying its call, a flood) is refused at that pace instead of as fast as
        it can reconnect, so refusals cost this process, and the machine, little. The peer
        closing, or ``end_connections``, ends the wait sooner."""
        deadline = time.monotonic() + self.refusal_hold_s
        with contextlib.suppress(OSError, ValueError):
            while (left := deadline - time.monotonic()) > 0:
                client.settimeout(left)
                if not client.recv(1 << 16):  # the peer closed
                    return

    @contextlib.contextmanager
    def _forwarding(self, client: socket.socket):
        with self._open_lock:
            self._open.add(client)
        try:
            yield
        finally:
            with self._open_lock:
                self._open.discard(client)

    def _forward_requests(
        self, client: socket.socket, server: _Upstream, allowed: frozenset[bytes], peer
    ) -> bytes | None:
        """Copy HTTP/2 frames from the client, checking each request's path before its headers
        go on (and its message, for an inspected path, before anything after them goes on); the
        first forbidden path, INSPECTED for a message its check refused (None: either side ended
        the connection)."""
        decoder = hpack.Decoder()
        block, held = b"", b""
        inspected: _Inspected | None = None  # a request held until its message is read
        while True:
            head = _read(client, 9)
            if len(head) < 9:
                return None
            length, kind, flags = int.from_bytes(head[:3], "big"), head[3], head[4]
            payload = _read(client, length)
            if len(payload) < length:
                return None
            if inspected is not None:  # everything waits behind it (header blocks keep order)
                inspected.hold(head + payload, kind, flags, payload)
                verdict = inspected.verdict()
                if verdict is None:
                    continue
                if not verdict:
                    return INSPECTED
                if not server.send(inspected.held):
                    return None
                inspected = None
                continue
            if kind == HEADERS:
                block, held = _header_fragment(payload, flags), b""
            elif kind == CONTINUATION:
                block += payload
            if kind in (HEADERS, CONTINUATION):
                held += head + payload
                if not flags & END_HEADERS:
                    continue
                path = _path(decoder, block)
                if path not in allowed:
                    return path
                if path in self.inspect:
                    stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
                    inspected = _Inspected(stream, held, lambda m, p=path: self.inspect[p](m, peer))
                    continue
                if not server.send(held):
                    return None
                continue
            if not server.send(head + payload):
                return None

    def _refuse(self, peer, what: str, allowed: frozenset[bytes]) -> None:
        with self._count_lock:
            self.refused += 1
            count = self.refused
        if count <= 10 or str(count).rstrip("0") == "1":
            where = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
            served = ", ".join(sorted(p.decode().rsplit("/", 1)[-1] for p in allowed))
            served = f"only {served} calls are" if served else "no call is"
            self.report(
                f"{self.name}'s front: refused {what} from {where}; {served} served to it "
                f"({count} refused so far)"
            )

    def _http1_refusal(self) -> bytes:
        body = f"this {self.name} serves torchft's gRPC calls only\n".encode()
        return (
            b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nConnection: close\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )


class _Upstream:
    """The connection to the server behind a front, opened when the client's first request goes
    on: what the client sent before it (the preface, its settings) is held until then, so a
    connection whose first request is refused (a stranger's flood) costs the server behind, and
    the front, no connection of their own. The server's answers are copied back to the client
    by a thread of their own."""

    def __init__(self, address: tuple[str, int], client: socket.socket) -> None:
        self.address, self.client = address, client
        self.socket: socket.socket | None = None
        self.pending = b""
        self._back: threading.Thread | None = None

    def send(self, data: bytes) -> bool:
        """Whether ``data`` went on (or is held until a request goes on)."""
        if self.socket is not None:
            return _send(self.socket, data)
        self.pending += data
        if data.startswith(PREFACE) or data[3:4] != bytes([HEADERS]):
            return True
        try:
            self.socket = socket.create_connection(self.address, timeout=30.0)
        except OSError:
            return False  # the server behind is gone: the client sees its connection end
        self.socket.settimeout(None)
        # frames are passed on one by one: without this, Nagle's algorithm holds each small
        # one until the last is acknowledged, 40 ms per call with delayed ACKs
        with contextlib.suppress(OSError):
            self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._back = threading.Thread(target=_copy, args=(self.socket, self.client), daemon=True)
        self._back.start()
        data, self.pending = self.pending, b""
        return _send(self.socket, data)

    def __enter__(self) -> _Upstream:
        return self

    def __exit__(self, *_: object) -> None:
        if self.socket is None:
            return
        with contextlib.suppress(OSError):
            self.socket.shutdown(socket.SHUT_RDWR)
        if self._back is not None:
            self._back.join(timeout=5.0)
        self.socket.close()


INSPECTED = b"(inspected)"
"""What :meth:`GrpcFront._forward_requests` returns for a request its check refused."""


class _Inspected:
    """One request held back until its gRPC message has arrived and been checked, with every
    frame the client sent behind it."""

    def __init__(self, stream: int, held: bytes, check: Callable[[bytes], bool]) -> None:
        self.stream, self.held, self.check = stream, held, check
        self.message, self.ended = b"", False

    def hold(self, frame: bytes, kind: int, flags: int, payload: bytes) -> None:
        self.held += frame
        stream = int.from_bytes(frame[5:9], "big") & 0x7FFFFFFF
        if kind == DATA and stream == self.stream:
            if flags & PADDED and payload:
                payload = payload[1 : len(payload) - payload[0]]
            self.message += payload
            self.ended = bool(flags & END_STREAM)

    def verdict(self) -> bool | None:
        """Whether the request may go on; None while its message is still coming."""
        message = self.message
        if len(message) >= 5:
            size = int.from_bytes(message[1:5], "big")
            if message[0] == 0 and len(message) >= 5 + size:  # not compressed, and whole
                return self.check(message[5 : 5 + size])
            if message[0] != 0 or size > MAX_INSPECTED_BYTES:
                return False
        return False if self.ended or len(self.held) > MAX_INSPECTED_BYTES else None


def from_this_machine(client: socket.socket, peer) -> bool:
    """Whether a connection comes from this machine: from a loopback address, or from the
    address it reached (Linux picks that as the source of a connection to a local address)."""
    if not isinstance(peer, tuple):
        return False
    try:
        source = ipaddress.ip_address(peer[0].split("%", 1)[0])
        return source.is_loopback or peer[0] == client.getsockname()[0]
    except (ValueError, OSError):
        return False


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _shown(path: bytes) -> str:
    """A requested path as a refusal line shows it: printable, and short."""
    text = path.decode("ascii", "backslashreplace")
    text = "".join(c if c.isprintable() else "?" for c in text) or "(no path)"
    return text if len(text) <= SHOWN_PATH_CHARS else text[:SHOWN_PATH_CHARS] + "..."


def _header_fragment(payload: bytes, flags: int) -> bytes:
    start, end = 0, len(payload)
    if flags & PADDED:
        start, end = 1, len(payload) - payload[0]
    if flags & PRIORITY:
        start += 5
    return payload[start:end]


def _path(decoder: hpack.Decoder, block: bytes) -> bytes:
    """The one ``:path`` of a header block (b'' when it has none, several, or does not
    decode)."""
    try:
        headers = decoder.decode(block, raw=True)
    except hpack.HPACKError:
        return b""
    paths = [value for name, value in headers if name == b":path"]
    return paths[0] if len(paths) == 1 else b""


def _read(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        try:
            chunk = connection.recv(size - len(data))
        except OSError:
            return data
        if not chunk:
            return data
        data += chunk
    return data


def _send(connection: socket.socket, data: bytes) -> bool:
    """Whether ``data`` went; a connection shut meanwhile (end_connections, a reset) is the
    connection ending, not an error."""
    try:
        connection.sendall(data)
    except OSError:
        return False
    return True


def _copy(source: socket.socket, target: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while chunk := source.recv(65536):
            target.sendall(chunk)
    with contextlib.suppress(OSError):
        target.shutdown(socket.SHUT_WR)
