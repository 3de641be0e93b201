"""A replica's heal server cannot be held by a caller: a request that never ends its headers is
closed after REQUEST_S, an endless header block is cut at HEAD_BYTES, connections past
CONNECTIONS are closed as they come, and a process out of file descriptors says so in one line
a minute and serves on (it used to be a ThreadingHTTPServer with no timeouts)."""

from __future__ import annotations

import errno
import socket
import socketserver
import time
from datetime import timedelta

import pytest

pytest.importorskip("torchft")

import mtdao.ft.security.safe_transport as safe_transport  # noqa: E402
from mtdao.ft.security.auth import RunKey  # noqa: E402

KEY = RunKey(b"0123456789abcdef0123")
# a request to a server in this process answers in milliseconds: these limits only stop a hang
LOCAL_S = 10.0


@pytest.fixture
def served(monkeypatch):
    monkeypatch.setattr(safe_transport.HealRequests, "timeout", 0.5)
    transport = safe_transport.SignedHealTransport(KEY, "127.0.0.1", timedelta(seconds=LOCAL_S))
    yield transport
    transport.shutdown()


def answer(address, request: bytes) -> bytes:
    with socket.create_connection(address, timeout=LOCAL_S) as connection:
        connection.sendall(request)
        received = b""
        while chunk := connection.recv(65536):
            received += chunk
    return received


def test_a_request_that_never_ends_its_headers_is_closed(served):
    started = time.monotonic()
    with socket.create_connection(served.address, timeout=LOCAL_S) as connection:
        connection.sendall(b"GET /heal/1 HTTP/1.1\r\nX-Slow: ")  # and nothing more
        assert connection.recv(65536) == b""  # closed, not a timeout of ours
    assert time.monotonic() - started < LOCAL_S / 2


def test_an_endless_header_block_is_cut_and_refused(served):
    header = b"X-Filler: " + b"y" * 1000 + b"\r\n"
    request = b"GET /heal/1 HTTP/1.1\r\n" + header * 64 + b"\r\n"  # 64 KiB of headers
    assert answer(served.address, request).startswith(b"HTTP/1.0 403")  # unsigned: cut there


def test_connections_past_the_cap_are_closed_and_the_server_serves_on(served, monkeypatch):
    # the holders stay while the rest are accepted (slowly, on a crowded machine)
    monkeypatch.setattr(safe_transport.HealRequests, "timeout", 6 * LOCAL_S)
    holders = [socket.create_connection(served.address) for _ in range(safe_transport.CONNECTIONS)]
    try:
        deadline = time.monotonic() + 3 * LOCAL_S
        while served._server._slots._value and time.monotonic() < deadline:
            time.sleep(0.01)
        assert served._server._slots._value == 0
        assert answer(served.address, b"GET /heal/1 HTTP/1.0\r\n\r\n") == b""  # closed at once
        assert served._server.turned_away >= 1
    finally:
        for holder in holders:
            holder.close()
    deadline = time.monotonic() + LOCAL_S
    while served._server._slots._value < safe_transport.CONNECTIONS and time.monotonic() < deadline:
        time.sleep(0.05)
    assert answer(served.address, b"GET /heal/1 HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 403")


def test_out_of_file_descriptors_is_said_once_a_minute_and_paces_the_accepts(monkeypatch):
    lines: list[str] = []
    server = safe_transport.HealServer("127.0.0.1", None, lines.append)
    monkeypatch.setattr(safe_transport, "DESCRIPTORS_PAUSE_S", 0.2)

    def out_of_descriptors(self):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(socketserver.TCPServer, "get_request", out_of_descriptors)
    try:
        started = time.monotonic()
        for _ in range(3):
            with pytest.raises(OSError):
                server.get_request()
        assert time.monotonic() - started >= 0.6  # a pause per failed accept: no busy loop
        assert len(lines) == 1 and "used all of its file descriptors" in lines[0]
    finally:
        server.server_close()
