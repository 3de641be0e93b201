"""Nothing signed in one quorum is good in another: captured claims, heal states and heal
requests, replayed from an earlier quorum, an earlier lighthouse life or for another replica, are
refused.

Claims used to be signed over the quorum id, the store address, the replica list and the rank,
all of which a restarted lighthouse repeats (and a stranger claiming the highest step hosted the
store every claim was posted to): a claim captured in one lighthouse life verified in the next.
Heal states were signed over the commit count only, heal requests over nothing that changed."""

from __future__ import annotations

from datetime import timedelta

import grpc
import pytest
import torch
from dict_store import DictStore

from mtdao.ft.security.auth import RunKey
from mtdao.ft.security.proofs import (
    Claim,
    SeenNonces,
    claim_data,
    confirm_quorum,
    new_nonce,
    quorum_digest,
    read_claim,
)

pytest.importorskip("torchft")

from heal_peers import answering, heal_request  # noqa: E402

from mtdao.ft.security.safe_transport import (  # noqa: E402
    HealBinding,
    HealRefused,
    Quorum,
    SignedHealTransport,
)

KEY = RunKey(b"0123456789abcdef0123")
TIMEOUT = timedelta(seconds=5)


def claim(replica: int) -> Claim:
    return Claim(
        replica_id=replica,
        member=f"{replica}:uuid-{replica}",
        commits=5,
        step=20,
        config="c",
        shards=1,
        store=f"store-{replica}:1",
        heal=("http://127.0.0.1:1/heal/",),
        nonce=new_nonce(),
    )


def test_a_claim_from_an_earlier_lighthouse_life_is_refused():
    """Replica 0's claim, captured in quorum 1 of one lighthouse life, handed in again under its
    id in quorum 1 of the next (replica 0 gone meanwhile): a member that saw it refuses it at
    once, one that did not finds no confirmation of the new quorum in replica 0's store."""
    stores = {f"store-{r}:1": DictStore() for r in range(3)}
    zero, one = claim(0), claim(1)
    first_life = [zero, one]
    digest = quorum_digest(1, first_life)
    for member in first_life:
        confirm_quorum(stores.__getitem__, KEY, digest, member, first_life, 0.05)
    seen = SeenNonces()  # replica 1 read every claim of that quorum
    assert all(seen.first_time(c.nonce) for c in first_life)

    captured = claim_data(zero, KEY)  # what the lighthouse handed every member
    replayed, why = read_claim(zero.member, captured, KEY)
    assert replayed == zero and why == ""  # its signature still verifies...
    assert not seen.first_time(replayed.nonce)  # ...but replica 1 has seen it: refused at once
    two = claim(2)  # a replica that joined since never saw it: it waits for a confirmation
    second_life = [replayed, one, two]
    digest = quorum_digest(1, second_life)  # the same quorum id, new nonces
    confirm_quorum(stores.__getitem__, KEY, digest, one, second_life, 0.05)
    unconfirmed = confirm_quorum(stores.__getitem__, KEY, digest, two, second_life, 0.05)
    assert set(unconfirmed) == {zero.member}
    assert "did not confirm this quorum" in unconfirmed[zero.member]


def test_a_claim_handed_in_under_another_id_is_refused():
    captured = claim_data(claim(0), KEY)
    found, why = read_claim("7:rogue", captured, KEY)
    assert found is None and why.startswith("its claim was made by another member")


def test_a_confirmation_of_an_earlier_quorum_confirms_nothing_now():
    stores = {f"store-{r}:1": DictStore() for r in range(2)}
    zero, one = claim(0), claim(1)
    confirm_quorum(stores.__getitem__, KEY, quorum_digest(1, [zero, one]), zero, [zero], 0.05)
    later = quorum_digest(2, [zero, one])
    unconfirmed = confirm_quorum(stores.__getitem__, KEY, later, one, [zero, one], 0.05)
    assert set(unconfirmed) == {zero.member}


# -- heal states and their requests --------------------------------------------------------------


FIRST = HealBinding("quorum-1", "0:source", "1:receiver", 0, 7)


@pytest.fixture
def source():
    transport = SignedHealTransport(KEY, "127.0.0.1", TIMEOUT)
    transport.open(Quorum("quorum-1", "0:source", 0, frozenset({"1:receiver", "2:other"})))
    transport.serve(7, {"user": {"w": torch.arange(3.0)}})
    yield transport
    transport.shutdown()


@pytest.fixture
def receiver():
    transport = SignedHealTransport(KEY, "127.0.0.1", TIMEOUT)
    yield transport
    transport.shutdown()


def captured_answer(source: SignedHealTransport) -> list[bytes]:
    """What replica 1's request in quorum 1 got back (a stranger on the path sees it)."""
    signature = KEY.sign("fetch", *FIRST.fields())
    return heal_request(source.metadata(), 7, "1:receiver", signature)


def test_a_captured_heal_state_is_refused_by_another_replica_and_in_a_later_quorum(
    source, receiver
):
    assert receiver.fetch(source.metadata(), FIRST, "replica 0")["user"]["w"].tolist() == [0, 1, 2]
    server = answering(*captured_answer(source))
    url = f"http://127.0.0.1:{server.port}"
    try:
        for binding in (
            HealBinding("quorum-1", "0:source", "2:other", 0, 7),  # for another replica
            HealBinding("quorum-2", "0:source", "1:receiver", 0, 7),  # in a later quorum
            HealBinding("quorum-1", "0:source", "1:receiver", 1, 7),  # for another process
        ):
            with pytest.raises(HealRefused, match="not signed for this quorum and this replica"):
                receiver.fetch(url, binding, "replica 0")
    finally:
        server.shutdown()


def test_a_captured_heal_request_is_refused_in_a_later_quorum_and_for_another_receiver(
    source, monkeypatch
):
    monkeypatch.setattr("mtdao.ft.security.safe_transport.QUORUM_SKEW_S", 0.1)
    signature = KEY.sign("fetch", *FIRST.fields())
    source.open(Quorum("quorum-2", "0:source", 0, frozenset({"1:receiver", "2:other"})))
    for receiver_id in ("1:receiver", "2:other"):
        with pytest.raises(grpc.RpcError, match="PERMISSION_DENIED"):
            heal_request(source.metadata(), 7, receiver_id, signature)
