"""The defaults card's numbers: per cell (corpus, length, sync period) each entry's final
validation loss over seeds, and every MT-DAO entry's gap to Local Adam and to DDP under the
significance rule (:func:`mtdao.experiments.formatting.compare_losses`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from mtdao.experiments.defaults_card import ENTRIES, Grid, run_name
from mtdao.experiments.formatting import SIGNIFICANCE_RULE, compare_losses, stats

REFERENCES = ("local-adam", "ddp")


def summarize_card(
    grid: Grid,
    data: dict[str, str],
    missing: dict[str, str],
    results: dict[str, dict[str, Any]],
    failures: dict[str, str],
) -> dict[str, Any]:
    entries = [entry for entry in ENTRIES if entry.name in grid.entries]
    cells = []
    for corpus, steps, sync_period in grid.cells():
        if corpus not in data:
            continue
        by_entry = {}
        for entry in entries:
            finals = [
                _final(results.get(run_name(corpus, steps, sync_period, entry.name, seed)))
                for seed in grid.seeds
            ]
            by_entry[entry.name] = {
                "stats": stats(finals),
                "by_seed": dict(zip(map(str, grid.seeds), finals)),
            }
        cells.append(
            {
                "corpus": corpus,
                "steps": steps,
                "sync_period": sync_period,
                "entries": by_entry,
                "gaps": _gaps(by_entry, [e.name for e in entries if e.method == "mtdao"]),
            }
        )
    return {
        "kind": "defaults-card",
        "grid": dataclasses.asdict(grid),
        "data": data,
        "missing": missing,
        "entries": [dataclasses.asdict(entry) for entry in entries],
        "cells": cells,
        "significance_rule": SIGNIFICANCE_RULE,
        "runs_finished": len(results),
        "failures": failures,
    }


def _final(results: dict[str, Any] | None) -> float | None:
    if results is None:
        return None
    loss = results.get("final_val_loss")
    return float("inf") if loss is None else loss


def _gaps(by_entry: dict[str, dict], candidates: list[str]) -> dict[str, dict[str, Any]]:
    """For each MT-DAO entry and reference: difference of means, relative difference, the
    verdict, and on how many shared seeds the entry is lower."""
    gaps: dict[str, dict[str, Any]] = {}
    for name in candidates:
        mine = by_entry[name]
        if mine["stats"] is None:
            continue
        for reference in REFERENCES:
            theirs = by_entry.get(reference)
            if not theirs or theirs["stats"] is None:
                continue
            a, b = mine["stats"], theirs["stats"]
            shared = [
                seed
                for seed, value in mine["by_seed"].items()
                if value is not None and theirs["by_seed"].get(seed) is not None
            ]
            lower = sum(mine["by_seed"][s] < theirs["by_seed"][s] for s in shared)
            gaps.setdefault(name, {})[reference] = {
                "difference": a["mean"] - b["mean"],
                "relative": (a["mean"] - b["mean"]) / b["mean"] if b["mean"] else None,
                "verdict": compare_losses(a, b) if min(a["n"], b["n"]) > 1 else "one seed",
                "lower_on": lower,
                "shared_seeds": len(shared),
            }
    return gaps
