"""``mtdao lighthouse`` lets only replicas that prove the run's secret into its quorums: a stranger
that only sends heartbeats, or that asks for quorums it then leaves, used to hold every quorum
open (torchft's lighthouse waits for every live replica it hears from). torchft's own lighthouse
behind mtdao's front, asked through torchft's own client, as a replica and an attacker would;
and raw HTTP/2, as an attacker would: calls held behind a proven member's heartbeat (they once
went on unchecked), a claim nested 100,000 deep (once a RecursionError traceback per request),
heartbeats in a member's name from another host."""

from __future__ import annotations

import contextlib
import json
import socket
from datetime import timedelta

import pytest

pytest.importorskip("torchft")
hpack = pytest.importorskip("hpack")

from grpc_calls import (  # noqa: E402
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PERMISSION_DENIED,
    PREFACE,
    SETTINGS,
    frame,
)
from torchft._torchft import LighthouseClient  # noqa: E402

from mtdao.ft import start_lighthouse  # noqa: E402
from mtdao.ft.security import lighthouse_gate  # noqa: E402
from mtdao.ft.security.auth import RunKey  # noqa: E402
from mtdao.ft.security.grpc_front import GrpcFront  # noqa: E402
from mtdao.ft.security.lighthouse_gate import (  # noqa: E402
    CALLS,
    LighthouseGate,
    lighthouse_min_replicas,
    settings,
)
from mtdao.ft.security.proofs import Claim, claim_data, new_nonce  # noqa: E402

KEY = RunKey(b"0123456789abcdef0123")
# a call to the lighthouse in this process answers in milliseconds (a quorum of one forms at once,
# at worst after the 1 s join timeout): longer is a hang
TIMEOUT = timedelta(seconds=5)


@pytest.fixture
def gated():
    server = start_lighthouse("127.0.0.1:0", 1, join_timeout=1.0, heartbeat_timeout=5.0)
    lines: list[str] = []
    gate = LighthouseGate(KEY, lines.append)
    front = GrpcFront(
        "lighthouse", "127.0.0.1", 0, CALLS, lines.append, inspect=gate.inspectors()
    ).start(f"127.0.0.1:{server.address().rsplit(':', 1)[1]}")
    yield f"http://127.0.0.1:{front.port}", lines
    front.shutdown()
    server.shutdown()


def test_the_front_tells_replicas_the_lighthouses_min_replicas():
    """What a proven quorum may not fall below; torchft's own lighthouse does not tell (1: its
    own quorums are the bound), and one that cannot be reached tells nothing (None)."""
    server = start_lighthouse("127.0.0.1:0", 3, join_timeout=1.0, heartbeat_timeout=5.0)
    internal = f"127.0.0.1:{server.address().rsplit(':', 1)[1]}"
    front = GrpcFront("lighthouse", "127.0.0.1", 0, CALLS, answers=settings(3)).start(internal)
    with socket.create_server(("127.0.0.1", 0)) as closed:
        away = f"127.0.0.1:{closed.getsockname()[1]}"
    try:
        assert lighthouse_min_replicas(f"http://127.0.0.1:{front.port}", 5.0) == 3
        assert lighthouse_min_replicas(f"http://{internal}", 5.0) == 1
        assert lighthouse_min_replicas(away, 5.0) is None
    finally:
        front.shutdown()
        server.shutdown()


@pytest.mark.parametrize("told", [b'{"min_replicas": 1e400}', b'{"min_replicas": -Infinity}'])
def test_a_min_replicas_past_any_int_is_read_as_no_mtdao_lighthouses(told):
    """int(inf) raises OverflowError, which used to escape the check of the answer."""

    async def answer(message: bytes, peer: tuple[str, int]) -> list[bytes]:
        return [told]

    answers = {lighthouse_gate.SETTINGS: answer}
    front = GrpcFront("lighthouse", "127.0.0.1", 0, CALLS, answers=answers).start()
    try:
        assert lighthouse_min_replicas(f"http://127.0.0.1:{front.port}", 5.0) == 1
    finally:
        front.shutdown()


def ask(address: str, member: str, data=None):
    client = LighthouseClient(address, TIMEOUT)
    return client.quorum(replica_id=member, timeout=TIMEOUT, step=10**6, data=data)


def claim(member: str) -> Claim:
    return Claim(0, member, 3, 12, "c", 1, "127.0.0.1:1", ("http://x/heal/",), nonce=new_nonce())


def test_a_quorum_request_goes_on_only_with_a_claim_signed_with_the_runs_secret(gated):
    address, lines = gated
    quorum = ask(address, "0:real", claim_data(claim("0:real"), KEY))
    assert [m.replica_id for m in quorum.participants] == ["0:real"]
    for member, data in (
        ("7:rogue", None),  # a stock torchft manager
        ("7:rogue", claim_data(claim("7:rogue"), RunKey(b"another-secret-0000"))),  # another run
        ("7:rogue", claim_data(claim("0:real"), KEY)),  # a real claim under its own id
    ):
        with pytest.raises(Exception):  # noqa: B017 (the front ends the connection)
            ask(address, member, data)
    assert len(lines) == 1  # once a minute per peer
    assert "refused a quorum request of '7:rogue' from 127.0.0.1:" in lines[0]
    assert lines[0].endswith("it sent no claim (not an mtdao replica of this run)")


def test_a_replayed_claim_is_refused(gated):
    address, lines = gated
    data = claim_data(claim("0:real"), KEY)
    ask(address, "0:real", data)
    with pytest.raises(Exception):  # noqa: B017
        ask(address, "0:real", data)
    assert lines[-1].endswith("its claim was handed in before (a replay)")


def test_heartbeats_go_on_only_from_replicas_whose_quorum_request_went_on(gated):
    address, lines = gated
    client = LighthouseClient(address, TIMEOUT)
    with pytest.raises(Exception):  # noqa: B017
        client.heartbeat("0:real", timeout=TIMEOUT)
    ask(address, "0:real", claim_data(claim("0:real"), KEY))
    LighthouseClient(address, TIMEOUT).heartbeat("0:real", timeout=TIMEOUT)
    assert lines == []  # a replica's first heartbeats are counted, not said


def requester(member: str, data: str) -> bytes:
    """A LighthouseQuorumRequest {requester: QuorumMember {replica_id = 1, data = 7}}."""
    member_bytes, data_bytes = member.encode(), data.encode()
    inner = b"\x0a" + varint(len(member_bytes)) + member_bytes
    inner += b"\x3a" + varint(len(data_bytes)) + data_bytes
    return b"\x0a" + varint(len(inner)) + inner


def heartbeat_request(member: str) -> bytes:
    text = member.encode()
    return b"\x0a" + varint(len(text)) + text


def varint(value: int) -> bytes:
    out = b""
    while value > 0x7F:
        out, value = out + bytes([value & 0x7F | 0x80]), value >> 7
    return out + bytes([value])


def test_a_claim_nested_too_deep_is_refused_in_one_line(capfd):
    lines: list[str] = []
    gate = LighthouseGate(KEY, lines.append)
    deep = "[" * 100_000
    for data in (
        deep,
        json.dumps({"mtdao": deep}),
        json.dumps({"mtdao": json.dumps({"claim": deep})}),
    ):
        assert not gate.quorum(requester("7:rogue", data), ("192.0.2.7", 1))
    assert len(lines) == 1 and "Traceback" not in capfd.readouterr().err
    assert lines[0].startswith("lighthouse: refused a quorum request of '7:rogue' from 192.0.2.7:1")
    assert lines[0].endswith("its claim is not readable")


def test_a_heartbeat_goes_on_only_from_the_host_that_proved_the_member():
    lines: list[str] = []
    gate = LighthouseGate(KEY, lines.append)
    data = json.dumps(claim_data(claim("0:real"), KEY))
    assert gate.quorum(requester("0:real", data), ("10.0.0.1", 40000))
    assert gate.heartbeat(
        heartbeat_request("0:real"), ("10.0.0.1", 40001)
    )  # another port: its manager
    assert not gate.heartbeat(heartbeat_request("0:real"), ("10.0.0.2", 40001))  # another host
    assert not gate.heartbeat(heartbeat_request("1:never"), ("10.0.0.1", 40001))


def test_calls_behind_a_proven_heartbeat_are_each_checked(gated):
    """One connection: a proven member's heartbeat, then the dashboard's GET /status and a
    claimless quorum request behind it (which once went on unchecked, and were answered with
    every member's address and claim)."""
    address, lines = gated
    ask(address, "0:real", claim_data(claim("0:real"), KEY))
    host, port = address.split("://")[1].rsplit(":", 1)
    encoder = hpack.Encoder()
    frames = PREFACE + frame(SETTINGS, 0, 0, b"")
    calls = [
        (1, "POST", "/torchft.LighthouseService/Heartbeat", heartbeat_request("0:real")),
        (3, "GET", "/status", b""),
        (5, "POST", "/torchft.LighthouseService/Quorum", requester("7:rogue", "")),
    ]
    for stream, method, path, message in calls:
        block = encoder.encode(
            [(":method", method), (":scheme", "http"), (":path", path), (":authority", host),
             ("content-type", "application/grpc"), ("te", "trailers")]
        )  # fmt: skip
        body = b"\x00" + len(message).to_bytes(4, "big") + message
        frames += frame(HEADERS, END_HEADERS, stream, block) + frame(DATA, END_STREAM, stream, body)
    received = b""
    with socket.create_connection((host, int(port)), timeout=2.0) as connection:
        connection.sendall(frames)
        with contextlib.suppress(TimeoutError):
            while chunk := connection.recv(65536):
                received += chunk
    statuses = answers_by_stream(received)
    assert statuses.get(1) == 0 and statuses.get(5) == PERMISSION_DENIED, statuses
    assert 3 not in statuses and b"0:real" not in received and b"<html" not in received.lower()
    assert "refused a quorum request of '7:rogue'" in lines[-1]


def answers_by_stream(received: bytes) -> dict[int, int]:
    """The gRPC status each stream's answer ended with."""
    decoder, statuses, offset = hpack.Decoder(), {}, 0
    while offset + 9 <= len(received):
        length, kind = int.from_bytes(received[offset : offset + 3], "big"), received[offset + 3]
        stream = int.from_bytes(received[offset + 5 : offset + 9], "big") & 0x7FFFFFFF
        if kind == HEADERS:
            for name, value in decoder.decode(received[offset + 9 : offset + 9 + length]):
                if name == "grpc-status":
                    statuses[stream] = int(value)
        offset += 9 + length
    return statuses
