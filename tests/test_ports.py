"""unused_port: a free port that no ephemeral socket can take before its server binds it."""

from __future__ import annotations

import socket

import pytest

from mtdao.testing import ports


def test_unused_port_is_outside_the_ephemeral_range_and_bindable():
    low, high = ports.ephemeral_range()
    for _ in range(20):
        port = ports.unused_port()
        assert ports.LOWEST_PORT <= port < 65536 and not low <= port <= high
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_handed_out(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        if not ports._bindable(busy + 1):
            pytest.skip("the port after the busy one is taken too")
        # two candidates left: the busy port and the one after it
        monkeypatch.setattr(ports, "LOWEST_PORT", busy)
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (busy + 2, 65535))
        assert {ports.unused_port() for _ in range(20)} == {busy + 1}


def test_no_free_port_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(ports, "_bindable", lambda port: False)
    with pytest.raises(RuntimeError, match="no free TCP port outside the ephemeral range"):
        ports.unused_port()
