"""Repeated lines are said once a minute per kind, with a count of those held back."""

from __future__ import annotations

from mtdao.sync.repeated_lines import RepeatedLines


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


UNREACHABLE = "step {}: no round: the lighthouse at http://127.0.0.1:29510 is unreachable"


def test_a_kind_is_said_once_a_minute_then_with_the_count_held_back():
    clock = Clock()
    lines = RepeatedLines(every_s=60.0, clock=clock)
    said = []
    for step in range(700):  # ~700 in 18 s, as a replica whose lighthouse is away said them
        clock.now = step * 18 / 700
        said.append(lines.line(UNREACHABLE.format(step)))
    assert [line for line in said if line] == [UNREACHABLE.format(0)]
    clock.now = 61.0
    assert lines.line(UNREACHABLE.format(700)) == (
        UNREACHABLE.format(700) + " (and 699 more like it in the last 61 s)"
    )
    assert lines.line(UNREACHABLE.format(701)) is None


def test_another_kind_is_said_at_once():
    clock = Clock()
    lines = RepeatedLines(clock=clock)
    assert lines.line("step 1: round discarded (Connection closed by peer [127.0.0.1]:5000)")
    assert (
        lines.line("step 2: round discarded (Connection closed by peer [127.0.0.1]:6001)") is None
    )
    assert lines.line("step 3: refused the heal state of replica 0: params holds NaN/inf")
