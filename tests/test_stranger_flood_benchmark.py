"""benchmarks/stranger_flood.py's arithmetic, on made-up commit times (no run): the flood windows
alternate with quiet ones, and a background load that drifts through the run does not pass for
the flood's cost, while a real cost is measured whole."""

from __future__ import annotations

import importlib.util
import math
import statistics
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "stranger_flood.py"


@pytest.fixture(scope="module")
def flood():
    spec = importlib.util.spec_from_file_location("stranger_flood", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def commits(plan, gap_s) -> list[float]:
    """Commit times from the first window's start to the last's end, each ``gap_s(t, flooded)``
    after the one before."""
    times, t = [], plan[0][1]
    while t < plan[-1][2]:
        times.append(t)
        flooded = next(f for f, start, end in plan if start <= t < end)
        t += gap_s(t, flooded)
    return times


def test_the_windows_alternate_quiet_first_and_last(flood):
    plan = flood.windows(100.0, 10.0, 3)
    assert [flooded for flooded, _, _ in plan] == [False, True, False, True, False, True, False]
    assert plan[0][1] == 100.0 and plan[-1][2] == 170.0
    assert all(a[2] == b[1] for a, b in zip(plan, plan[1:]))


def test_a_load_that_drifts_through_the_run_is_not_counted_as_the_flood(flood):
    plan = flood.windows(0.0, 10.0, 6)
    # no cost at all, the background slowing the rounds from 0.2 s to 0.4 s over the windows
    times = commits(plan, lambda t, _: 0.2 + 0.2 * t / 130.0)
    pace = flood.replica_pace(times, plan)
    assert 0.99 <= min(pace["by_window"]) <= max(pace["by_window"]) <= 1.01
    # the flood's phase against the one before it reads that drift as a cost
    phases = statistics.median(flood.gaps(times, 0, 10)) / statistics.median(
        flood.gaps(times, 10, 130)
    )
    assert phases < 0.75


def test_a_flood_that_costs_a_fifth_of_the_pace_reads_as_80_percent(flood):
    plan = flood.windows(0.0, 10.0, 6)
    pace = flood.replica_pace(commits(plan, lambda _, flooded: 0.25 if flooded else 0.2), plan)
    assert math.isclose(pace["pace"], 0.8)
    assert all(math.isclose(p, 0.8) for p in pace["by_window"])
    assert pace["flood_rounds"] > 6 * 30 and pace["quiet_rounds"] > 7 * 40
