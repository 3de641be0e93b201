"""Lines said again and again, said once a minute: each kind at most once every ``every_s``
seconds, with a count of the lines of that kind held back since.

A replica whose lighthouse is away discards a round at every step that has one, and a faulty
peer is refused at every quorum: a line each time was hundreds of lines a minute. A line's kind
is the line with its numbers blanked out (steps, ports, sizes), so "step 12: no round: ..." and
"step 13: no round: ..." are one kind, and a new kind of failure is said at once.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

_NUMBER = re.compile(r"\d+")
KINDS_KEPT = 1000
"""Kinds remembered at most (the oldest said is forgotten first)."""


@dataclass
class _Kind:
    said_at: float
    held_back: int = 0


class RepeatedLines:
    def __init__(self, every_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.every_s, self.clock = every_s, clock
        self._kinds: dict[str, _Kind] = {}

    def line(self, text: str) -> str | None:
        """``text`` to say now, with the count of its kind held back since it was last said
        appended; None when a line of its kind was said less than ``every_s`` ago."""
        kind, now = _NUMBER.sub("#", text), self.clock()
        seen = self._kinds.get(kind)
        if seen is not None and now - seen.said_at < self.every_s:
            seen.held_back += 1
            return None
        if seen is not None and seen.held_back:
            text += f" (and {seen.held_back} more like it in the last {now - seen.said_at:.0f} s)"
        self._kinds.pop(kind, None)
        self._kinds[kind] = _Kind(said_at=now)
        if len(self._kinds) > KINDS_KEPT:
            del self._kinds[next(iter(self._kinds))]
        return text
