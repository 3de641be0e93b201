"""The numbers behind ``mtdao ablation``'s report: pure functions of the runs' results dicts.

The degradation of a run is its final validation loss minus DDP's mean; its noise is the sum of the
two standard deviations over seeds (the significance rule of :mod:`mtdao.experiments.common.formatting`).
How fast a variant degrades is the least-squares slope of its degradation over log2 K.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mtdao.experiments.ablation.variants import Variant
from mtdao.experiments.common.formatting import SIGNIFICANCE_RULE, compare_losses, stats
from mtdao.experiments.common.results import read_results

KIND, SCHEMA = "ablation", 1  # results.json (see mtdao.experiments.common.results)


def degradation_slope(periods: Sequence[int], degradation: Sequence[float]) -> float | None:
    """Least-squares growth of the degradation per doubling of K; None with fewer than 2 points."""
    points = [(math.log2(k), d) for k, d in zip(periods, degradation) if math.isfinite(d)]
    if len(points) < 2:
        return None
    x, y = np.array(points).T
    return float(np.polyfit(x, y, 1)[0])


def period_cell(runs: Sequence[Mapping[str, Any]], ddp: Mapping[str, Any]) -> dict[str, Any]:
    """One variant at one K (one run per seed) against DDP's final-loss :func:`stats`."""
    loss = stats(r["final_val_loss"] for r in runs)
    sent = stats(r["bytes_per_worker"] for r in runs)["mean"]
    ddp_bytes = stats(r["ddp_bytes_per_worker"] for r in runs)["mean"]
    return {
        "final_val_loss": loss,
        "degradation": loss["mean"] - ddp["mean"],
        "noise": loss["std"] + ddp["std"],
        "versus_ddp": compare_losses(loss, ddp),
        "bytes_per_worker": sent,
        "traffic_vs_ddp": ddp_bytes / sent if sent else math.inf,
        "periods": runs[0].get("periods"),
    }


def summarize_variant(
    variant: Variant, runs_by_period: Mapping[int, Sequence[Mapping[str, Any]]], ddp: Mapping
) -> dict[str, Any]:
    cells = {k: period_cell(runs, ddp) for k, runs in runs_by_period.items() if runs}
    ks = sorted(cells)
    return {
        "method": variant.method,
        "betas": variant.betas,
        "omegas": variant.omegas,
        "sync_policy": variant.sync_policy,
        "color": variant.color,
        "linestyle": variant.linestyle,
        "periods": cells,
        "slope_per_doubling": degradation_slope(ks, [cells[k]["degradation"] for k in ks]),
    }


def summarize_ablation(
    ddp_runs: Sequence[Mapping[str, Any]],
    per_variant: Mapping[str, Mapping[int, Sequence[Mapping[str, Any]]]],
    variants: Sequence[Variant],
    settings: Mapping[str, Any],
    failures: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The aggregate written to results.json (with the runs beside it) and rendered."""
    ddp = stats(r["final_val_loss"] for r in ddp_runs)
    by_name = {v.name: v for v in variants}
    return {
        "settings": dict(settings),
        "significance_rule": SIGNIFICANCE_RULE,
        "ddp": {"final_val_loss": ddp},
        "variants": {
            name: summarize_variant(by_name[name], runs_by_period, ddp)
            for name, runs_by_period in per_variant.items()
        },
        "failures": dict(failures or {}),
    }


def load_summary(path: Path) -> dict[str, Any]:
    """An ablation's results.json as :func:`summarize_ablation` returned it (JSON made the
    periods' integer keys strings)."""
    summary = read_results(path, KIND, SCHEMA)
    for variant in summary["variants"].values():
        variant["periods"] = {int(k): cell for k, cell in variant["periods"].items()}
    return summary


# -- what the verdict says ------------------------------------------------------------------------


def slope_pairs(variants: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str, str]]:
    """Per MT-DAO period rule with at least two slow momenta: (policy, slowest momentum's
    variant, fastest momentum's variant), the pair the paper's claim is about."""
    pairs = []
    for policy in dict.fromkeys(
        v["sync_policy"] for v in variants.values() if v["method"] == "mtdao"
    ):
        ranked = sorted(
            (v["betas"][0], n)
            for n, v in variants.items()
            if v["sync_policy"] == policy and v["slope_per_doubling"] is not None
        )
        if len(ranked) >= 2:
            pairs.append((policy, ranked[-1][1], ranked[0][1]))
    return pairs


def slope_comparison(slow: Mapping[str, Any], fast: Mapping[str, Any]) -> dict[str, Any]:
    """Does the slower momentum's degradation grow more slowly with K? The change of degradation
    over the whole common K range, against the mean noise at its two ends: 'alike' within the
    noise, else 'slower' or 'faster'."""
    ks = sorted(set(slow["periods"]) & set(fast["periods"]))
    span = math.log2(ks[-1] / ks[0]) if len(ks) > 1 else 0.0
    difference = (slow["slope_per_doubling"] - fast["slope_per_doubling"]) * span
    noise = statistics.fmean(
        info["periods"][k]["noise"] for info in (slow, fast) for k in (ks[0], ks[-1])
    )
    if abs(difference) <= noise:
        outcome = "alike"
    else:
        outcome = "slower" if difference < 0 else "faster"
    return {"ks": ks, "difference": difference, "noise": noise, "outcome": outcome}


def best_versus_local(
    variants: Mapping[str, Mapping[str, Any]], periods: Sequence[int]
) -> list[tuple[int, str, str]]:
    """Per K: (K, the MT-DAO variant with the lowest mean loss, its outcome against Local Adam
    under the significance rule)."""
    local = variants.get("Local Adam")
    mtdao = [n for n, v in variants.items() if v["method"] == "mtdao"]
    if not local or not mtdao:
        return []
    results = []
    for k in periods:
        candidates = [n for n in mtdao if k in variants[n]["periods"]]
        if k not in local["periods"] or not candidates:
            continue
        best = min(candidates, key=lambda n: variants[n]["periods"][k]["final_val_loss"]["mean"])
        outcome = compare_losses(
            variants[best]["periods"][k]["final_val_loss"], local["periods"][k]["final_val_loss"]
        )
        results.append((k, best, outcome))
    return results


def degradation_curves(summary: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per variant, what the degradation-vs-K plot draws: the periods it has, the degradation
    and the noise band at each, its colour and line style."""
    periods = summary["settings"]["periods"]
    curves = {}
    for name, info in summary["variants"].items():
        present = [k for k in periods if info["periods"].get(k)]
        curves[name] = {
            "periods": present,
            "degradation": [info["periods"][k]["degradation"] for k in present],
            "std": [info["periods"][k]["noise"] for k in present],
            "color": info["color"],
            "linestyle": info["linestyle"],
        }
    return curves
