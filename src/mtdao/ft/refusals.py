"""Refused peers are named once, then once every ``every_s`` with a count, at most ``burst`` lines
per ``every_s`` in all: a flood of bogus ids must not print hundreds of lines per quorum."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass
class Refusal:
    """A refused peer (or, at a front, a kind of call) and what to say about it."""

    peer: str  # what a refusal is counted by (a quorum member's torchft id)
    line: str


@dataclass
class _Peer:
    said_at: float
    unsaid: int = 0  # refusals since its last line


class RefusalLog:
    def __init__(
        self,
        every_s: float = 60.0,
        burst: int = 20,
        clock: Callable[[], float] = time.monotonic,
        held_back: str = "peer quorum entries in the last {s} s that did not prove they belong to "
        "the run",
    ) -> None:
        self.every_s, self.burst, self.clock, self.held_back = every_s, burst, clock, held_back
        self._peers: dict[str, _Peer] = {}
        self._window_start = -float("inf")
        self._said_in_window = 0
        self._held_back = 0  # refusals not said in this window for the burst limit

    def lines(self, refused: Iterable[Refusal]) -> list[str]:
        """The lines to say for the refusals of one quorum."""
        now = self.clock()
        if now - self._window_start >= self.every_s:
            self._window_start, self._said_in_window = now, 0
        said = self._summary(now)
        for refusal in refused:
            peer = self._peers.get(refusal.peer)
            if peer is not None and now - peer.said_at < self.every_s:
                peer.unsaid += 1
                continue
            if self._said_in_window >= self.burst:
                self._held_back += 1
                continue
            again = ""
            if peer is not None:
                again = f" (refused {peer.unsaid + 1} times in the last {now - peer.said_at:.0f} s)"
            said.append(f"refused {refusal.line}{again}")
            self._said_in_window += 1
            self._peers[refusal.peer] = _Peer(said_at=now)
        self._forget(now)
        return said

    def _summary(self, now: float) -> list[str]:
        """A line for the refusals the burst limit held back in the window that just ended."""
        if not self._held_back or self._said_in_window:
            return []
        held, self._held_back = self._held_back, 0
        what = self.held_back.format(s=f"{self.every_s:.0f}")
        return [f"refused {held} more {what} (lines about them held back)"]

    def _forget(self, now: float) -> None:
        """Drop the peers not refused for ten windows (a flood of ids one after another)."""
        if len(self._peers) > 10_000:
            horizon = now - 10 * self.every_s
            self._peers = {k: v for k, v in self._peers.items() if v.said_at >= horizon}
