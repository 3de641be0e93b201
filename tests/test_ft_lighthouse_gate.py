"""``mtdao lighthouse`` lets only replicas that prove the run's secret into its quorums: a stranger
that only sends heartbeats, or that asks for quorums it then leaves, used to hold every quorum
open (torchft's lighthouse waits for every live replica it hears from). torchft's own lighthouse
behind mtdao's front, asked through torchft's own client, as a replica and an attacker would."""

from __future__ import annotations

from datetime import timedelta

import pytest

pytest.importorskip("torchft")

from torchft._torchft import LighthouseClient  # noqa: E402

from mtdao.sync.grpc_front import GrpcFront, listen  # noqa: E402
from mtdao.sync.torchft import start_lighthouse  # noqa: E402
from mtdao.sync.torchft.auth import RunKey  # noqa: E402
from mtdao.sync.torchft.lighthouse_gate import LighthouseGate  # noqa: E402
from mtdao.sync.torchft.proofs import Claim, claim_data, new_nonce  # noqa: E402
from mtdao.train.fault_tolerance.lighthouse import LIGHTHOUSE_CALLS  # noqa: E402

KEY = RunKey(b"0123456789abcdef0123")
# a call to the lighthouse in this process answers in milliseconds (a quorum of one forms at once,
# at worst after the 1 s join timeout): longer is a hang
TIMEOUT = timedelta(seconds=5)


@pytest.fixture
def gated():
    server = start_lighthouse("127.0.0.1:0", 1, join_timeout=1.0, heartbeat_timeout=5.0)
    lines: list[str] = []
    gate = LighthouseGate(KEY, lines.append)
    internal = int(server.address().rsplit(":", 1)[1])
    front = GrpcFront(
        "lighthouse", listen("127.0.0.1", 0), ("127.0.0.1", internal), LIGHTHOUSE_CALLS,
        lines.append, inspect=gate.inspectors(),
    )  # fmt: skip
    yield f"http://127.0.0.1:{front.port}", lines
    front.shutdown()
    server.shutdown()


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
