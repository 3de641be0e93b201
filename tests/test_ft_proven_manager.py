"""What a replica's processes read back from its store (each process's heal server and refused
members; the first process's verdict on a quorum) is checked before it is used: anyone who
reaches the store (a TCPStore: no credentials) can write there. A record of another shape is a
failed quorum naming the store and the key, asked again; it used to raise a JSONDecodeError or a
TypeError, and a ValueError stopped the healthy replica as if it were refused."""

from __future__ import annotations

import json
from datetime import timedelta
from types import SimpleNamespace

import pytest
from dict_store import DictStore

pytest.importorskip("torchft")

from mtdao.ft.plumbing import QuorumError  # noqa: E402
from mtdao.ft.security.proofs import Claim  # noqa: E402
from mtdao.ft.security.proven_manager import RELAY, ProvenManager  # noqa: E402

MEMBER, STORE = "0:uuid", "store-host:29500"
HEAL = "http://127.0.0.1:4000"


def manager(group_rank: int = 0) -> ProvenManager:
    """A ProvenManager's store reading, without torchft's Manager (no servers, no threads)."""
    manager = ProvenManager.__new__(ProvenManager)
    manager.internals = SimpleNamespace(
        store=DictStore(), group_rank=group_rank, group_world_size=2, timeout=timedelta(seconds=1)
    )
    manager._member, manager._store_address, manager._refused = MEMBER, STORE, set()
    manager._quorums, manager._confirm_wait_s = 0, 0.1
    return manager


def test_sound_posts_are_read():
    reader = manager()
    for rank in (0, 1):
        reader.internals.store.set(
            reader._post_key(rank), json.dumps({"heal": f"{HEAL}{rank}", "refused": [f"{rank}:x"]})
        )
    assert reader._posts() == ((f"{HEAL}0", f"{HEAL}1"), ("0:x", "1:x"))


@pytest.mark.parametrize(
    "written",
    [
        b"not json",
        b"\xff",
        b"[]",
        b'{"refused": [[1]]}',
        b'{"heal": "http://h:1", "refused": [[1]]}',
        b'{"heal": "http://h:99999", "refused": []}',
        b'{"heal": 5, "refused": []}',
    ],
)
def test_a_post_written_by_another_process_is_a_failed_quorum_naming_it(written):
    reader = manager()
    reader.internals.store.set(reader._post_key(0), json.dumps({"heal": HEAL, "refused": []}))
    reader.internals.store.values[reader._post_key(1)] = written
    with pytest.raises(QuorumError) as failed:
        reader._posts()
    line = str(failed.value)
    assert f"'mtdao/process/{MEMBER}/1' in this replica's store at {STORE}" in line
    assert "\n" not in line


def proven_claim(member: str) -> dict:
    claim = Claim(0, member, 3, 12, "c", 2, STORE, (HEAL, HEAL))
    return json.loads(claim.body())


@pytest.mark.parametrize(
    "written",
    [
        b"not json",
        b"[]",
        b'{"error": 5}',
        b'{"proven": 1}',
        json.dumps({"quorum_id": 1, "failure": "", "digest": "x" * 64, "proven": []}).encode(),
        json.dumps(
            {
                "quorum_id": 1,
                "failure": "",
                "digest": "a" * 64,
                "min_replicas": 1,
                "proven": [{**proven_claim(MEMBER), "commits": float("nan")}],
            }
        ).encode(),
        json.dumps(  # a verdict without this replica
            {
                "quorum_id": 1,
                "failure": "",
                "digest": "a" * 64,
                "min_replicas": 1,
                "proven": [proven_claim("1:other")],
            }
        ).encode(),
    ],
)
def test_a_verdict_written_by_another_process_is_a_failed_quorum_naming_it(written):
    reader = manager(group_rank=1)
    reader.internals.store.values[f"{RELAY}/{MEMBER}/1"] = written
    with pytest.raises(QuorumError) as failed:
        reader.quorum_step(True, False, timedelta(seconds=1))
    line = str(failed.value)
    assert f"'{RELAY}/{MEMBER}/1' in this replica's store at {STORE}" in line
    assert "\n" not in line


def test_the_first_processs_error_is_the_others_failed_quorum():
    reader = manager(group_rank=1)
    reader.internals.store.set(f"{RELAY}/{MEMBER}/1", json.dumps({"error": "QuorumError: away"}))
    with pytest.raises(QuorumError, match="^QuorumError: away$"):
        reader.quorum_step(True, False, timedelta(seconds=1))
