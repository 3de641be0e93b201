"""The wall-clock model (:mod:`mtdao.experiments.common.wallclock`) calibrated on WAN drills, checked on a held-out drill.

From each drill without events (its ``drill.json``):

* compute per step: the replicas' measured ``compute_s_per_worker_step``;
* round time: from a replica's quorum request to its commit (the quorum at the lighthouse, the
  all-reduce, the commit), for every round all replicas committed together, outside events; the
  least over the replicas, so that a replica's wait for a slower one (a compute effect) is left
  out; the median over rounds;
* heals: every state transfer a joining replica received (bytes, seconds).

Fitted by least squares (:func:`fit`):

    round overhead = fixed_s + rtts_per_round * RTT + ring_bytes * 8 / (efficiency * rate)
    heal seconds   = heal_fixed_s + heal_rtts * RTT + heal_bytes * 8 / (heal_efficiency * rate)

with ``ring_bytes = 2 (M - 1) / M * bytes per round`` (a ring all-reduce's traffic per worker)
and RTT the round trip between two replica sites (a heal is a quorum, the source's metadata call
and an HTTP transfer: a fixed number of round trips besides its bytes; without the RTT term the
fit under-predicted a held-out drill's heal by half). A drill has one replica count, so the RTTs
per round cannot be split into the ring's share and the quorum's from drills alone: the split
assumes the ring's ``2 (M - 1)`` steps each wait one one-way delay (``M - 1`` round trips), the
rest being the quorum's and the commit's, and that is how :func:`round_seconds` extrapolates in
M.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mtdao.experiments.wan_drill.summary import rounds


@dataclass(frozen=True)
class DrillMeasurement:
    name: str
    workers: int
    parameters: int
    sync_period: int
    steps: int
    rtt_s: float
    rate_mbit: float
    compute_s_per_step: float
    bytes_per_round: float
    round_overhead_s: float
    rounds_measured: int
    train_s: float
    """Wall time from the first step to the last round every replica committed together."""
    heals: tuple[tuple[float, float], ...]
    """(bytes, seconds) of every state transfer to a joining replica."""

    @property
    def ring_bits(self) -> float:
        return 2 * (self.workers - 1) / self.workers * self.bytes_per_round * 8


def _results(path: Path, site: str) -> dict[str, Any]:
    return json.loads((path.parent / "replicas" / site / "results.json").read_text())


def round_times(record: dict[str, Any]) -> list[float]:
    """Per round every replica committed together (outside events): the least, over replicas,
    of the seconds from its quorum request to its commit."""
    everyone = len(record["replicas"])
    windows = [(e["began"] - 5, (e.get("ended") or e["until"]) + 5) for e in record["events"]]
    per_round: dict[int, list[float]] = {}
    for site in record["replicas"]:
        events = record["replicas"][site]["events"]
        for quorum, committed in zip(events, events[1:]):
            if quorum["event"] != "quorum" or committed["event"] != "committed":
                continue
            if len(committed["replicas"]) != everyone or quorum.get("heal"):
                continue
            start = quorum["time"] - quorum["seconds"]
            if any(a <= committed["time"] and start <= b for a, b in windows):
                continue
            per_round.setdefault(committed["step"], []).append(committed["time"] - start)
    return [min(values) for values in per_round.values() if len(values) == everyone]


def measure(path: Path) -> DrillMeasurement:
    """What one drill without events measured (``path``: its ``drill.json``)."""
    record = json.loads(Path(path).read_text())
    settings, links = record["settings"], record["links"]
    sites = list(record["replicas"])
    results = {site: _results(Path(path), site) for site in sites}
    compute = statistics.median(r["compute_s_per_worker_step"] for r in results.values())
    period = settings["sync_period"]
    round_count = settings["steps"] // period
    bytes_per_round = statistics.median(r["bytes_per_worker"] for r in results.values())
    bytes_per_round /= round_count
    times = round_times(record)
    if not times:
        raise ValueError(f"{path}: no round of every replica to time")
    a, b = links[sites[0]], links[sites[1]]
    heals = tuple(
        (e["heal"]["bytes"], e["heal"]["seconds"])
        for site in sites
        for e in rounds(record, site, "quorum")
        if e.get("heal") and e["heal"]["bytes"] > 0
    )
    committed = [e["time"] for e in rounds(record, sites[0], "committed")]
    return DrillMeasurement(
        name=str(Path(path).parent.name),
        workers=len(sites),
        parameters=results[sites[0]]["parameters"],
        sync_period=period,
        steps=settings["steps"],
        rtt_s=2 * (a["delay_ms"] + b["delay_ms"]) / 1000,
        rate_mbit=min(a["rate_mbit"], b["rate_mbit"]),
        compute_s_per_step=compute,
        bytes_per_round=bytes_per_round,
        round_overhead_s=statistics.median(times),
        rounds_measured=len(times),
        train_s=max(committed) - record["t0"],
        heals=heals,
    )


@dataclass(frozen=True)
class Calibration:
    fixed_s: float
    rtts_per_round: float
    efficiency: float
    heal_fixed_s: float
    heal_efficiency: float
    calibrated_workers: int
    heal_rtts: float = 0.0

    @property
    def quorum_rtts(self) -> float:
        """Round trips per round besides the ring's (``M - 1`` at the calibrated M)."""
        return self.rtts_per_round - (self.calibrated_workers - 1)


def _least_squares(rows: list[list[float]], targets: list[float]) -> list[float]:
    import numpy

    solution, *_ = numpy.linalg.lstsq(numpy.array(rows), numpy.array(targets), rcond=None)
    return [float(x) for x in solution]


def _rank(rows: list[list[float]]) -> int:
    import numpy

    return int(numpy.linalg.matrix_rank(numpy.array(rows))) if rows else 0


def fit(measurements: list[DrillMeasurement]) -> Calibration:
    rows = [[1.0, m.rtt_s, m.ring_bits / (m.rate_mbit * 1e6)] for m in measurements]
    if _rank(rows) < 3:  # three points in general position, two RTTs among them
        raise ValueError(
            "calibrating needs drills at 3 or more (RTT, bytes / rate) points, at two RTTs or more"
        )
    fixed, rtts, inverse_efficiency = _least_squares(
        rows, [m.round_overhead_s for m in measurements]
    )
    heal_rows = [
        [1.0, m.rtt_s, b * 8 / (m.rate_mbit * 1e6)] for m in measurements for b, _ in m.heals
    ]
    heal_targets = [s for m in measurements for _, s in m.heals]
    heal_fixed, heal_rtts, heal_inverse = float("nan"), float("nan"), float("nan")
    without_rtt = [[1.0, x] for _, _, x in heal_rows]
    if _rank(heal_rows) == 3:
        heal_fixed, heal_rtts, heal_inverse = _least_squares(heal_rows, heal_targets)
    elif _rank(without_rtt) == 2:  # RTT not told apart: no RTT term
        heal_rtts = 0.0
        heal_fixed, heal_inverse = _least_squares(without_rtt, heal_targets)
    return Calibration(
        fixed_s=fixed,
        rtts_per_round=rtts,
        efficiency=1 / inverse_efficiency if inverse_efficiency > 0 else float("inf"),
        heal_fixed_s=heal_fixed,
        heal_efficiency=1 / heal_inverse if heal_inverse > 0 else float("inf"),
        calibrated_workers=measurements[0].workers,
        heal_rtts=heal_rtts,
    )


def round_seconds(
    calibration: Calibration,
    bytes_per_round: float,
    workers: int,
    rtt_s: float,
    rate_gbit: float,
    quorum: bool = True,
) -> float:
    """One round's overhead: quorum and commit (``quorum``: a fault-tolerant round), the ring's
    ``M - 1`` round trips, the ring's bytes at the calibrated efficiency."""
    if workers == 1:
        return calibration.fixed_s if quorum else 0.0
    ring_bits = 2 * (workers - 1) / workers * bytes_per_round * 8
    rtts = (workers - 1) + (max(calibration.quorum_rtts, 0.0) if quorum else 0.0)
    fixed = calibration.fixed_s if quorum else 0.0
    return fixed + rtts * rtt_s + ring_bits / (calibration.efficiency * rate_gbit * 1e9)


def heal_seconds(
    calibration: Calibration, heal_bytes: float, rate_gbit: float, rtt_s: float
) -> float:
    transfer = heal_bytes * 8 / (calibration.heal_efficiency * rate_gbit * 1e9)
    return calibration.heal_fixed_s + calibration.heal_rtts * rtt_s + transfer


def predict_drill(calibration: Calibration, m: DrillMeasurement) -> dict[str, float]:
    """The calibrated model's figures for drill ``m`` beside what it measured."""
    overhead = round_seconds(calibration, m.bytes_per_round, m.workers, m.rtt_s, m.rate_mbit / 1000)
    rounds_run = m.steps // m.sync_period
    heal_bytes = statistics.median(b for b, _ in m.heals) if m.heals else 0.0
    heal_s = heal_seconds(calibration, heal_bytes, m.rate_mbit / 1000, m.rtt_s)
    return {
        "round_interval_s": m.sync_period * m.compute_s_per_step + overhead,
        "measured_round_interval_s": m.sync_period * m.compute_s_per_step + m.round_overhead_s,
        "round_s": overhead,
        "measured_round_s": m.round_overhead_s,
        "train_s": m.steps * m.compute_s_per_step + rounds_run * overhead,
        "measured_train_s": m.train_s,
        "heal_s": heal_s if m.heals else None,
        "measured_heal_s": statistics.median(s for _, s in m.heals) if m.heals else None,
    }


def calibration_record(calibration: Calibration, measurements, held_out) -> dict[str, Any]:
    return {
        "calibration": {**asdict(calibration), "quorum_rtts": calibration.quorum_rtts},
        "measurements": [{**asdict(m), "ring_bits": m.ring_bits} for m in measurements],
        "held_out": [
            {"measurement": asdict(m), "prediction": predict_drill(calibration, m)}
            for m in held_out
        ],
    }
