"""mtdao's gRPC front (mtdao.sync.grpc_front) and the torchft manager behind one
(mtdao.sync.torchft.manager_front), on loopback:

* an allowed call reaches the server behind; a call of another method (torchft's Kill) ends the
  connection before its headers reach it, and is counted and reported in one line; so is an
  HTTP/1 request, which gets a 403;
* torchft's real ManagerServer behind the front: a client's call goes through, at once (no
  Nagle delay), Kill sent to the front leaves the process running, Kill sent to the server itself ends it (the request is
  torchft's real Kill);
* the front can end every connection it forwards (a call waiting on the server fails at once)
  and serves new ones after;
* where the server behind a front on each kind of host goes.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import subprocess
import sys
import textwrap
import threading
import time

import pytest

hpack = pytest.importorskip("hpack")

from grpc_calls import (  # noqa: E402
    END_HEADERS,
    END_STREAM,
    HEADERS,
    KILL,
    PREFACE,
    SETTINGS,
    frame,
    grpc_call,
    headers_frames,
    http2_request,
    kill_request,
)
from wait_limits import first_line, limit_s  # noqa: E402

from mtdao.sync.grpc_front import GrpcFront, listen  # noqa: E402
from mtdao.testing.fault_drill import EXIT_AFTER_SIGNAL_S  # noqa: E402

QUORUM = "/torchft.ManagerService/Quorum"
ALLOWED = frozenset({QUORUM.encode()})
# connecting to a server on this machine, already listening, or seeing the front take a connection
# up or down: milliseconds; these limits only stop a hang
LOCAL_S = 10


class Recorder:
    """A server that keeps everything each connection sends it, and answers nothing."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.received: list[bytes] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> tuple[str, int]:
        return self.listener.getsockname()[:2]

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            self.received.append(b"")
            index = len(self.received) - 1
            threading.Thread(target=self._keep, args=(connection, index), daemon=True).start()

    def headers(self) -> int:
        """The requests that reached this server, once what is in flight has landed."""
        time.sleep(0.3)
        return sum(headers_frames(received) for received in self.received)

    def _keep(self, connection: socket.socket, index: int) -> None:
        with connection:
            while chunk := connection.recv(65536):
                self.received[index] += chunk


@pytest.fixture
def front():
    recorder, lines = Recorder(), []
    front = GrpcFront("manager", listen("127.0.0.1", 0), recorder.address, ALLOWED, lines.append)
    yield front, recorder, lines, f"127.0.0.1:{front.port}"
    front.shutdown()
    recorder.listener.close()


def test_an_allowed_call_is_forwarded(front):
    front, recorder, lines, address = front
    http2_request(address, "POST", QUORUM, b"\x08\x01", timeout=1.0)
    assert recorder.headers() == 1
    forwarded = b"".join(recorder.received)
    assert forwarded.startswith(PREFACE) and headers_frames(forwarded) == 1
    assert forwarded.endswith(b"\x00\x00\x00\x00\x02\x08\x01")  # the call's message after it
    assert front.refused == 0 and lines == []


def test_kill_is_refused_before_it_reaches_the_server(front):
    front, recorder, lines, address = front
    received = grpc_call(address, KILL, kill_request())
    assert headers_frames(received) == 0  # no answer: the connection ended
    assert recorder.headers() == 0  # Kill's headers never went on
    assert front.refused == 1
    (line,) = lines
    assert line.startswith(f"manager's front: refused a call of {KILL} from 127.0.0.1:")
    assert line.endswith("only Quorum calls are served to it (1 refused so far)")


def test_a_flood_of_refused_connections_is_held_before_each_ends(front):
    """From a host refused ``hold_after`` times within a second, a connection refused at its
    first call is held before it ends, so a flood is refused at that pace, not as fast as it
    can reconnect (a 200-id flood on a loopback run kept 40% of its pace so, 75-86% held); the
    few first heartbeats of a replica not yet in a quorum are answered at once."""
    front, recorder, lines, address = front
    front.refusal_hold_s, front.hold_after = 0.5, 3

    def refused_in() -> float:
        started = time.monotonic()
        assert headers_frames(grpc_call(address, KILL, kill_request())) == 0
        return time.monotonic() - started

    first, second, third = refused_in(), refused_in(), refused_in()
    assert first < 0.45 and second < 0.45 and 0.45 <= third < 5.0
    assert front.refused == 3
    front.refusal_hold_s = 30.0  # ending the connections ends a hold at once
    caller = threading.Thread(target=grpc_call, args=(address, KILL, kill_request()))
    caller.start()
    time.sleep(0.5)
    assert caller.is_alive() and front.end_connections() == 1
    caller.join(timeout=5.0)
    assert not caller.is_alive() and recorder.headers() == 0


def test_kill_after_an_allowed_call_ends_the_connection_there(front):
    front, recorder, lines, address = front
    encoder = hpack.Encoder()  # one connection, one header table: the front must follow it
    headers = [(":method", "POST"), (":scheme", "http"), (":authority", "x")]
    frames = PREFACE + frame(SETTINGS, 0, 0, b"")
    for stream, path in ((1, QUORUM), (3, KILL), (5, QUORUM)):
        block = encoder.encode([*headers, (":path", path)])
        frames += frame(HEADERS, END_HEADERS | END_STREAM, stream, block)
    with socket.create_connection(("127.0.0.1", front.port), timeout=LOCAL_S) as connection:
        connection.sendall(frames)
        while connection.recv(65536):
            pass
    time.sleep(0.2)
    assert recorder.headers() == 1  # the first Quorum only
    assert front.refused == 1 and KILL in lines[0]


def test_ending_the_connections_fails_a_waiting_call_and_the_front_serves_on(front):
    front, recorder, lines, address = front
    waiting = socket.create_connection(("127.0.0.1", front.port), timeout=LOCAL_S)
    waiting.sendall(PREFACE + frame(SETTINGS, 0, 0, b""))  # a call the server never answers
    deadline = time.time() + LOCAL_S
    while not front._open and time.time() < deadline:
        time.sleep(0.01)
    started = time.perf_counter()
    assert front.end_connections() == 1
    with waiting:
        assert waiting.recv(65536) == b""  # its connection ended, not a timeout
    assert time.perf_counter() - started < 1.0
    http2_request(address, "POST", QUORUM, b"\x08\x01", timeout=1.0)  # a new call goes through
    assert recorder.headers() == 1 and front.refused == 0


def test_connections_ended_before_the_first_frame_goes_on_end_quietly(front, monkeypatch):
    """end_connections may shut a connection the moment it is registered, before the front has
    sent the client's preface on: the forwarding thread then finds its sockets shut, which is the
    connection ending, not an error of the thread."""
    front, recorder, lines, address = front
    errors = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    register = front._forwarding

    @contextlib.contextmanager
    def register_then_end(client):
        with register(client):
            front.end_connections()
            yield

    monkeypatch.setattr(front, "_forwarding", register_then_end)
    with socket.create_connection(("127.0.0.1", front.port), timeout=LOCAL_S) as waiting:
        waiting.sendall(PREFACE + frame(SETTINGS, 0, 0, b""))
        assert waiting.recv(65536) == b""
    deadline = time.time() + LOCAL_S
    while front._open and time.time() < deadline:
        time.sleep(0.01)
    assert not front._open and [e.exc_value for e in errors] == []
    assert recorder.headers() == 0 and front.refused == 0 and lines == []


def test_calls_for_this_machine_only_are_refused_to_others(monkeypatch):
    import mtdao.sync.grpc_front as grpc_front

    metadata = "/torchft.ManagerService/CheckpointMetadata"
    recorder, lines = Recorder(), []
    allowed = frozenset({QUORUM.encode(), metadata.encode()})
    front = GrpcFront(
        "manager", listen("127.0.0.1", 0), recorder.address, allowed, lines.append,
        local_only=frozenset({QUORUM.encode()}),
    )  # fmt: skip
    address = f"127.0.0.1:{front.port}"
    try:
        http2_request(address, "POST", QUORUM, b"", timeout=1.0)  # from here: served
        assert recorder.headers() == 1 and lines == []
        monkeypatch.setattr(grpc_front, "from_this_machine", lambda *_: False)
        http2_request(address, "POST", QUORUM, b"", timeout=1.0)
        http2_request(address, "POST", metadata, b"", timeout=1.0)
        assert recorder.headers() == 2  # the second Quorum did not go
        (line,) = lines
        assert f"refused a call of {QUORUM} (served to this machine's processes only)" in line
        assert line.endswith("only CheckpointMetadata calls are served to it (1 refused so far)")
    finally:
        front.shutdown()
        recorder.listener.close()


def test_a_connection_from_this_machine_is_told_apart():
    from mtdao.sync.grpc_front import from_this_machine

    listener = listen("127.0.0.1", 0)
    with socket.create_connection(listener.getsockname()), listener.accept()[0] as accepted:
        assert from_this_machine(accepted, accepted.getpeername())
        assert not from_this_machine(accepted, ("192.0.2.7", 1))  # as if from elsewhere
    listener.close()


def test_http1_gets_a_403_and_is_reported(front):
    front, recorder, lines, address = front
    with socket.create_connection(("127.0.0.1", front.port), timeout=LOCAL_S) as connection:
        connection.sendall(b"POST /replica/0/kill HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = connection.recv(65536)
    assert answer.startswith(b"HTTP/1.1 403 Forbidden")
    assert b"this manager serves torchft's gRPC calls only" in answer
    assert front.refused == 1 and "a request that is not HTTP/2 (gRPC)" in lines[0]
    assert recorder.received == []


def test_a_connection_that_asks_nothing_is_no_refusal(front):
    front, recorder, lines, address = front
    socket.create_connection(("127.0.0.1", front.port), timeout=LOCAL_S).close()  # a port check
    assert recorder.headers() == 0 and front.refused == 0 and lines == []


def test_a_flood_of_refusals_is_reported_in_a_few_lines(front):
    front, recorder, lines, address = front
    for _ in range(120):
        front._refuse(("127.0.0.1", 1), "a call of /x", ALLOWED)
    assert front.refused == 120 and len(lines) == 11 and "(100 refused so far)" in lines[-1]


SERVE_A_MANAGER = textwrap.dedent(
    """
    import sys, time
    from datetime import timedelta
    from torchft._torchft import ManagerServer
    from mtdao.sync.torchft import start_lighthouse
    from mtdao.sync.torchft.manager_front import start_fronted
    from mtdao.sync.torchft.safe_transport import advertised_host

    lighthouse = start_lighthouse("127.0.0.1:0", 1, 10.0, 5.0)
    def server(bind):
        return ManagerServer(
            replica_id="r", lighthouse_addr=lighthouse.address(),
            hostname=advertised_host(sys.argv[1]),
            bind=bind, store_addr="127.0.0.1:1", world_size=1,
            heartbeat_interval=timedelta(seconds=1), connect_timeout=timedelta(seconds=10),
            quorum_retries=0,
        )
    fronted = start_fronted(server, sys.argv[1], 0)
    print(fronted.address().split("://")[1], fronted.internal, flush=True)
    time.sleep(120)
    """
)


def serve_a_manager(host: str) -> tuple[subprocess.Popen, str, str]:
    pytest.importorskip("torchft")
    process = subprocess.Popen(
        [sys.executable, "-c", SERVE_A_MANAGER, host],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    advertised, internal = first_line(process, limit_s()).split()
    return process, advertised, internal


@pytest.mark.slow
def test_a_real_manager_behind_its_front_serves_its_calls_and_not_kill():
    from datetime import timedelta

    from torchft._torchft import ManagerClient

    process, advertised, internal = serve_a_manager("127.0.0.1")
    try:
        port = advertised.rsplit(":", 1)[1]
        assert advertised.startswith("127.0.0.1:") and internal in bound_beside("127.0.0.1", port)
        client = ManagerClient(f"http://{advertised}", connect_timeout=timedelta(seconds=LOCAL_S))
        seconds = []
        for step in range(20):
            started = time.perf_counter()  # torchft's own answer: the replica's one vote
            assert client.should_commit(0, step, True, timeout=timedelta(seconds=LOCAL_S))
            seconds.append(time.perf_counter() - started)
        # a call is two small frames each way: held back by Nagle's algorithm, 40 ms or more
        assert statistics.median(seconds) < 0.02, seconds
        assert headers_frames(grpc_call(advertised, KILL, kill_request())) == 0
        time.sleep(1.0)
        assert process.poll() is None, process.stderr.read()
        grpc_call(internal, KILL, kill_request(), timeout=5.0)  # the server itself: it obeys
        assert process.wait(timeout=EXIT_AFTER_SIGNAL_S) == 1
        assert f"manager's front: refused a call of {KILL}" in process.stderr.read()
    finally:
        process.kill()
        process.wait()


def bound_beside(front_host: str, port: str) -> list[str]:
    """Where torchft's server may sit beside a front on ``front_host`` at ``port``."""
    from mtdao.sync.torchft.manager_front import loopbacks_beside

    return [f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h in loopbacks_beside(front_host)]


def ipv6_address() -> str | None:
    """A global IPv6 address of this machine, if it has one."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as probe:
            probe.connect(("2001:db8::1", 9))  # no packet is sent: it only picks a source
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("fe80") else address


@pytest.mark.slow
@pytest.mark.parametrize("host", ["::1", "ipv6", "0.0.0.0"])
def test_a_manager_behind_its_front_on_other_hosts(host):
    if host == "ipv6" and (host := ipv6_address()) is None:
        pytest.skip("this machine has no global IPv6 address")
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    process, advertised, internal = serve_a_manager(host)
    try:
        port = advertised.rsplit(":", 1)[1]
        # the first loopback address beside the front whose port is free (another socket of
        # this machine may hold that port number on the first)
        assert internal in bound_beside(host, port), (internal, advertised)
        front = advertised if host != "0.0.0.0" else f"127.0.0.1:{port}"
        assert headers_frames(grpc_call(front, KILL, kill_request())) == 0
        time.sleep(1.0)
        assert process.poll() is None, process.stderr.read()
    finally:
        process.kill()
        process.wait()


def test_where_the_server_behind_a_front_goes():
    pytest.importorskip("torchft")
    from mtdao.sync.torchft.manager_front import loopbacks_beside

    assert loopbacks_beside("127.0.0.1") == ["127.0.0.2", "::1"]
    assert loopbacks_beside("127.0.0.5") == ["127.0.0.1", "127.0.0.2", "::1"]
    assert loopbacks_beside("10.1.2.3")[0] == loopbacks_beside("::1")[0] == "127.0.0.1"
    assert loopbacks_beside("0.0.0.0") == ["::1"] and loopbacks_beside("::") == []


def test_a_manager_that_cannot_sit_behind_its_front_is_not_started():
    pytest.importorskip("torchft")
    from mtdao.sync.torchft.manager_front import FrontUnavailable, start_fronted

    tried = []

    def always_taken(bind: str):
        tried.append(bind)
        raise RuntimeError("Address already in use (os error 98)")

    with pytest.raises(FrontUnavailable, match="it is not started rather than serve its"):
        start_fronted(always_taken, "127.0.0.1", 0)
    assert len({bind.rsplit(":", 1)[1] for bind in tried}) > 1  # other ports were tried

    def lighthouse_away(bind: str):
        raise RuntimeError("failed to connect to http://127.0.0.1:1 within timeout")

    with pytest.raises(RuntimeError, match="failed to connect"):  # not a port problem: as is
        start_fronted(lighthouse_away, "127.0.0.1", 0)
