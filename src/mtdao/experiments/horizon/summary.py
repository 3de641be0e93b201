"""The numbers of the horizon and variants study (:mod:`.run`): a pure function
of its results.json (the collected LR sweeps, final losses and evaluation curves).

Every experiment is one configuration at one horizon; its LR is the best of a seed-0 sweep, the
other seeds run at that LR. An experiment is *final* when its sweep is bracketed (a worse LR on
both sides of the best), refined (both sqrt(2) neighbours of the best run) and every planned seed
has finished; otherwise its figures are provisional. report.md is written by
:mod:`.report`, the figures drawn by :mod:`.plots`.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping
from typing import Any

KIND, SCHEMA = "horizon", 1  # results.json (see mtdao.experiments.common.results)

BASELINES = {"p1": ("local-adam", "ddp"), "p2": ("local-adopt", "ddp")}
HORIZON_METHODS = ("ddp", "local-adam", "mtdao-default", "mtdao-paper", "beta-wu", "both-wu")
# the horizon curve's runs live in p1, except where a variant's K = 32 screen ran that horizon
HORIZON_HOMES = {("both-wu", 3000): "p3", ("beta-wu", 3000): "p3"}
HORIZONS = (1000, 3000, 10000)


def stats(experiment: Mapping[str, Any]) -> dict[str, Any] | None:
    """Mean, sample std and count of the final losses at the best LR (None when none)."""
    values = experiment.get("values") or []
    if not values:
        return None
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "std": std, "n": len(values)}


def state(experiment: Mapping[str, Any]) -> str:
    """final, or what is still missing."""
    missing = []
    if not experiment.get("sweep"):
        return "not started"
    if experiment.get("lr_from"):
        pass  # the LR is another experiment's best (a check on data never tuned on): no sweep
    elif not experiment.get("bracketed"):
        missing.append("sweep not bracketed yet")
    elif not experiment.get("refined"):
        missing.append("sweep not refined yet")
    done, planned = len(experiment.get("values") or []), len(experiment["planned_seeds"])
    if done < planned:
        missing.append(f"{done}/{planned} seeds")
    return "final" if not missing else "provisional: " + ", ".join(missing)


def gap(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any] | None:
    """a - b with the significance rule: it counts only beyond the sum of the two sample stds."""
    sa, sb = stats(a), stats(b)
    if sa is None or sb is None:
        return None
    diff, noise = sa["mean"] - sb["mean"], sa["std"] + sb["std"]
    if sa["n"] < 2 or sb["n"] < 2:
        verdict = "no noise estimate"
    else:
        verdict = "tie" if abs(diff) <= noise else ("better" if diff < 0 else "worse")
    return {"diff": diff, "relative": diff / sb["mean"], "noise": noise, "verdict": verdict}


def paired(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any] | None:
    """a - b seed by seed (a seed fixes the data order and the initial weights of both): mean
    difference over the seeds both have, and on how many of them a is lower."""
    a_by_seed = dict(zip(a.get("seeds") or [], a.get("values") or []))
    b_by_seed = dict(zip(b.get("seeds") or [], b.get("values") or []))
    diffs = [a_by_seed[s] - b_by_seed[s] for s in sorted(set(a_by_seed) & set(b_by_seed))]
    if not diffs:
        return None
    return {"diff": statistics.fmean(diffs), "lower": sum(d < 0 for d in diffs), "n": len(diffs)}


def crossing(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    """The evaluation step where a's mean curve first drops below b's, and whether it stays."""
    curve_a, curve_b = dict(map(tuple, a.get("curve", []))), dict(map(tuple, b.get("curve", [])))
    steps = sorted(set(curve_a) & set(curve_b))
    if not steps:
        return "-"
    below = [curve_a[s] < curve_b[s] for s in steps]
    if not any(below):
        return "never"
    first = steps[below.index(True)]
    stays = next((steps[i] for i in range(len(steps)) if all(below[i:])), None)
    return f"step {first}" + (f", below from {stays} on" if stays else ", not at the end")


def experiments_by_id(summary: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["id"]: e for e in summary["experiments"]}


def baselines(experiment: Mapping[str, Any]) -> tuple[str, str] | None:
    """(local baseline id, DDP id) that an experiment is compared with, None for a baseline."""
    block, label, steps = experiment["id"].split("/")
    if label in ("ddp", "local-adam", "local-adopt") or re.fullmatch(r"k\d+-local-adam", label):
        return None
    if block in ("p5", "p6", "p7"):  # a setting of its own (b64-, vim-, cos-): its own baselines
        if label.endswith(("-local-adam", "-ddp")):
            return None
        prefix = re.match(r"[a-z]+\d*-(k\d+-)?", label).group(0)
        ddp_prefix = re.sub(r"k\d+-", "", prefix)  # DDP has no sync period
        return f"{block}/{prefix}local-adam/{steps}", f"{block}/{ddp_prefix}ddp/{steps}"
    if block in BASELINES:
        local, ddp = BASELINES[block]
        return f"{block}/{local}/{steps}", f"{block}/{ddp}/{steps}"
    if block == "p4":  # DDP has no period: the K = 32 table's DDP at the same steps
        period = label.split("-")[0]
        return f"p4/{period}-local-adam/{steps}", f"p1/ddp/{steps}"
    return f"p1/local-adam/{steps}", f"p1/ddp/{steps}"  # p3: variants at K = 32


def screen_references(experiment: Mapping[str, Any]) -> tuple[str, str] | None:
    """(MT-DAO default id, Local Adam id) of an experiment's setting, for the seed-0 screen; None
    outside the screened blocks (variants, periods, batch)."""
    block, label, steps = experiment["id"].split("/")
    if block == "p3":
        return f"p1/mtdao-default/{steps}", f"p1/local-adam/{steps}"
    if block in ("p4", "p5"):
        prefix = label.split("-")[0]
        return f"{block}/{prefix}-mtdao-default/{steps}", f"{block}/{prefix}-local-adam/{steps}"
    return None


def seed0_best(experiment: Mapping[str, Any]) -> float | None:
    """The seed-0 loss at the best LR of the sweep (None before any finite run)."""
    finite = [p["loss"] for p in experiment.get("sweep") or [] if p["loss"] is not None]
    return min(finite) if finite else None


def screen_rows(summary, by_id) -> list[tuple[dict[str, Any], float, float | None, float | None]]:
    """(experiment, seed-0 loss, - MT-DAO default, - Local Adam) of every screened experiment."""
    rows = []
    for e in summary["experiments"]:
        refs, loss = screen_references(e), seed0_best(e)
        if refs is None or loss is None:
            continue
        diffs = []
        for ref_id in refs:
            ref = seed0_best(by_id.get(ref_id, {}))
            diffs.append(None if ref is None or ref_id == e["id"] else loss - ref)
        rows.append((e, loss, diffs[0], diffs[1]))
    return rows


def horizon_id(label: str, steps: int) -> str:
    return f"{HORIZON_HOMES.get((label, steps), 'p1')}/{label}/{steps}"


def horizon_experiments(summary: Mapping[str, Any], label: str) -> list[dict[str, Any]]:
    return [e for e in summary["experiments"] if e["id"] == horizon_id(label, e["steps"])]


def nan_free(value: float) -> float | None:
    """JSON has no inf: a diverged run is stored as None."""
    return value if math.isfinite(value) else None
