"""No silent wait in a round: a slow collective says what it waits for, and one whose peer is gone
(a partition sends no reset; gloo would wait out its timeout) is given up within seconds by
probing the peers' heal servers."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class PeerLost(ConnectionError):
    """A peer of the round stopped answering while a collective waited for it."""


@dataclass(frozen=True)
class Peer:
    replica_id: int
    host: str
    port: int


@dataclass
class CollectiveWatch:
    say: Callable[[str], None]
    say_after_s: float = 5.0
    probe_every_s: float = 1.0
    misses: int = 3
    probe_timeout_s: float = 1.0

    def wait(self, work: Any, what: str, peers: list[Peer]) -> None:
        """Wait for ``work``, a collective of the round ``what`` names, with ``peers``; raises
        what the collective raises, or PeerLost."""
        done = threading.Event()
        future = getattr(work, "_work", work).get_future()  # torchft's managed work wraps it
        future.add_done_callback(lambda _: done.set())
        started = time.monotonic()
        if not done.wait(self.say_after_s):
            self._watch(done, started, what, peers)
        work.wait()

    def _watch(self, done: threading.Event, started: float, what: str, peers: list[Peer]) -> None:
        names = ", ".join(str(p.replica_id) for p in peers) or "none"
        self.say(
            f"waiting {time.monotonic() - started:.0f} s for {what} with replicas {names}; "
            "probing them"
        )
        missed = {peer: 0 for peer in peers}
        say_at = 6 * self.say_after_s
        while not done.wait(self.probe_every_s):
            for peer in peers:
                answers = accepts(peer.host, peer.port, self.probe_timeout_s)
                missed[peer] = 0 if answers else missed[peer] + 1
            lost = [peer for peer in peers if missed[peer] >= self.misses]
            waited = time.monotonic() - started
            if lost:
                gone = ", ".join(f"replica {p.replica_id} ({p.host}:{p.port})" for p in lost)
                raise PeerLost(
                    f"{gone} stopped answering while {what} waited for it ({waited:.0f} s)"
                )
            if waited >= say_at:
                self.say(f"still waiting {waited:.0f} s for {what} with replicas {names}")
                say_at *= 2


def accepts(host: str, port: int, timeout: float) -> bool:
    """Whether ``host``:``port`` accepts a connection within ``timeout`` seconds."""
    try:
        socket.create_connection((host.strip("[]"), port), timeout=timeout).close()
    except OSError:
        return False
    return True
