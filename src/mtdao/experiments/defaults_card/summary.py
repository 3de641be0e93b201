"""The defaults card's numbers: per cell (corpus, length, sync period) each entry's final
validation loss over seeds, and every MT-DAO entry's gap to Local Adam and to DDP under the
significance rule (:func:`mtdao.experiments.common.formatting.compare_losses`); whether a short run
is the start of a long one (:func:`horizon_checks`); and how many steps each current entry needs
to reach DDP's loss at the reference length (:func:`steps_to_ddp`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from mtdao.experiments.common.formatting import SIGNIFICANCE_RULE, stats, verdict
from mtdao.experiments.defaults_card.grid import CURRENT_ENTRIES, ENTRIES, Grid, run_name
from mtdao.experiments.defaults_card.steps_to_loss import steps_to_reference_loss
from mtdao.train.config import TextSettings

KIND, SCHEMA = "defaults-card", 1  # results.json (see mtdao.experiments.common.results)

REFERENCES = ("local-adam", "ddp")


def summarize_card(
    grid: Grid,
    data: dict[str, str],
    missing: dict[str, str],
    results: dict[str, dict[str, Any]],
    failures: dict[str, str],
    data_split: str = TextSettings.data_split,
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
        "kind": KIND,
        "schema": SCHEMA,
        "grid": dataclasses.asdict(grid),
        "data": data,
        "data_split": data_split,
        "missing": missing,
        "entries": [dataclasses.asdict(entry) for entry in entries],
        "cells": cells,
        "significance_rule": SIGNIFICANCE_RULE,
        "horizons": horizon_checks(grid, data, results, [e.name for e in entries]),
        "steps_to_ddp": steps_to_ddp(grid, cells),
        "runs_finished": len(results),
        "failures": failures,
    }


def reuse_card(
    summary: dict[str, Any],
    earlier: dict[str, Any],
    grid: Grid,
    data: dict[str, str],
    suite,
    data_split: str,
    source: str,
) -> dict[str, Any]:
    """``summary`` with the final loss of every run it lacks taken from ``earlier`` (a card's
    results.json): the cells and the steps to DDP's loss count them, and a short-run check the
    runs here cannot make (the reused runs carry no evaluations) is the earlier card's. The
    summary lists the runs reused and where from."""
    reused = {}
    for cell in earlier["cells"]:
        for entry, values in cell["entries"].items():
            for seed, final in values["by_seed"].items():
                name = run_name(cell["corpus"], cell["steps"], cell["sync_period"], entry, seed)
                if final is not None and name not in suite.results:
                    reused[name] = {"final_val_loss": final}
    merged = summarize_card(
        grid, data, summary["missing"], {**reused, **suite.results}, suite.failures, data_split
    )
    checked = {_pair(check) for check in merged["horizons"]}
    merged["horizons"] += [c for c in earlier.get("horizons", []) if _pair(c) not in checked]
    merged["reused"] = {"from": source, "runs": sorted(reused)}
    merged["runs_finished"] = len(suite.results)
    return merged


def _pair(check: dict[str, Any]) -> tuple:
    return (check["corpus"], check["sync_period"], check["short"], check["long"])


def steps_to_ddp(grid: Grid, cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per corpus and sync period: DDP's mean final loss at the grid's reference length (the
    target), and for each current entry the steps its runs need to reach it, per seed,
    interpolated between the lengths it ran (:func:`steps_to_reference_loss`). Empty when the
    grid times nothing."""
    if grid.reference_steps is None:
        return []
    timed = []
    for corpus, sync_period in dict.fromkeys((c["corpus"], c["sync_period"]) for c in cells):
        own = [c for c in cells if (c["corpus"], c["sync_period"]) == (corpus, sync_period)]
        reference = next((c for c in own if c["steps"] == grid.reference_steps), None)
        target = reference and reference["entries"].get("ddp", {}).get("stats")
        if not target:
            continue
        by_entry = {}
        for entry in (e for e in CURRENT_ENTRIES if e in grid.entries):
            finals_by_seed = {
                str(seed): {
                    c["steps"]: c["entries"][entry]["by_seed"].get(str(seed))
                    for c in own
                    if c["steps"] <= grid.reference_steps
                }
                for seed in grid.seeds
            }
            by_entry[entry] = steps_to_reference_loss(
                finals_by_seed, target["mean"], grid.reference_steps
            )
        timed.append(
            {
                "corpus": corpus,
                "sync_period": sync_period,
                "reference_steps": grid.reference_steps,
                "target": target["mean"],
                "entries": by_entry,
            }
        )
    return timed


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
                "verdict": verdict(a, b),
                "lower_on": lower,
                "shared_seeds": len(shared),
            }
    return gaps


def horizon_checks(
    grid: Grid, data: dict[str, str], results: dict[str, dict[str, Any]], entries: list[str]
) -> list[dict[str, Any]]:
    """For each corpus, sync period, pair of lengths (short, the next longer) and entry: the
    short run's final loss against the longer run's at the short run's last step (interpolated
    between its evaluations), relative, mean over the seeds that have both. Every method's
    learning rate anneals to the short run's end, so a method is as horizon-free as the
    baselines when its figure is no higher than theirs."""
    checks = []
    for corpus, sync_period in dict.fromkeys((c, k) for c, _, k in grid.cells()):
        if corpus not in data:
            continue
        lengths = sorted(n for c, n, k in grid.cells() if (c, k) == (corpus, sync_period))
        for short, long in zip(lengths, lengths[1:]):
            by_entry = {}
            for entry in entries:
                ratios = []
                for seed in grid.seeds:
                    ended = results.get(run_name(corpus, short, sync_period, entry, seed))
                    longer = results.get(run_name(corpus, long, sync_period, entry, seed))
                    midway = _loss_at(longer, short)
                    if ended and ended.get("final_val_loss") and midway:
                        ratios.append(ended["final_val_loss"] / midway - 1)
                if ratios:
                    by_entry[entry] = {"mean": sum(ratios) / len(ratios), "seeds": len(ratios)}
            if by_entry:
                checks.append(
                    {
                        "corpus": corpus,
                        "sync_period": sync_period,
                        "short": short,
                        "long": long,
                        "entries": by_entry,
                    }
                )
    return checks


def _loss_at(results: dict[str, Any] | None, step: int) -> float | None:
    """A run's validation loss at ``step``, linear between the evaluations around it."""
    if not results:
        return None
    evals = [(e["step"], e["val_loss"]) for e in results.get("evals", [])]
    for (s0, l0), (s1, l1) in zip(evals, evals[1:]):
        if s0 <= step <= s1 and s1 > s0:
            return l0 + (l1 - l0) * (step - s0) / (s1 - s0)
    return None
