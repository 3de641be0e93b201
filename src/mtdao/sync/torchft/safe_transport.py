"""Heal state over HTTP that cannot carry code, from proven peers only.

torchft's own HTTP transport unpickles what a peer sends (``weights_only=False``): a process that
joins a quorum claiming a later step runs code in every replica that heals from it. This transport
replaces it. A state is sent as ``torch.save`` bytes of tensors and plain data, signed with the
run's secret (HMAC over the step and the bytes); the receiver checks the signature before reading
a byte of it and reads it with ``torch.load(weights_only=True)``, which builds tensors and plain
containers only. A request for a state must be signed too (the state is the model). It serves on
the replica's ``--bind-host``.

Before fetching, the transport asks its ``judge`` about the peer torchft chose as the source:
``take`` its state, ``keep`` this replica's own (the source is not a proven member, and this
replica is at the round's reference: nothing to heal), or ``refuse`` (raise :class:`HealRefused`,
so this replica's round fails and it heals at a later quorum).
"""

from __future__ import annotations

import hashlib
import io
import re
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.request import Request, urlopen

import torch
from torchft.checkpointing.transport import CheckpointTransport

from mtdao.sync.torchft.auth import RunKey

SIGNATURE_HEADER = "X-Mtdao-Signature"
URL_PATTERN = re.compile(r"^http://[^/?#\s]+/heal/$")


class HealRefused(ConnectionError):
    """A peer's heal state was not taken: the peer did not prove it belongs to the run."""


class KeepOwnState(dict):
    """The 'user' part of a heal that keeps every tracked state as it is."""

    def __missing__(self, key: str) -> KeepOwnState:
        return self


def keeps_own_state(state: Any) -> bool:
    return isinstance(state, KeepOwnState)


class SignedHealTransport(CheckpointTransport):
    def __init__(
        self,
        key: RunKey,
        bind_host: str,
        timeout: timedelta,
        judge: Callable[[int], tuple[str, str]],
    ) -> None:
        self.key, self.judge, self.timeout = key, judge, timeout
        self.received_bytes = 0
        self.own_progress: Callable[[], dict] = lambda: {"step": 0, "batches_committed": 0}
        self._served: tuple[int, bytes, str] | None = None  # step, payload, signature
        self._ready = threading.Condition()
        self._server = _server(bind_host, self)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self._server.server_address[:2]

    def metadata(self) -> str:
        host, port = self._server.advertised, self._server.server_address[1]
        return f"http://{host}:{port}/heal/"

    def send_checkpoint(self, dst_ranks, step: int, state_dict: Any, timeout) -> None:
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        payload = buffer.getvalue()
        with self._ready:
            self._served = (step, payload, self.key.sign("heal", step, _sha(payload)))
            self._ready.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._ready:
            self._served = None  # the healed peers have it by now

    def served(self, step: int) -> tuple[bytes, str] | None:
        """The state for ``step``, once it is ready (None after the timeout)."""
        with self._ready:
            ready = self._ready.wait_for(
                lambda: self._served is not None and self._served[0] == step,
                self.timeout.total_seconds(),
            )
            return self._served[1:] if ready else None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout) -> Any:
        verdict, peer = self.judge(src_rank)
        if verdict == "keep":
            return {"torchft": self.own_progress(), "user": KeepOwnState()}
        if verdict == "refuse":
            raise HealRefused(f"not healing from {peer}")
        if not isinstance(metadata, str) or not URL_PATTERN.match(metadata):
            raise HealRefused(f"not healing from {peer}: its heal address {metadata!r} is no URL")
        url = f"{metadata}{step}"
        request = Request(url, headers={SIGNATURE_HEADER: self.key.sign("fetch", step)})
        try:
            with urlopen(request, timeout=timeout.total_seconds()) as response:
                signature, payload = response.headers.get(SIGNATURE_HEADER), response.read()
        except OSError as error:
            raise HealRefused(f"{peer} at {url} did not send its state: {error}") from None
        if not self.key.verifies(signature, "heal", step, _sha(payload)):
            raise HealRefused(
                f"{peer} at {url} sent a state not signed with this run's secret (wrong or "
                "missing --auth-token-file / $MTDAO_AUTH_TOKEN): refused, nothing of it was read"
            )
        state = torch.load(io.BytesIO(payload), weights_only=True)
        self.received_bytes = len(payload)
        return state

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join()


class HealRequests(BaseHTTPRequestHandler):
    """``GET /heal/<step>`` with a signed request: the state served for that step."""

    server: Any

    def do_GET(self) -> None:
        transport: SignedHealTransport = self.server.transport
        match = re.fullmatch(r"/heal/(\d+)", self.path)
        if match is None:
            self.send_error(404)
            return
        step = int(match.group(1))
        if not transport.key.verifies(self.headers.get(SIGNATURE_HEADER), "fetch", step):
            self.send_error(403, "not signed with this run's secret")
            return
        served = transport.served(step)
        if served is None:
            self.send_error(409, f"no state served for step {step}")
            return
        payload, signature = served
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(payload)))
        self.send_header(SIGNATURE_HEADER, signature)
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:  # one access-log line per request otherwise
        pass


def _server(bind_host: str, transport: SignedHealTransport) -> ThreadingHTTPServer:
    host = bind_host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_class = type("HealServer", (ThreadingHTTPServer,), {"address_family": family})
    server = server_class((host, 0), HealRequests)
    server.daemon_threads = True
    server.transport = transport
    server.advertised = advertised_host(bind_host)
    return server


def advertised_host(bind_host: str) -> str:
    """The address peers reach a listener on ``bind_host`` at (this host's name when it serves
    on every interface)."""
    host = bind_host.strip("[]")
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


def _sha(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()
