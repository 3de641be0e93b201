"""What a replica's processes read back from its store (each process's heal server and refused
members; the first process's verdict on a quorum) is signed for its key with the run's secret:
anyone who reaches the store (a TCPStore: no credentials) can write there. A record not signed so
is a failed quorum naming the store and the key, asked again; it used to raise a JSONDecodeError
or a TypeError, and a ValueError stopped the healthy replica as if it were refused."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
from dict_store import DictStore

pytest.importorskip("torchft")

from mtdao.ft.plumbing import QuorumError  # noqa: E402
from mtdao.ft.security.auth import RunKey  # noqa: E402
from mtdao.ft.security.proven_manager import RELAY, ProvenManager  # noqa: E402

MEMBER, STORE = "0:uuid", "store-host:29500"
HEAL = "http://127.0.0.1:4000"
SECRET = b"the-run-secret-0123456789"


def manager(group_rank: int = 0, secret: bytes = SECRET) -> ProvenManager:
    """A ProvenManager's store writing and reading, without torchft's Manager (no servers, no
    threads)."""
    manager = ProvenManager.__new__(ProvenManager)
    manager.internals = SimpleNamespace(
        store=DictStore(), group_rank=group_rank, group_world_size=2, timeout=timedelta(seconds=1)
    )
    manager.identity = SimpleNamespace(key=RunKey(secret))
    manager._member, manager._store_address, manager._refused = MEMBER, STORE, set()
    manager._quorums, manager._confirm_wait_s = 0, 0.1
    return manager


def test_posts_signed_by_the_replicas_processes_are_read():
    reader = manager()
    for rank in (0, 1):
        reader._write_signed(
            reader._post_key(rank), {"heal": f"{HEAL}{rank}", "refused": [f"{rank}:x"]}
        )
    assert reader._posts() == ((f"{HEAL}0", f"{HEAL}1"), ("0:x", "1:x"))


def written_by_others(key: str) -> list[bytes]:
    """What another process may leave at ``key``: garbage, JSON of any shape, a record signed
    with another secret, and one signed for another key of the store."""
    stranger, moved = manager(secret=b"another-secret-987654321"), manager()
    stranger._write_signed(key, {"heal": HEAL, "refused": []})
    moved._write_signed("mtdao/process/0:uuid/0", {"heal": HEAL, "refused": []})
    return [
        b"not json",
        b"\xff",
        b"[]",
        b'{"heal": "http://h:1", "refused": [[1]]}',
        b'{"body": "{}", "sig": "\xc3\xa9"}',
        stranger.internals.store.values[key],
        moved.internals.store.values["mtdao/process/0:uuid/0"],
    ]


@pytest.mark.parametrize("case", range(7))
def test_a_post_another_process_wrote_is_a_failed_quorum_naming_it(case):
    reader = manager()
    reader._write_signed(reader._post_key(0), {"heal": HEAL, "refused": []})
    key = reader._post_key(1)
    reader.internals.store.values[key] = written_by_others(key)[case]
    with pytest.raises(QuorumError) as failed:
        reader._posts()
    line = str(failed.value)
    assert f"'mtdao/process/{MEMBER}/1' in this replica's store at {STORE} is not signed" in line
    assert "\n" not in line


@pytest.mark.parametrize("case", range(7))
def test_a_verdict_another_process_wrote_is_a_failed_quorum_naming_it(case):
    reader = manager(group_rank=1)
    key = f"{RELAY}/{MEMBER}/1"
    reader.internals.store.values[key] = written_by_others(key)[case]
    with pytest.raises(QuorumError) as failed:
        reader.quorum_step(True, False, timedelta(seconds=1))
    line = str(failed.value)
    assert f"'{key}' in this replica's store at {STORE} is not signed" in line
    assert "\n" not in line


def test_the_first_processs_error_is_the_others_failed_quorum():
    reader = manager(group_rank=1)
    reader._write_signed(f"{RELAY}/{MEMBER}/1", {"error": "QuorumError: away"})
    with pytest.raises(QuorumError, match="^QuorumError: away$"):
        reader.quorum_step(True, False, timedelta(seconds=1))
