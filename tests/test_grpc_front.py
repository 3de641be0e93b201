"""mtdao's gRPC front (mtdao.ft.security.grpc_front) and the torchft manager behind one
(mtdao.ft.security.manager_front), on loopback:

* an allowed call is made again on the server behind, its message and nothing else; a call of
  another method (torchft's Kill) never reaches it, and is counted and said in one line (each
  kind once a minute); so is a call for this machine only from elsewhere; an HTTP/1 request
  ends its connection;
* gRPC's limits: an endless header block (CONTINUATION frames), a message over the cap, a call
  that never sends its message, and more idle connections than the process has file
  descriptors each end without holding the front (a legitimate call goes through after); a
  call of two messages is refused; past the cap on calls in flight a call is answered at once;
* torchft's real ManagerServer behind the front: a client's call goes through, at once, Kill
  sent to the front leaves the process running, Kill sent to the server itself ends it (the
  request is torchft's real Kill);
* the front can fail every call waiting on the server, and serves new ones after;
* where the server behind a front on each kind of host goes.
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from concurrent import futures

import pytest

hpack = pytest.importorskip("hpack")
grpc = pytest.importorskip("grpc")

from grpc_calls import (  # noqa: E402
    CONTINUATION,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    KILL,
    PERMISSION_DENIED,
    PREFACE,
    SETTINGS,
    frame,
    grpc_call,
    grpc_status,
    http2_request,
    kill_request,
)
from wait_limits import first_line, limit_s  # noqa: E402

import mtdao.ft.security.grpc_front as grpc_front  # noqa: E402
from mtdao.ft.security.grpc_front import GrpcFront, from_this_machine  # noqa: E402
from mtdao.testing.fault_drill import EXIT_AFTER_SIGNAL_S  # noqa: E402

QUORUM = "/torchft.ManagerService/Quorum"
ALLOWED = frozenset({QUORUM})
OK = 0
# a call to a server on this machine, already listening, or the front taking a connection up or
# down: milliseconds; these limits only stop a hang
LOCAL_S = 10


class Recorder:
    """A gRPC server that keeps every call it is made (path, message) and answers each with its
    message; a call of ``/wait`` waits until ``release`` is set."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []
        self.release = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(4), handlers=[self])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def service(self, details):
        def answer(message: bytes, context) -> bytes:
            self.calls.append((details.method, message))
            if details.method == "/wait":
                self.release.wait(LOCAL_S)
            return message

        return grpc.unary_unary_rpc_method_handler(answer)

    def stop(self) -> None:
        self.release.set()
        self.server.stop(None)


@pytest.fixture
def front():
    recorder, lines = Recorder(), []
    front = GrpcFront("manager", "127.0.0.1", 0, ALLOWED, lines.append).start(recorder.address)
    yield front, recorder, lines, f"127.0.0.1:{front.port}"
    front.shutdown()
    recorder.stop()


def test_an_allowed_call_is_made_again_on_the_server_behind(front):
    front, recorder, lines, address = front
    answer = http2_request(address, "POST", QUORUM, b"\x08\x01", timeout=LOCAL_S)
    assert grpc_status(answer) == OK and answer.count(b"\x00\x00\x00\x00\x02\x08\x01") == 1
    assert recorder.calls == [(QUORUM, b"\x08\x01")]  # the message, and nothing of the rest
    assert front.refused == 0 and lines == []


def test_kill_is_refused_before_it_reaches_the_server(front):
    front, recorder, lines, address = front
    assert grpc_status(grpc_call(address, KILL, kill_request())) == PERMISSION_DENIED
    assert recorder.calls == [] and front.refused == 1
    (line,) = lines
    assert line.startswith(f"manager's front: refused a call of {KILL} from 127.0.0.1:")
    assert line.endswith("only Quorum calls are served to it")


def test_each_call_on_a_connection_is_judged_on_its_own(front):
    """A refused call ends itself, not the calls beside or after it on its connection; and
    nothing but an allowed call's message goes on (the dashboard's GET, held behind an
    allowed call, once reached torchft's lighthouse)."""
    front, recorder, lines, address = front
    encoder = hpack.Encoder()  # one connection, one header table: the front must follow it
    headers = [(":method", "POST"), (":scheme", "http"), (":authority", "x")]
    grpc_headers = [("content-type", "application/grpc"), ("te", "trailers")]
    frames = PREFACE + frame(SETTINGS, 0, 0, b"")
    for stream, method, path in ((1, "POST", QUORUM), (3, "POST", KILL), (5, "GET", "/status")):
        block = encoder.encode([*headers[1:], (":method", method), (":path", path), *grpc_headers])
        message = b"\x00\x00\x00\x00\x01\x07"
        frames += frame(HEADERS, END_HEADERS, stream, block) + frame(0, END_STREAM, stream, message)
    with socket.create_connection(("127.0.0.1", front.port), timeout=1.0) as connection:
        connection.sendall(frames)
        with pytest.raises(TimeoutError):  # the front keeps the connection open
            while connection.recv(65536):
                pass
    assert recorder.calls == [(QUORUM, b"\x07")]
    assert front.refused == 1 and KILL in lines[0]


def test_an_endless_header_block_costs_the_front_no_memory(front):
    """A header block of CONTINUATION frames is decoded as it comes and dropped past
    HEADER_BYTES: 32 MiB of them cost the front no memory to speak of (the hand-written parser
    kept and recopied every byte: 128 MiB cost it 380 MiB and 27 s), and reach no server."""
    front, recorder, lines, address = front
    block = hpack.Encoder().encode([(":method", "POST"), (":path", QUORUM), (":scheme", "http")])
    chunk = frame(CONTINUATION, 0, 1, b"\x40\x01x\x7f" + b"y" * 16000)  # literal headers
    resident = _resident_bytes()
    with socket.create_connection(("127.0.0.1", front.port), timeout=LOCAL_S) as connection:
        connection.sendall(PREFACE + frame(SETTINGS, 0, 0, b"") + frame(HEADERS, 0, 1, block))
        for _ in range((32 << 20) // len(chunk)):
            connection.sendall(chunk)
    assert _resident_bytes() - resident < 16 << 20
    assert grpc_status(http2_request(address, "POST", QUORUM, b"", timeout=LOCAL_S)) == OK
    assert recorder.calls == [(QUORUM, b"")]


def test_a_message_over_the_cap_is_refused_unread(front):
    front, recorder, lines, address = front
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(QUORUM)
        with pytest.raises(grpc.RpcError) as refused:
            call(b"x" * (grpc_front.MESSAGE_BYTES + 1), timeout=LOCAL_S)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert call(b"x" * grpc_front.MESSAGE_BYTES, timeout=LOCAL_S) == b"x" * (1 << 20)
    assert [len(message) for _, message in recorder.calls] == [grpc_front.MESSAGE_BYTES]


def test_a_call_that_never_sends_its_message_ends(front, monkeypatch):
    front, recorder, lines, address = front
    monkeypatch.setattr(grpc_front, "MESSAGE_S", 0.5)
    block = hpack.Encoder().encode(
        [(":method", "POST"), (":scheme", "http"), (":path", QUORUM), (":authority", "x"),
         ("content-type", "application/grpc"), ("te", "trailers")]
    )  # fmt: skip
    received, started = b"", time.monotonic()
    with socket.create_connection(("127.0.0.1", front.port), timeout=LOCAL_S) as connection:
        connection.sendall(
            PREFACE + frame(SETTINGS, 0, 0, b"") + frame(HEADERS, END_HEADERS, 1, block)
        )
        while grpc_status(received) is None:
            received += connection.recv(65536)
    assert grpc_status(received) == PERMISSION_DENIED and time.monotonic() - started < LOCAL_S
    assert recorder.calls == [] and "without its message within 0.5 s" in lines[0]


def test_a_call_of_two_messages_is_refused_and_reaches_nothing(front):
    front, recorder, lines, address = front
    block = hpack.Encoder().encode(
        [(":method", "POST"), (":scheme", "http"), (":path", QUORUM), (":authority", "x"),
         ("content-type", "application/grpc"), ("te", "trailers")]
    )  # fmt: skip
    message = b"\x00\x00\x00\x00\x02\x08\x01"
    received = b""
    with socket.create_connection(("127.0.0.1", front.port), timeout=LOCAL_S) as connection:
        connection.sendall(
            PREFACE + frame(SETTINGS, 0, 0, b"") + frame(HEADERS, END_HEADERS, 1, block)
            + frame(0, 0, 1, message) + frame(0, END_STREAM, 1, message)
        )  # fmt: skip
        while grpc_status(received) is None:
            received += connection.recv(65536)
    assert grpc_status(received) == PERMISSION_DENIED and recorder.calls == []
    assert "with more than one message" in lines[0]


def test_calls_past_the_cap_are_answered_at_once_and_the_front_serves_on(front, monkeypatch):
    """The front counts its calls in flight itself: past CALLS, a call is answered
    RESOURCE_EXHAUSTED at once (it is not left waiting behind the others)."""
    front, recorder, lines, address = front
    monkeypatch.setattr(grpc_front, "CALLS", 1)
    front.allowed = front.allowed | {"/wait"}
    waiting = threading.Thread(target=http2_request, args=(address, "POST", "/wait", b""))
    waiting.start()
    deadline = time.monotonic() + LOCAL_S
    while not recorder.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    answer = http2_request(address, "POST", QUORUM, b"", timeout=LOCAL_S)
    assert grpc_status(answer) == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert time.monotonic() - started < LOCAL_S / 2
    recorder.release.set()
    waiting.join(timeout=LOCAL_S)
    assert grpc_status(http2_request(address, "POST", QUORUM, b"", timeout=LOCAL_S)) == OK
    assert [path for path, _ in recorder.calls] == ["/wait", QUORUM]


def test_a_flood_of_refusals_is_held_before_each_ends(front):
    """From a host refused ``hold_after`` times within a second, a refusal is held before it
    ends, so a flood is refused at that pace, not as fast as it can ask again; the few first
    heartbeats of a replica not yet in a quorum are answered at once."""
    front, recorder, lines, address = front
    front.refusal_hold_s, front.hold_after = 0.5, 3

    def refused_in() -> float:
        started = time.monotonic()
        assert grpc_status(grpc_call(address, KILL, kill_request())) == PERMISSION_DENIED
        return time.monotonic() - started

    first, second, third = refused_in(), refused_in(), refused_in()
    assert first < 0.45 and second < 0.45 and 0.45 <= third < LOCAL_S
    assert front.refused == 3
    front.refusal_hold_s = 30.0  # failing the calls ends a hold at once
    caller = threading.Thread(target=grpc_call, args=(address, KILL, kill_request()))
    caller.start()
    time.sleep(0.5)
    assert caller.is_alive() and front.end_calls() == 1
    caller.join(timeout=LOCAL_S)
    assert not caller.is_alive() and recorder.calls == []


def test_held_refusals_take_no_call_a_member_needs(front, monkeypatch):
    """A held refusal gives up its call slot while it waits (connections and streams bound the
    held ones): 1,100 bogus heartbeats from one host used to fill the front's 1,024 calls, and
    4 of 10 members' heartbeats failed RESOURCE_EXHAUSTED."""
    front, recorder, lines, address = front
    monkeypatch.setattr(grpc_front, "CALLS", 4)
    front.refusal_hold_s, front.hold_after = 30.0, 1  # every refusal held until end_calls()
    flood = [
        threading.Thread(target=grpc_call, args=(address, KILL, kill_request())) for _ in range(8)
    ]
    for caller in flood:
        caller.start()
    deadline = time.monotonic() + LOCAL_S
    while front.refused < len(flood) and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        assert front.refused == len(flood)
        answer = http2_request(address, "POST", QUORUM, b"\x08\x01", timeout=LOCAL_S)
        assert grpc_status(answer) == OK
    finally:
        front.end_calls()
        for caller in flood:
            caller.join(timeout=LOCAL_S)
    assert recorder.calls == [(QUORUM, b"\x08\x01")]


def test_ending_the_calls_fails_a_waiting_call_and_the_front_serves_on(front):
    front, recorder, lines, address = front
    front.allowed = front.allowed | {"/wait"}
    answers = []
    caller = threading.Thread(
        target=lambda: answers.append(http2_request(address, "POST", "/wait", b"", timeout=LOCAL_S))
    )
    caller.start()
    deadline = time.monotonic() + LOCAL_S
    while not recorder.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.perf_counter()
    assert front.end_calls() == 1
    caller.join(timeout=LOCAL_S)
    assert time.perf_counter() - started < 1.0
    assert grpc_status(answers[0]) == grpc.StatusCode.CANCELLED.value[0]
    answer = http2_request(address, "POST", QUORUM, b"\x08\x01", timeout=LOCAL_S)
    assert grpc_status(answer) == OK and front.refused == 0


def test_calls_for_this_machine_only_are_refused_to_others(monkeypatch):
    metadata = "/torchft.ManagerService/CheckpointMetadata"
    recorder, lines = Recorder(), []
    front = GrpcFront(
        "manager", "127.0.0.1", 0, frozenset({QUORUM, metadata}), lines.append,
        local_only=frozenset({QUORUM}),
    ).start(recorder.address)  # fmt: skip
    address = f"127.0.0.1:{front.port}"
    try:
        assert grpc_status(http2_request(address, "POST", QUORUM, b"")) == OK  # from here
        monkeypatch.setattr(grpc_front, "from_this_machine", lambda host: False)
        assert grpc_status(http2_request(address, "POST", QUORUM, b"")) == PERMISSION_DENIED
        assert grpc_status(http2_request(address, "POST", metadata, b"")) == OK
        assert [path for path, _ in recorder.calls] == [QUORUM, metadata]
        (line,) = lines
        assert f"refused a call of {QUORUM} (served to this machine's processes only)" in line
        assert line.endswith("only CheckpointMetadata calls are served to it")
    finally:
        front.shutdown()
        recorder.stop()


def test_a_caller_on_this_machine_is_told_apart():
    assert from_this_machine("127.0.0.1") and from_this_machine("127.0.0.2")
    assert from_this_machine("::1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: it only picks a source address
        own = probe.getsockname()[0]
    assert from_this_machine(own)
    assert not from_this_machine("192.0.2.7") and not from_this_machine("not an address")


def test_http1_ends_its_connection_without_reaching_the_server(front):
    front, recorder, lines, address = front
    with socket.create_connection(("127.0.0.1", front.port), timeout=LOCAL_S) as connection:
        connection.sendall(b"POST /replica/0/kill HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    assert not answer.startswith(b"HTTP/1") and recorder.calls == []


def test_a_connection_that_asks_nothing_is_no_refusal(front):
    front, recorder, lines, address = front
    socket.create_connection(("127.0.0.1", front.port), timeout=LOCAL_S).close()  # a port check
    assert recorder.calls == [] and front.refused == 0 and lines == []


def test_each_kind_of_refusal_is_said_once_a_minute_with_a_count():
    now = [0.0]
    lines = []
    front = GrpcFront("manager", "127.0.0.1", 0, ALLOWED, lines.append, clock=lambda: now[0])
    try:
        for _ in range(120):
            front._say(("127.0.0.1", 1), "a call of /x", ALLOWED)
        front._say(("127.0.0.1", 1), "a call of /y", ALLOWED)
        assert len(lines) == 2 and "/x" in lines[0] and "/y" in lines[1]
        now[0] = 61.0
        front._say(("127.0.0.1", 1), "a call of /x", ALLOWED)
        assert len(lines) == 3 and lines[2].endswith("(refused 120 times in the last 61 s)")
        for index in range(100):  # a flood of kinds: SAY_BURST lines a minute, then a count
            front._say(("127.0.0.1", 1), f"a call of /z{index}", ALLOWED)
        assert len(lines) == 2 + grpc_front.SAY_BURST
        now[0] = 122.0
        front._say(("127.0.0.1", 1), "a call of /x", ALLOWED)
        assert lines[-2].endswith(f"refused {101 - grpc_front.SAY_BURST} more calls of other kinds "
                                  "in the last 60 s (lines about them held back)")  # fmt: skip
    finally:
        front.shutdown()


OUT_OF_DESCRIPTORS = textwrap.dedent(
    """
    import resource, sys, time
    from concurrent import futures
    import grpc
    from mtdao.ft.security import grpc_front

    grpc_front.HANDSHAKE_S = float(sys.argv[1])

    class Echo(grpc.GenericRpcHandler):
        def service(self, details):
            return grpc.unary_unary_rpc_method_handler(lambda message, context: message)

    server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[Echo()])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]),) * 2)
    front = grpc_front.GrpcFront("test", "127.0.0.1", 0, frozenset({"/e.E/Echo"}))
    front.start(f"127.0.0.1:{port}")
    print(front.port, flush=True)
    time.sleep(float(sys.argv[3]))
    """
)


@pytest.mark.slow
def test_a_front_out_of_file_descriptors_says_so_and_serves_on():
    """More idle connections than the process has file descriptors: gRPC leaves the rest
    waiting and accepts again a second later (the hand-written front's accept thread ended
    for good); the front says so in one line; the idle ones are closed after HANDSHAKE_S, and
    a legitimate call goes through."""
    handshake_s, descriptors, idle = 2.0, 128, 300
    lifetime_s = limit_s() + 4 * handshake_s + 2 * LOCAL_S
    process = subprocess.Popen(
        [sys.executable, "-c", OUT_OF_DESCRIPTORS, str(handshake_s), str(descriptors),
         str(lifetime_s)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        port = int(first_line(process, limit_s()))
        waiting = [socket.create_connection(("127.0.0.1", port)) for _ in range(idle)]
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        started = time.monotonic()
        answer = channel.unary_unary("/e.E/Echo")(b"hi", timeout=4 * handshake_s + LOCAL_S)
        assert answer == b"hi" and time.monotonic() - started >= 0.0
        for connection in waiting:
            connection.close()
        channel.close()
    finally:
        process.kill()
        _, errors = process.communicate(timeout=LOCAL_S)
    said = [line for line in errors.splitlines() if line.startswith("test's front:")]
    assert len(said) == 1, errors
    assert f"used all {descriptors} of its file descriptors" in said[0]
    assert "File descriptor limit reached. Retrying." in errors  # gRPC's own, once a second


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


SERVE_A_MANAGER = textwrap.dedent(
    """
    import sys, time
    from datetime import timedelta
    from torchft._torchft import ManagerServer
    from mtdao.ft import start_lighthouse
    from mtdao.ft.security.manager_front import start_fronted
    from mtdao.ft.lines import advertised_host

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
        assert advertised.startswith("127.0.0.1:") and internal.startswith("127.0.0.1:")
        assert not internal.endswith(f":{port}")  # its own port, not the one advertised
        client = ManagerClient(f"http://{advertised}", connect_timeout=timedelta(seconds=LOCAL_S))
        seconds = []
        for step in range(20):
            started = time.perf_counter()  # torchft's own answer: the replica's one vote
            assert client.should_commit(0, step, True, timeout=timedelta(seconds=LOCAL_S))
            seconds.append(time.perf_counter() - started)
        # a call is two small frames each way: held back by Nagle's algorithm, 40 ms or more
        assert statistics.median(seconds) < 0.02, seconds
        assert grpc_status(grpc_call(advertised, KILL, kill_request())) == PERMISSION_DENIED
        time.sleep(1.0)
        assert process.poll() is None, process.stderr.read()
        grpc_call(internal, KILL, kill_request(), timeout=5.0)  # the server itself: it obeys
        assert process.wait(timeout=EXIT_AFTER_SIGNAL_S) == 1
        assert f"manager's front: refused a call of {KILL}" in process.stderr.read()
    finally:
        process.kill()
        process.wait()


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
        loopback = "127.0.0.1:" if host == "0.0.0.0" else "[::1]:"  # the front's family
        assert internal.startswith(loopback), (internal, advertised)
        front = advertised if host != "0.0.0.0" else f"127.0.0.1:{port}"
        assert grpc_status(grpc_call(front, KILL, kill_request())) == PERMISSION_DENIED
        time.sleep(1.0)
        assert process.poll() is None, process.stderr.read()
    finally:
        process.kill()
        process.wait()


def test_a_manager_that_cannot_sit_behind_its_front_is_not_started():
    pytest.importorskip("torchft")
    from mtdao.ft.security.manager_front import FrontUnavailable, start_fronted

    started = []
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(FrontUnavailable, match="it is not started rather than serve its"):
            start_fronted(started.append, "127.0.0.1", port)
    assert not started

    def lighthouse_away(bind: str):
        raise RuntimeError("failed to connect to http://127.0.0.1:1 within timeout")

    with pytest.raises(RuntimeError, match="failed to connect"):  # not the front's: as is
        start_fronted(lighthouse_away, "127.0.0.1", 0)
