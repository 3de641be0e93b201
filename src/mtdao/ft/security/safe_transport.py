"""Heal state over HTTP that cannot carry code (``torch.load(weights_only=True)``, never torchft's
unpickling transport), requests and states signed over the quorum, sender, receiver, process and
step, served by an HTTP server no caller can hold for long (docs/security.md, "Heal state")."""

from __future__ import annotations

import errno
import hashlib
import io
import re
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.request import Request, urlopen

import torch

from mtdao.ft.lines import advertised_host, first_line, to_stderr
from mtdao.ft.security.auth import RunKey
from mtdao.ft.security.torchft_internals import CheckpointTransport

SIGNATURE_HEADER = "X-Mtdao-Signature"
RECEIVER_HEADER = "X-Mtdao-Receiver"
URL_PATTERN = re.compile(r"^http://[^/?#\s]+/heal/$")
QUORUM_SKEW_S = 5.0
"""How long a heal request signed for a quorum this replica has not opened yet waits for it."""
CONNECTIONS = 64  # requests served at once (a replica's peers make one per process that heals)
REQUEST_S = 10.0  # from a connection's start to its request's last header
HEAD_BYTES = 16 << 10  # a request's line and headers (a heal request's are a few hundred bytes)
DESCRIPTORS_PAUSE_S = 1.0
SAY_EVERY_S = 60.0


class HealRefused(ConnectionError):
    """A peer's heal state was not taken (unreachable, unsigned, not loadable)."""


@dataclass(frozen=True)
class HealBinding:
    """What a state and its request are bound to (``group_rank``: each process heals its own)."""

    digest: str
    source: str
    receiver: str
    group_rank: int
    step: int

    def fields(self) -> tuple[object, ...]:
        return (self.digest, self.source, self.receiver, self.group_rank, self.step)


@dataclass(frozen=True)
class Quorum:
    """The quorum this process serves in, and the members that may ask for its state."""

    digest: str
    member: str
    group_rank: int
    receivers: frozenset[str]


class SignedHealTransport(CheckpointTransport):
    def __init__(self, key: RunKey, bind_host: str, timeout: timedelta) -> None:
        self.key, self.timeout = key, timeout
        self.received_bytes = 0
        self.quorum: Quorum | None = None
        self._served: tuple[int, bytes, str] | None = None  # step, payload, its SHA-256
        self._ready = threading.Condition()
        self._server = HealServer(bind_host, self)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self._server.server_address[:2]

    def metadata(self) -> str:
        host, port = self._server.advertised, self._server.server_address[1]
        return f"http://{host}:{port}/heal/"

    def open(self, quorum: Quorum) -> None:
        """Answer requests signed for ``quorum`` from now on (they wait for its state)."""
        with self._ready:
            self.quorum = quorum
            self._ready.notify_all()

    def serve(self, step: int, state_dict: Any) -> None:
        """Serve ``state_dict`` (a CPU copy) at ``step`` until :meth:`disallow_checkpoint`."""
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        payload = buffer.getvalue()
        with self._ready:
            self._served = (step, payload, _sha(payload))
            self._ready.notify_all()

    def send_checkpoint(self, dst_ranks, step: int, state_dict: Any, timeout) -> None:
        raise NotImplementedError("a state is served bound to its quorum: serve()")

    def disallow_checkpoint(self) -> None:
        with self._ready:
            self._served = None  # the healed peers have it by now

    def verified(self, step: int, receiver: str, signature: str | None) -> HealBinding | None:
        """The binding of a verified request from a member of the quorum, else None; waits up to
        QUORUM_SKEW_S for a quorum its sender learned of first."""

        def binding() -> HealBinding | None:
            quorum = self.quorum
            if quorum is None or receiver not in quorum.receivers:
                return None
            bound = HealBinding(quorum.digest, quorum.member, receiver, quorum.group_rank, step)
            return bound if self.key.verifies(signature, "fetch", *bound.fields()) else None

        with self._ready:  # wait_for returns the binding once there is one, else None
            return self._ready.wait_for(binding, QUORUM_SKEW_S)

    def served(self, step: int) -> tuple[bytes, str] | None:
        """The state served at ``step`` and its SHA-256, once ready (None after the timeout)."""
        with self._ready:
            ready = self._ready.wait_for(
                lambda: self._served is not None and self._served[0] == step,
                self.timeout.total_seconds(),
            )
            return self._served[1:] if ready else None

    def fetch(self, url: str, binding: HealBinding, peer: str) -> Any:
        """The state ``peer`` serves at its heal address ``url`` for ``binding``, or HealRefused."""
        if not isinstance(url, str) or not URL_PATTERN.match(url):
            raise HealRefused(f"not healing from {peer}: its heal address {url!r} is no URL")
        url = f"{url}{binding.step}"
        headers = {
            SIGNATURE_HEADER: self.key.sign("fetch", *binding.fields()),
            RECEIVER_HEADER: binding.receiver,
        }
        try:
            with urlopen(Request(url, headers=headers), timeout=self.timeout.total_seconds()) as r:
                signature, payload = r.headers.get(SIGNATURE_HEADER), r.read()
        except OSError as error:
            raise HealRefused(f"{peer} at {url} did not send its state: {error}") from None
        if not self.key.verifies(signature, "heal", *binding.fields(), _sha(payload)):
            raise HealRefused(
                f"{peer} at {url} sent a state not signed for this quorum and this replica with "
                "this run's secret: refused, nothing of it was read"
            )
        try:
            state = torch.load(io.BytesIO(payload), weights_only=True)
        except Exception as error:  # signed, yet damaged: a faulty member, not an attack
            raise HealRefused(
                f"{peer} sent a state that does not load: {first_line(error, 200)}"
            ) from None
        self.received_bytes = len(payload)
        return state

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout) -> Any:
        raise NotImplementedError("a state is fetched bound to its quorum: fetch()")

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join()


class HealRequests(BaseHTTPRequestHandler):
    """``GET /heal/<step>``, signed for this quorum, this source and the receiver it names; the
    request must arrive within REQUEST_S and HEAD_BYTES."""

    server: Any
    timeout = REQUEST_S

    def setup(self) -> None:
        super().setup()
        self.rfile = _Capped(self.rfile, HEAD_BYTES)

    def log_message(self, *args: Any) -> None:  # one access-log line per request otherwise
        pass

    def do_GET(self) -> None:
        transport: SignedHealTransport = self.server.transport
        match = re.fullmatch(r"/heal/(\d+)", self.path)
        if match is None:
            self.send_error(404)
            return
        step, receiver = int(match.group(1)), self.headers.get(RECEIVER_HEADER, "")
        binding = transport.verified(step, receiver, self.headers.get(SIGNATURE_HEADER))
        if binding is None:
            self.send_error(403, "not signed for this quorum with this run's secret")
            return
        served = transport.served(step)
        if served is None:
            self.send_error(409, f"no state served for step {step}")
            return
        payload, sha = served
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(payload)))
        self.send_header(SIGNATURE_HEADER, transport.key.sign("heal", *binding.fields(), sha))
        self.end_headers()
        self.connection.settimeout(transport.timeout.total_seconds())  # a state takes a while
        self.wfile.write(payload)


class HealServer(ThreadingHTTPServer):
    """The heal server of ``transport`` on ``bind_host`` (a free port): at most CONNECTIONS
    requests at once, and it survives running out of file descriptors (``report``: its lines)."""

    daemon_threads = True

    def __init__(self, bind_host: str, transport: Any, report=to_stderr) -> None:
        host = bind_host.strip("[]")
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, 0), HealRequests)
        self.transport, self.advertised = transport, advertised_host(bind_host)
        self.report = report
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


def _sha(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()
