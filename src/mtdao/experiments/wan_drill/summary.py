"""Figures of one WAN drill from its record: rounds, bytes per site, and what each event cost.

* time to heal: from the end of an event (a restart, the partition healed, the rate or CPU given
  back) to the first round that every replica committed together again;
* steps lost: how far the group's frontier (the most advanced replica's step) fell behind where
  it would be at its pace of the ``PACE_WINDOW_S`` before the event, measured when healed;
* rounds discarded while the event lasted and until healed;
* absent steps: the group steps the struck replica missed, from its step at the event to the
  step it healed to on rejoining (a kill or a partition long enough to drop it).
"""

from __future__ import annotations

import bisect
from typing import Any

PACE_WINDOW_S = 15.0


def rounds(record: dict[str, Any], site: str, kind: str) -> list[dict[str, Any]]:
    return [e for e in record["replicas"][site]["events"] if e["event"] == kind]


def full_rounds(record: dict[str, Any]) -> list[tuple[float, int]]:
    """(time, step) of every round committed by all replicas together, in time order."""
    everyone = len(record["replicas"])
    seen = {}
    for site in record["replicas"]:
        for event in rounds(record, site, "committed"):
            if len(event["replicas"]) == everyone:
                seen.setdefault(event["step"], event["time"])
    return sorted((time, step) for step, time in seen.items())


def frontier(record: dict[str, Any]) -> tuple[list[float], list[int]]:
    """The most advanced replica's step at every sample."""
    times = [s["time"] for s in record["samples"]]
    return times, [max(s["steps"].values()) for s in record["samples"]]


def _at(times: list[float], values: list[int], when: float) -> int:
    index = max(bisect.bisect_right(times, when) - 1, 0)
    return values[index]


def event_effects(record: dict[str, Any]) -> list[dict[str, Any]]:
    together = full_rounds(record)
    times, steps = frontier(record)
    effects = []
    for event in record["events"]:
        began, ended = event["began"], event.get("ended") or event["until"]
        after = [t for t, _ in together if t > ended]
        healed = after[0] if after else None
        until = healed if healed is not None else record["ended"]
        discarded = {
            e["step"]
            for site in record["replicas"]
            for e in rounds(record, site, "discarded")
            if began <= e["time"] <= until
        }
        pace_from = max(began - PACE_WINDOW_S, times[0]) if times else began
        pace = (_at(times, steps, began) - _at(times, steps, pace_from)) / max(
            began - pace_from, 1e-9
        )
        expected = pace * (until - began)
        progressed = _at(times, steps, until) - _at(times, steps, began)
        effects.append(
            {
                "label": event["label"],
                "at_s": began - record["t0"],
                "for_s": ended - began,
                "heal_s": None if healed is None else healed - ended,
                "steps_lost": max(expected - progressed, 0.0) if times else None,
                "rounds_discarded": len(discarded),
                "absent_steps": absent_steps(record, event),
            }
        )
    return effects


def absent_steps(record: dict[str, Any], event: dict[str, Any]) -> int | None:
    """Group steps the struck replica missed: from its step at the event to the step it healed
    to when it rejoined (None when it did not leave the quorum)."""
    if event["site"] not in record["replicas"]:
        return None
    heals = [e for e in record["replicas"][event["site"]]["events"]
             if e.get("heal") and e["time"] > event["began"]]  # fmt: skip
    if not heals:
        return None
    times = [s["time"] for s in record["samples"]]
    index = max(bisect.bisect_right(times, event["began"]) - 1, 0)
    before = record["samples"][index]["steps"][event["site"]] if times else 0
    return heals[0]["heal"]["step"] - max(before, 0)


def site_bytes(record: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Bytes each site sent and received over the drill (interface counters)."""
    samples = [s for s in record["samples"] if s["bytes"]]
    if not samples:
        return {}
    first, last = samples[0]["bytes"], samples[-1]["bytes"]
    return {
        site: {d: last[site][d] - first.get(site, {d: 0})[d] for d in ("sent", "received")}
        for site in last
    }


def round_counts(record: dict[str, Any]) -> dict[str, dict[str, int]]:
    return {
        site: {kind: len(rounds(record, site, kind)) for kind in ("committed", "discarded")}
        for site in record["replicas"]
    }
