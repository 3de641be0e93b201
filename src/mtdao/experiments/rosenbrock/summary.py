"""The numbers behind the Rosenbrock toy's report: a pure function of the runs' result dicts.

Spread over seeds is the population std (ddof 0) of the final values, 0 when one is not finite;
the toy states no significance rule, it counts converged and diverged seeds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mtdao.experiments.rosenbrock.problem import METHODS

KIND, SCHEMA = "rosenbrock", 1  # results.json (see mtdao.experiments.common.results)


def _spread(values: Sequence[float]) -> float:
    return statistics.pstdev(values) if all(map(math.isfinite, values)) else 0


def _as_float(values: Iterable[float | None]) -> list[float]:
    """Final values; None (a diverged run's loss as JSON stores it) is inf again."""
    return [math.inf if v is None else v for v in values]


def summarize(results: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per method: final loss and distance (mean, std over seeds), diverged and converged counts."""
    summary = {}
    for method in METHODS:
        runs = [r for r in results if r["method"] == method]
        if not runs:
            continue
        losses = _as_float(r["final_loss"] for r in runs)
        distances = _as_float(r["final_distance"] for r in runs)
        summary[method] = {
            "beta": runs[0]["beta"],
            "omega": runs[0]["omega"],
            "seeds": [r["seed"] for r in runs],
            "final_loss": losses,
            "final_loss_mean": statistics.fmean(losses),
            "final_loss_std": _spread(losses),
            "final_distance_mean": statistics.fmean(distances),
            "final_distance_std": _spread(distances),
            "diverged": sum(r["diverged"] for r in runs),
            "converged": sum(r["converged"] for r in runs),
        }
    return summary
