"""What ``mtdao lighthouse`` lets into its quorums: quorum requests with a fresh signed claim, and
heartbeats only from a proven member's host (docs/security.md, "The lighthouse"); and what its
front tells the replicas itself: its ``--min-replicas``, which no proven quorum may fall below."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import grpc
from google.protobuf.empty_pb2 import Empty
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from mtdao.ft.lines import shown_address
from mtdao.ft.refusals import Refusal, RefusalLog
from mtdao.ft.security.auth import RunKey
from mtdao.ft.security.grpc_front import Answer
from mtdao.ft.security.proofs import SeenNonces, read_claim

SERVICE = "/torchft.LighthouseService/"
QUORUM, HEARTBEAT = SERVICE + "Quorum", SERVICE + "Heartbeat"
SETTINGS = "/mtdao.Lighthouse/Settings"  # answered by the front, not torchft's lighthouse
CALLS = frozenset({QUORUM, HEARTBEAT, SETTINGS})  # all the replicas make: not the dashboard
FORGET_S = 600.0
"""A replica id that neither asked for a quorum nor sent a heartbeat for this long is forgotten."""


class LighthouseGate:
    def __init__(
        self,
        key: RunKey,
        report: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.key, self.report, self.clock = key, report, clock
        self.proven: dict[str, tuple[float, str]] = {}  # replica id -> (when let through, host)
        self.refusals = RefusalLog(clock=clock)
        self._seen = SeenNonces()
        self._heartbeats_refused = 0
        self._heartbeats_said_at = clock()
        self._lock = threading.Lock()  # the front serves each connection in a thread

    def inspectors(self) -> dict[str, Callable[[bytes, tuple[str, int]], bool]]:
        """The checks to hand the lighthouse's front, by gRPC path."""
        return {QUORUM: self.quorum, HEARTBEAT: self.heartbeat}

    def quorum(self, message: bytes, peer: tuple[str, int]) -> bool:
        """Whether a ``LighthouseQuorumRequest`` may go on."""
        try:  # QuorumMember requester = 1 {string replica_id = 1; string data = 7}
            requester = _field(message, 1)
            member, posted = _field(requester, 1).decode(), _field(requester, 7).decode()
        except ValueError:
            member, posted = "", ""
        try:
            data = json.loads(posted or "null")
        except (ValueError, RecursionError):  # RecursionError: JSON nested too deep
            claim, why = None, "its claim is not readable"
        else:
            claim, why = read_claim(member, data, self.key)
        with self._lock:
            if claim is not None and not self._seen.first_time(claim.nonce):
                claim, why = None, "its claim was handed in before (a replay)"
            if claim is not None:
                self.proven[member] = (self.clock(), peer[0])
                if len(self.proven) > 1000:  # forget the ids quiet for FORGET_S
                    horizon = self.clock() - FORGET_S
                    self.proven = {m: p for m, p in self.proven.items() if p[0] >= horizon}
                return True
            shown = member[:48] or "(no replica id)"
            line = f"a quorum request of {shown!r} from {shown_address(peer)}: {why}"
            lines = self.refusals.lines([Refusal(peer=member or shown_address(peer), line=line)])
        for said in lines:
            self.report(f"lighthouse: {said}")
        return False

    def heartbeat(self, message: bytes, peer: tuple[str, int]) -> bool:
        """Whether a ``LighthouseHeartbeatRequest`` may go on."""
        try:  # string replica_id = 1
            member = _field(message, 1).decode()
        except ValueError:
            member = ""
        with self._lock:
            now = self.clock()
            proven = self.proven.get(member)
            if proven is not None and proven[1] == peer[0]:
                self.proven[member] = (now, proven[1])
                return True
            self._heartbeats_refused += 1
            said = None
            if now - self._heartbeats_said_at >= self.refusals.every_s:
                said = (
                    f"lighthouse: refused {self._heartbeats_refused} heartbeats in the last "
                    f"{now - self._heartbeats_said_at:.0f} s from replica ids that sent no quorum "
                    "request signed with the run's secret from the same host (a replica's own, "
                    "before its first quorum, among them)"
                )
                self._heartbeats_refused, self._heartbeats_said_at = 0, now
        if said:
            self.report(said)
        return False


def settings(min_replicas: int) -> dict[str, Answer]:
    """The answers of the lighthouse's front itself, by gRPC path."""
    answer = [json.dumps({"min_replicas": min_replicas}).encode()]

    async def told(message: bytes, peer: tuple[str, int]) -> list[bytes]:
        return answer

    return {SETTINGS: told}


def lighthouse_min_replicas(url: str, timeout: float) -> int | None:
    """The ``--min-replicas`` of the lighthouse at ``url``; 1 where it does not tell (torchft's
    own lighthouse), None where it cannot be asked now."""
    with grpc.insecure_channel(url.split("://")[-1]) as channel:
        try:
            answer = channel.unary_unary(SETTINGS)(b"", timeout=timeout)
        except grpc.RpcError as error:
            unserved = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED)
            return 1 if error.code() in unserved else None
    try:
        return max(1, int(json.loads(answer)["min_replicas"]))
    except (ValueError, TypeError, KeyError, RecursionError, OverflowError):  # int(inf): Overflow
        return 1  # not an mtdao lighthouse's answer


def _field(message: bytes, number: int) -> bytes:
    """Length-delimited field ``number`` of a protobuf message (b"": none). torchft ships no
    message classes: parsed as an empty message, every field stays unknown. Raises ValueError."""
    parsed = Empty()
    try:
        parsed.ParseFromString(message)
    except DecodeError:
        raise ValueError("not a protobuf message") from None
    fields = {f.field_number: f.data for f in UnknownFieldSet(parsed) if f.wire_type == 2}
    return fields.get(number, b"")
