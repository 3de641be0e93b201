"""The watch a replica keeps on its lighthouse while a quorum waits
(mtdao.ft.connection.watching_the_lighthouse), with a stand-in for the manager's server:

* a lighthouse that stops accepting connections: the waiting calls are ended once, within a few
  seconds, and the watch says so;
* a lighthouse that accepts them, however long the quorum takes: nothing is ended;
* a process without the manager's server (a replica's other processes): no watch at all.
"""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("torchft")

from mtdao.ft import connection  # noqa: E402

pytestmark = pytest.mark.slow


class Server:
    def __init__(self) -> None:
        self.ended: list[float] = []

    def end_calls(self) -> int:
        self.ended.append(time.perf_counter())
        return 1


def settings_for(port: int) -> SimpleNamespace:
    return SimpleNamespace(lighthouse_url=f"http://127.0.0.1:{port}", connect_timeout=5.0)


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_lighthouse_that_stops_answering_ends_the_waiting_calls_once():
    server = Server()
    manager = SimpleNamespace(_manager=server)
    started = time.perf_counter()
    with connection.watching_the_lighthouse(settings_for(closed_port()), manager) as lost:
        assert lost.wait(10.0)
        time.sleep(1.5)  # no second ending
    assert len(server.ended) == 1
    grace, misses = connection.WATCH_GRACE_S, connection.WATCH_MISSES
    assert grace <= server.ended[0] - started < grace + misses * connection.WATCH_EVERY_S + 2


def test_a_lighthouse_that_answers_is_left_alone_however_long_the_quorum_takes():
    server = Server()
    with socket.create_server(("127.0.0.1", 0)) as lighthouse:
        settings = settings_for(lighthouse.getsockname()[1])
        with connection.watching_the_lighthouse(settings, SimpleNamespace(_manager=server)) as lost:
            time.sleep(connection.WATCH_GRACE_S + 3 * connection.WATCH_EVERY_S)
    assert not lost.is_set() and server.ended == []


def test_a_process_without_the_server_keeps_no_watch():
    settings = settings_for(closed_port())
    with connection.watching_the_lighthouse(settings, SimpleNamespace(_manager=None)) as lost:
        time.sleep(connection.WATCH_GRACE_S + 2.5 * connection.WATCH_EVERY_S)
    assert not lost.is_set()
