"""What a replica says of the peers it refuses: a flood of strangers is counted, not printed at
every quorum (200 bogus replica ids used to print 200 lines per quorum on every replica)."""

from __future__ import annotations

import pytest

pytest.importorskip("torchft")

from mtdao.ft.refusals import Refusal, RefusalLog  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stranger(index: int) -> Refusal:
    return Refusal(peer=f"{index}:bogus", line=f"the peer claiming replica id {index}: no claim")


def test_a_stranger_is_named_once_then_once_a_minute_with_a_count():
    clock = Clock()
    log = RefusalLog(clock=clock)
    assert log.lines([stranger(7)]) == ["refused the peer claiming replica id 7: no claim"]
    for second in range(1, 60):  # a quorum every second
        clock.now = second
        assert log.lines([stranger(7)]) == []
    clock.now = 60
    assert log.lines([stranger(7)]) == [
        "refused the peer claiming replica id 7: no claim (refused 60 times in the last 60 s)"
    ]


def test_a_flood_of_strangers_says_a_bounded_number_of_lines_a_minute():
    clock = Clock()
    log = RefusalLog(clock=clock, burst=20)
    said = []
    for second in range(120):  # 200 bogus ids in every quorum, a quorum a second, 2 minutes
        clock.now = second
        said += log.lines([stranger(i) for i in range(200)])
    named = [line for line in said if "replica id" in line]
    assert len(named) == 40  # the burst of each minute, no stranger twice in one
    assert len({line.split(":")[0] for line in named}) == 20
    (summary,) = [line for line in said if "more peer quorum entries" in line]
    assert summary.startswith("refused 10800 more peer quorum entries in the last 60 s")
