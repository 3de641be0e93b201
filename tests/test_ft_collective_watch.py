"""A collective of a round that waits says so, and gives up a peer that stopped answering within
seconds (a replica cut off by a partition used to leave its peers standing still for the whole
collective timeout, 175 s and more, without a word)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from mtdao.ft.collective_watch import CollectiveWatch, Peer, PeerLost


class Collective:
    """A collective's work: done when ``finish()`` is called."""

    def __init__(self) -> None:
        self.future = torch.futures.Future()

    def get_future(self):
        return self.future

    def wait(self) -> bool:
        self.future.wait()
        return True

    def finish(self) -> None:
        self.future.set_result(None)


def gone_peer() -> Peer:
    """A replica that no longer answers: nothing listens at its port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return Peer(2, "127.0.0.1", port)


def watch(lines: list[str]) -> CollectiveWatch:
    return CollectiveWatch(lines.append, say_after_s=0.3, probe_every_s=0.1, misses=3)


def test_a_collective_that_completes_in_time_says_nothing():
    lines, work = [], Collective()
    work.finish()
    watch(lines).wait(work, "the round", [gone_peer()])
    assert lines == []


def test_a_peer_that_stopped_answering_is_given_up_within_seconds():
    lines, work = [], Collective()
    started = time.monotonic()
    with pytest.raises(PeerLost, match=r"replica 2 \(127.0.0.1:\d+\) stopped answering while "):
        watch(lines).wait(work, "the round of the quorum at step 12", [gone_peer()])
    assert time.monotonic() - started < 3.0
    assert lines == [
        "waiting 0 s for the round of the quorum at step 12 with replicas 2; probing them"
    ]


def test_a_slow_peer_that_answers_is_waited_for_and_said_so():
    listener = socket.create_server(("127.0.0.1", 0))
    slow = Peer(1, "127.0.0.1", listener.getsockname()[1])
    lines, work = [], Collective()
    threading.Timer(2.2, work.finish).start()
    try:
        watch(lines).wait(work, "the round", [slow])
    finally:
        listener.close()
    assert lines[0] == "waiting 0 s for the round with replicas 1; probing them"
    assert lines[1].startswith("still waiting 2 s for the round with replicas 1")


def test_a_group_left_with_a_collective_given_up_on_is_held_only_until_it_ends():
    """The group is kept while the given-up collective is pending (dropping it then would block
    the process in gloo's destructor), and let go as soon as it ends, not after the whole
    collective timeout: a replica whose last round lost a peer used to wait that long to exit."""
    pytest.importorskip("torchft")
    from mtdao.ft.security.torchft_internals import _leave_group

    class Group:
        aborted = False

        def abort(self) -> None:
            self.aborted = True

    group, collective = Group(), Collective()
    leaving = threading.Thread(target=_leave_group, args=(group, [collective.future], 60.0))
    leaving.start()
    time.sleep(0.3)
    assert group.aborted and leaving.is_alive()  # held while the collective is pending
    collective.finish()
    leaving.join(timeout=5.0)
    assert not leaving.is_alive()
