"""What a replica's processes read back from its store (each process's heal server and refused
members; the first process's verdict on a quorum) is signed for its key with the run's secret:
anyone who reaches the store (a TCPStore: no credentials) can write there. A record not signed so
is a failed quorum naming the store and the key, asked again; it used to raise a JSONDecodeError
or a TypeError, and a ValueError stopped the healthy replica as if it were refused.

A sharded replica heals whole or not at all: its processes agree there whether each received a
state that fits."""

from __future__ import annotations

import threading
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


def manager(group_rank: int = 0, secret: bytes = SECRET, store=None) -> ProvenManager:
    """A ProvenManager's store writing and reading, without torchft's Manager (no servers, no
    threads)."""
    manager = ProvenManager.__new__(ProvenManager)
    manager.internals = SimpleNamespace(
        store=store or DictStore(), group_rank=group_rank, group_world_size=2,
        timeout=timedelta(seconds=5),
    )  # fmt: skip
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


class Healing:
    """A process of a two-process replica at a quorum that heals it, its fetch steered: what it
    loads, what it reports to torchft, whether it aborts its round."""

    def __init__(self, group_rank: int, store: DictStore, fits: bool) -> None:
        self.manager = reader = manager(group_rank, store=store)
        self.loaded, self.errors, self.aborted = [], [], False
        transport = SimpleNamespace(open=lambda quorum: None)
        vars(reader.internals).update(heal_transport=transport, commits=3, healing=False)
        reader.internals.process_group = SimpleNamespace(abort=self.abort)
        reader._fetch_heal = lambda plan, digest: {"torchft": {"step": 7}} if fits else None
        reader.load_state_dict, reader.report_error = self.loaded.append, self.errors.append

    def abort(self) -> None:
        self.aborted = True


def heal_together(fits: tuple[bool, bool], heals=(True, True)) -> list[Healing]:
    """Both processes of one replica at the same quorum, on threads (``heals``: which heal)."""
    store = DictStore()
    processes = [Healing(rank, store, fits[rank]) for rank in (0, 1)]
    threads = []
    for process, heal in zip(processes, heals):
        plan = SimpleNamespace(members=[], serves=False, heals=heal, sources=[2] * heal)
        plan.max_commits = 5
        threads.append(threading.Thread(target=process.manager._heal, args=(plan, "d")))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    return processes


@pytest.mark.parametrize("refusing", [0, 1])
def test_a_replica_whose_process_refused_its_state_keeps_its_own_state_in_every_process(refusing):
    processes = heal_together((refusing != 0, refusing != 1))
    for process in processes:  # neither loads: one alone would hold its source's step
        assert process.loaded == [] and process.aborted, vars(process)
        assert process.manager.internals.commits == 3
    refused, other = str(processes[refusing].errors[0]), str(processes[1 - refusing].errors[0])
    assert refused == "no proven source sent a state that fits this replica"
    assert other == "another process of this replica refused the state its source sent"


def test_a_replica_whose_processes_all_fit_heals_in_every_process():
    for process in heal_together((True, True)):
        assert process.loaded == [{"step": 7}] and not process.errors and not process.aborted
        assert process.manager.internals.commits == 5


def test_at_a_first_quorum_a_process_heals_beside_one_that_does_not():
    healing, kept = heal_together((True, True), heals=(True, False))
    assert healing.loaded == [{"step": 7}] and not healing.errors and not healing.aborted
    assert kept.loaded == [] and not kept.errors and not kept.aborted
