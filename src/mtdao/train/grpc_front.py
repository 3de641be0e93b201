"""A front for torchft's lighthouse that lets its gRPC service through and nothing else.

torchft's lighthouse serves, on the port the replicas use, a web dashboard too: ``GET /status``
lists every replica with its manager and store addresses, and ``POST /replica/<id>/kill`` makes
the lighthouse stop that replica, with no authentication and no way to turn it off. So ``mtdao
lighthouse`` runs torchft's lighthouse on a loopback port of its own and serves the replicas'
address through this front, which forwards a connection only when it speaks HTTP/2 (gRPC) and
every request on it is a call of the lighthouse service (``/torchft.LighthouseService/...``,
checked in each request's headers before they are forwarded). A browser's or curl's HTTP/1
request gets a 403; a forbidden HTTP/2 request ends its connection.
"""

from __future__ import annotations

import contextlib
import socket
import threading

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
ALLOWED_PATH = b"/torchft.LighthouseService/"
HEADERS, CONTINUATION = 0x1, 0x9
END_HEADERS, PADDED, PRIORITY = 0x4, 0x8, 0x20
REFUSAL = (
    b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nConnection: close\r\n"
    b"Content-Length: 52\r\n\r\nthis lighthouse serves replicas only (no dashboard)\n"
)


class GrpcFront:
    """Listens on ``(host, port)`` and forwards allowed connections to ``upstream``."""

    def __init__(self, host: str, port: int, upstream: tuple[str, int]) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.create_server((host, port), family=family, backlog=128)
        self.upstream = upstream
        self.refused = 0
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self.listener.getsockname()[1]

    def shutdown(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with client:
            client.settimeout(30.0)
            preface = _read(client, len(PREFACE))
            if preface != PREFACE:
                self.refused += 1
                with contextlib.suppress(OSError):
                    client.sendall(REFUSAL)
                return
            client.settimeout(None)
            with socket.create_connection(self.upstream) as server:
                server.sendall(preface)
                back = threading.Thread(target=_copy, args=(server, client), daemon=True)
                back.start()
                if not self._forward_requests(client, server):
                    self.refused += 1
                for end in (client, server):
                    with contextlib.suppress(OSError):
                        end.shutdown(socket.SHUT_RDWR)
                back.join(timeout=5.0)

    def _forward_requests(self, client: socket.socket, server: socket.socket) -> bool:
        """Copy HTTP/2 frames from the client, checking each request's path before its headers
        go on; False at the first forbidden request."""
        decoder = hpack.Decoder()
        block, held = b"", b""
        while True:
            head = _read(client, 9)
            if len(head) < 9:
                return True
            length, kind, flags = int.from_bytes(head[:3], "big"), head[3], head[4]
            payload = _read(client, length)
            if len(payload) < length:
                return True
            if kind == HEADERS:
                block, held = _header_fragment(payload, flags), b""
            elif kind == CONTINUATION:
                block += payload
            if kind in (HEADERS, CONTINUATION):
                held += head + payload
                if not flags & END_HEADERS:
                    continue
                if not _allowed(decoder, block):
                    return False
                server.sendall(held)
                continue
            server.sendall(head + payload)


def _header_fragment(payload: bytes, flags: int) -> bytes:
    start, end = 0, len(payload)
    if flags & PADDED:
        start, end = 1, len(payload) - payload[0]
    if flags & PRIORITY:
        start += 5
    return payload[start:end]


def _allowed(decoder: hpack.Decoder, block: bytes) -> bool:
    try:
        headers = decoder.decode(block, raw=True)
    except hpack.HPACKError:
        return False
    paths = [value for name, value in headers if name == b":path"]
    return len(paths) == 1 and paths[0].startswith(ALLOWED_PATH)


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


def _copy(source: socket.socket, target: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while chunk := source.recv(65536):
            target.sendall(chunk)
    with contextlib.suppress(OSError):
        target.shutdown(socket.SHUT_WR)
