"""The listener of a replica's heal server: an HTTP server no caller can hold for long (caps on
connections, head size and time; survives running out of file descriptors)."""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from mtdao.ft.lines import to_stderr

CONNECTIONS = 64  # requests served at once (a replica's peers make one per process that heals)
REQUEST_S = 10.0  # from a connection's start to its request's last header
HEAD_BYTES = 16 << 10  # a request's line and headers (a heal request's are a few hundred bytes)
DESCRIPTORS_PAUSE_S = 1.0
SAY_EVERY_S = 60.0


class BoundedRequests(BaseHTTPRequestHandler):
    """A request handler whose request must arrive within REQUEST_S and HEAD_BYTES."""

    timeout = REQUEST_S

    def setup(self) -> None:
        super().setup()
        self.rfile = _Capped(self.rfile, HEAD_BYTES)

    def log_message(self, *args: Any) -> None:  # one access-log line per request otherwise
        pass


class BoundedHTTPServer(ThreadingHTTPServer):
    """A threaded HTTP server on ``address`` (``family``) that serves at most CONNECTIONS
    requests at once and survives running out of file descriptors; ``report`` receives its
    lines (by default, standard error)."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BoundedRequests],
        family: socket.AddressFamily,
        report: Callable[[str], None] | None = None,
    ) -> None:
        self.address_family = family
        super().__init__(address, handler)
        self.report = report or to_stderr
        self.turned_away = 0
        self._slots = threading.BoundedSemaphore(CONNECTIONS)
        self._said_at = -float("inf")

    def get_request(self):
        try:
            return super().get_request()
        except OSError as error:
            if error.errno in (errno.EMFILE, errno.ENFILE):
                self._out_of_descriptors()
            raise  # socketserver drops this one attempt and serves on

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.turned_away += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _out_of_descriptors(self) -> None:
        now = time.monotonic()
        if now - self._said_at >= SAY_EVERY_S:
            self._said_at = now
            self.report(
                f"heal server on port {self.server_address[1]}: this process has used all of its "
                "file descriptors; new connections wait until some close (raise the limit with "
                "ulimit -n, or firewall the port to the run's machines)"
            )
        time.sleep(DESCRIPTORS_PAUSE_S)  # the listener stays readable: no busy loop meanwhile


class _Capped:
    """A request's head (read by lines: a heal request has no body), ``budget`` bytes at most."""

    def __init__(self, raw, budget: int) -> None:
        self.raw, self.budget = raw, budget

    def readline(self, size: int = -1) -> bytes:
        if self.budget <= 0:
            return b""
        line = self.raw.readline(self.budget if size < 0 else min(size, self.budget))
        self.budget -= len(line)
        return line

    def close(self) -> None:
        self.raw.close()
