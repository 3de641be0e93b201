"""A replica's heal server is a front like the others (tests/test_grpc_front.py holds its caps):
it serves only heal requests, refuses one it cannot read at once, and requests waiting for a
quorum or a state hold no thread, so a stranger's many unsigned requests do not delay a member's
(it used to be a ThreadingHTTPServer of its own, a thread per request)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import grpc
import pytest

pytest.importorskip("torchft")

from heal_peers import heal_request  # noqa: E402

from mtdao.ft.security import grpc_front, safe_transport  # noqa: E402
from mtdao.ft.security.auth import RunKey  # noqa: E402
from mtdao.ft.security.safe_transport import (  # noqa: E402
    HealBinding,
    HealRefused,
    Quorum,
    SignedHealTransport,
)

KEY = RunKey(b"0123456789abcdef0123")
# a request to a server in this process answers in milliseconds: these limits only stop a hang
LOCAL_S = 10.0
BINDING = HealBinding("digest", "0:source", "1:receiver", 0, 7)


@pytest.fixture
def source():
    transport = SignedHealTransport(KEY, "127.0.0.1", timedelta(seconds=LOCAL_S))
    yield transport
    transport.shutdown()


def test_only_heal_requests_are_served_and_an_unreadable_one_is_refused_at_once(source):
    target = source.metadata().removeprefix("http://")
    with grpc.insecure_channel(target) as channel:
        with pytest.raises(grpc.RpcError, match="only Fetch calls are served"):
            channel.unary_unary("/torchft.ManagerService/Kill")(b"", timeout=LOCAL_S)
        for message in (b"not json", b"[" * 100_000, json.dumps({"step": 7}).encode()):
            started = time.monotonic()
            with pytest.raises(grpc.RpcError, match="PERMISSION_DENIED"):
                channel.unary_stream(safe_transport.FETCH)(message, timeout=LOCAL_S).next()
            assert time.monotonic() - started < LOCAL_S / 2  # no wait for a quorum


def test_a_signed_request_waits_for_the_quorum_and_its_state(source):
    receiver = SignedHealTransport(KEY, "127.0.0.1", timedelta(seconds=LOCAL_S))
    try:
        with ThreadPoolExecutor(1) as pool:
            fetched = pool.submit(receiver.fetch, source.metadata(), BINDING, "replica 0")
            time.sleep(0.5)  # asked before this source opened the quorum (within QUORUM_SKEW_S)
            source.open(Quorum("digest", "0:source", 0, frozenset({"1:receiver"})))
            time.sleep(0.5)  # and before its state is ready
            source.serve(7, {"user": {"w": [1, 2]}})
            assert fetched.result(timeout=LOCAL_S) == {"user": {"w": [1, 2]}}
    finally:
        receiver.shutdown()


def test_a_state_of_many_messages_arrives_whole(source, monkeypatch):
    monkeypatch.setattr(safe_transport, "CHUNK_BYTES", 1000)
    receiver = SignedHealTransport(KEY, "127.0.0.1", timedelta(seconds=LOCAL_S))
    source.open(Quorum("digest", "0:source", 0, frozenset({"1:receiver"})))
    source.serve(7, {"user": {"w": list(range(5000))}})
    try:
        assert receiver.fetch(source.metadata(), BINDING, "replica 0")["user"]["w"][-1] == 4999
        assert receiver.received_bytes > 10 * 1000
    finally:
        receiver.shutdown()


def test_no_state_at_the_asked_step_is_one_line(source, monkeypatch):
    source.open(Quorum("digest", "0:source", 0, frozenset({"1:receiver"})))
    source.serve(6, {"user": {}})
    monkeypatch.setattr(source, "timeout", timedelta(seconds=0.2))
    receiver = SignedHealTransport(KEY, "127.0.0.1", timedelta(seconds=LOCAL_S))
    try:
        with pytest.raises(HealRefused, match="did not send its state: it served none at step 7"):
            receiver.fetch(source.metadata(), BINDING, "replica 0")
    finally:
        receiver.shutdown()


def test_a_strangers_waiting_requests_do_not_delay_a_members(source, monkeypatch):
    monkeypatch.setattr(safe_transport, "QUORUM_SKEW_S", 3.0)
    unsigned = 200  # each waits QUORUM_SKEW_S for a quorum it could be signed for

    def stranger(index: int) -> None:
        with pytest.raises(grpc.RpcError):
            heal_request(source.metadata(), 7, "1:receiver", f"{index:064x}")

    receiver = SignedHealTransport(KEY, "127.0.0.1", timedelta(seconds=LOCAL_S))
    try:
        with ThreadPoolExecutor(unsigned) as pool:
            waiting = [pool.submit(stranger, index) for index in range(unsigned)]
            time.sleep(1.0)
            source.open(Quorum("digest", "0:source", 0, frozenset({"1:receiver"})))
            source.serve(7, {"user": {"w": 1}})
            started = time.monotonic()
            assert receiver.fetch(source.metadata(), BINDING, "replica 0") == {"user": {"w": 1}}
            assert time.monotonic() - started < 2.0  # not behind the strangers' 3 s waits
            for request in waiting:
                request.result(timeout=LOCAL_S)
    finally:
        receiver.shutdown()


@pytest.mark.parametrize("step", ["1e400", "Infinity", "-Infinity"])
def test_a_step_past_any_int_is_refused_like_any_unreadable_request(source, step):
    """int(inf) raises OverflowError: it used to escape the front's refusal (and its count)."""
    message = f'{{"step": {step}, "receiver": "x", "sig": "y"}}'.encode()
    target = source.metadata().removeprefix("http://")
    refused = pytest.raises(grpc.RpcError, match="PERMISSION_DENIED")
    with grpc.insecure_channel(target) as channel, refused:
        channel.unary_stream(safe_transport.FETCH)(message, timeout=LOCAL_S).next()
    assert source._front.refused == 1


def test_a_flood_of_unsigned_requests_leaves_a_member_a_call(source, monkeypatch):
    """Unsigned requests waiting for a quorum are capped (the rest refused at once), so they do
    not fill the front's calls: 1,100 of them used to make a member's fetch RESOURCE_EXHAUSTED.
    A member's request refused at once, its source's quorum not open yet, is made again."""
    monkeypatch.setattr(safe_transport, "QUORUM_SKEW_S", 3.0)
    monkeypatch.setattr(grpc_front, "CALLS", 16)
    monkeypatch.setattr(safe_transport, "UNVERIFIED_WAITING", 4)
    unsigned = 40

    def stranger(index: int) -> None:
        with pytest.raises(grpc.RpcError):
            heal_request(source.metadata(), 7, "1:receiver", f"{index:064x}")

    receiver = SignedHealTransport(KEY, "127.0.0.1", timedelta(seconds=LOCAL_S))
    try:
        with ThreadPoolExecutor(unsigned + 1) as pool:
            waiting = [pool.submit(stranger, index) for index in range(unsigned)]
            time.sleep(1.0)
            fetched = pool.submit(receiver.fetch, source.metadata(), BINDING, "replica 0")
            time.sleep(0.5)  # asked before this source opened the quorum: refused at once
            source.open(Quorum("digest", "0:source", 0, frozenset({"1:receiver"})))
            source.serve(7, {"user": {"w": 1}})
            assert fetched.result(timeout=LOCAL_S) == {"user": {"w": 1}}
            for request in waiting:
                request.result(timeout=LOCAL_S)
    finally:
        receiver.shutdown()
