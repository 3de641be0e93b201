"""The numbers behind ``mtdao frontier``: pure functions of the runs' results.

A *point* is one method with one setting of its sync (K, codecs, state periods) at one learning
rate; its runs differ only by seed. Per point: the final validation loss over seeds, the bytes
each worker sent (the harness's account: encoded payloads, positions, scales and padding) and
the steady-state traffic reduction against DDP. Per method: its Pareto frontier (the points no
cheaper point of the same method beats). Per budget (DDP's bytes divided by 10, 40, ...): the best
point of each method within it, and whether the best method's lead is beyond seed noise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from mtdao.experiments.common.formatting import compare_losses, stats

KIND, SCHEMA = "frontier", 1  # results.json (see mtdao.experiments.common.results)

BUDGET_FACTORS = (10, 40, 100, 300, 1000)


def point_row(
    point: Mapping[str, Any], runs: Sequence[Mapping[str, Any]], seeds: Sequence[int]
) -> dict[str, Any]:
    """One point from its finished runs (``runs[i]`` of seed ``seeds[i]``)."""
    loss = stats(r.get("final_val_loss") for r in runs)
    first = runs[0] if runs else {}
    # a run shorter than its policy's full cycle has no steady state: its measured reduction
    steady = first.get("comm_reduction_steady_state")
    return {
        "name": point["name"],
        "method": point["method"],
        "argv": list(point["argv"]),
        "lr": point.get("lr"),
        "val_loss": loss,
        "seeds": list(seeds),
        "bytes_per_worker": first.get("bytes_per_worker"),
        "comm_reduction_steady_state": steady
        if steady is not None
        else first.get("comm_reduction_vs_ddp"),
        "no_steady_state": bool(runs) and steady is None,
    }


def runs_of_rows(rows: Sequence[Mapping[str, Any]]) -> dict[tuple[tuple[str, ...], int], dict]:
    """The inverse of :func:`point_row`: each seed's run of each row, as much of its results as
    the row kept, keyed by the point's argv and the seed (an earlier report's runs, reused)."""
    runs = {}
    for row in rows:
        if not row["seeds"]:  # a point the earlier report had no run of
            continue
        steady = None if row.get("no_steady_state") else row["comm_reduction_steady_state"]
        for seed, loss in zip(row["seeds"], row["val_loss"]["values"], strict=True):
            runs[tuple(row["argv"]), seed] = {
                "final_val_loss": loss,
                "bytes_per_worker": row["bytes_per_worker"],
                "comm_reduction_steady_state": steady,
                "comm_reduction_vs_ddp": row["comm_reduction_steady_state"],
            }
    return runs


def finite(row: Mapping[str, Any]) -> bool:
    loss = row.get("val_loss")
    return loss is not None and math.isfinite(loss["mean"]) and row.get("bytes_per_worker")


def pareto_front(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The rows no cheaper (or equally cheap) row beats, cheapest first: each has a lower mean
    loss than every row that sends fewer bytes."""
    front: list[Mapping[str, Any]] = []
    for row in sorted(
        (r for r in rows if finite(r)),
        key=lambda r: (r["bytes_per_worker"], r["val_loss"]["mean"]),
    ):
        if not front or row["val_loss"]["mean"] < front[-1]["val_loss"]["mean"]:
            front.append(row)
    return front


def fronts_by_method(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    methods = list(dict.fromkeys(r["method"] for r in rows))
    return {m: pareto_front([r for r in rows if r["method"] == m]) for m in methods}


def best_within(rows: Sequence[Mapping[str, Any]], budget: float) -> Mapping[str, Any] | None:
    """The lowest mean loss among the rows that sent at most ``budget`` bytes per worker."""
    within = [r for r in rows if finite(r) and r["bytes_per_worker"] <= budget]
    return min(within, key=lambda r: r["val_loss"]["mean"], default=None)


def budget_rows(
    rows: Sequence[Mapping[str, Any]], ddp_bytes: float, factors: Sequence[int] = BUDGET_FACTORS
) -> list[dict[str, Any]]:
    """Per budget ``ddp_bytes / factor``: each method's best point within it, the best method,
    its margin over the runner-up method and the significance rule's verdict on that margin."""
    methods = list(dict.fromkeys(r["method"] for r in rows if r["method"] != "ddp"))
    table = []
    for factor in factors:
        budget = ddp_bytes / factor
        best = {m: best_within([r for r in rows if r["method"] == m], budget) for m in methods}
        ranked = sorted(
            (row for row in best.values() if row is not None),
            key=lambda r: r["val_loss"]["mean"],
        )
        entry: dict[str, Any] = {
            "factor": factor,
            "budget_bytes": budget,
            "best_by_method": {m: (row["name"] if row else None) for m, row in best.items()},
            "winner": ranked[0]["name"] if ranked else None,
            "winner_method": ranked[0]["method"] if ranked else None,
        }
        if len(ranked) > 1:
            first, second = ranked[0], ranked[1]
            entry["runner_up"] = second["name"]
            entry["runner_up_method"] = second["method"]
            entry["margin"] = second["val_loss"]["mean"] - first["val_loss"]["mean"]
            enough = first["val_loss"]["n"] > 1 and second["val_loss"]["n"] > 1
            verdict = compare_losses(first["val_loss"], second["val_loss"])
            entry["beyond_noise"] = (verdict == "better") if enough else None
        table.append(entry)
    return table


def goal_points(
    rows: Sequence[Mapping[str, Any]], ddp_loss: float, method: str = "mtdao"
) -> list[dict[str, Any]]:
    """The study's goals for ``method``: its cheapest point within 1% of DDP's loss and within 3%,
    with the traffic reduction each reaches (None where no point is that close)."""
    goals = []
    for within, wanted in ((0.01, 200), (0.03, 500)):
        close = [
            r
            for r in rows
            if r["method"] == method
            and finite(r)
            and r["val_loss"]["mean"] <= ddp_loss * (1 + within)
        ]
        cheapest = min(close, key=lambda r: r["bytes_per_worker"], default=None)
        goals.append(
            {
                "within": within,
                "wanted_reduction": wanted,
                "point": cheapest["name"] if cheapest else None,
                "reduction": cheapest["comm_reduction_steady_state"] if cheapest else None,
                "met": bool(cheapest and cheapest["comm_reduction_steady_state"] >= wanted),
            }
        )
    return goals


def frontier_json(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``reports/frontier/frontier.json``: every point that finished, for tools."""
    points = []
    for row in rows:
        loss = row["val_loss"]
        if loss is None:
            continue
        points.append(
            {
                "method": row["method"],
                "argv": row["argv"],
                "final_val_loss_mean": loss["mean"],
                "final_val_loss_std": loss["std"],
                "seeds": row["seeds"],
                "bytes_per_worker": int(row["bytes_per_worker"]),
                "comm_reduction_steady_state": float(row["comm_reduction_steady_state"]),
            }
        )
    return {"points": points}
