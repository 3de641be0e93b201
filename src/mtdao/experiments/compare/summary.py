"""The numbers behind ``mtdao compare``'s report: pure functions of the runs' results dicts.

Input: per method, the results dicts of its runs (one per seed, all at the method's chosen LR).
Everything here is arithmetic on those dicts, so it is tested without training anything.

* target loss: DDP's mean final validation loss; steps to target: the first evaluation at or
  below it (resolution: the evaluation interval);
* mean ± std over seeds (sample std, ddof = 1; 0 with one seed), judged by the significance rule
  of :mod:`mtdao.experiments.common.formatting`;
* traffic: bytes each worker contributed to collectives; DDP's is one gradient per step;
* modelled wall-clock: :mod:`mtdao.experiments.compare.wallclock` on the logged collectives with ONE
  compute time per step for every method (the median measured over all runs), since every method
  does the same forward/backward/update per step and only communication differs;
* the paper's claim, checked per baseline (:func:`claim_checks`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mtdao.experiments.common.formatting import SIGNIFICANCE_RULE, compare_losses, stats
from mtdao.experiments.compare.wallclock import LINK_PRESETS, Link, run_seconds, time_to_step

KIND, SCHEMA = "compare", 1  # results.json (see mtdao.experiments.common.results)

# The paper's claim: MT-DAO matches or beats DDP, and beats these local baselines.
CLAIM_BASELINES = ("local-adam", "diloco")


def steps_to_target(evals: Sequence[Mapping[str, Any]], target: float) -> int | None:
    """Step of the first evaluation with validation loss at or below ``target``; None if never."""
    for record in evals:
        if record.get("val_loss") is not None and record["val_loss"] <= target:
            return int(record["step"])
    return None


def traffic_ratio(ddp_bytes: float, method_bytes: float) -> float:
    """How many times less than DDP a method sent (inf when it sent nothing)."""
    return ddp_bytes / method_bytes if method_bytes else math.inf


def shared_compute_seconds(runs: Iterable[Mapping[str, Any]]) -> float:
    """Median measured compute seconds per worker-step over ``runs``."""
    measured = [r["compute_s_per_worker_step"] for r in runs if r.get("compute_s_per_worker_step")]
    if not measured:
        raise ValueError("no run reports compute_s_per_worker_step")
    return statistics.median(measured)


def lr_key(lr: float) -> str:
    """A learning rate as a JSON key of the sweep table."""
    return f"{lr:.6g}"


# -- one method ----------------------------------------------------------------------------------


def modelled_wallclock(
    runs: Sequence[Mapping[str, Any]],
    reached: Sequence[int | None],
    compute_s: float,
    links: Mapping[str, Link],
) -> dict[str, dict[str, Any]]:
    """Per link: modelled seconds of the whole run and to the target step, over seeds."""
    wallclock = {}
    for name, link in links.items():
        totals, to_target = [], []
        for run, step in zip(runs, reached):
            events = [tuple(e) for e in run["comm_events"]]
            totals.append(run_seconds(compute_s, events, run["workers"], link, steps=run["steps"]))
            if step is not None:
                to_target.append(time_to_step(compute_s, events, run["workers"], link, step=step))
        wallclock[name] = {"run_s": stats(totals), "to_target_s": stats(to_target)}
    return wallclock


def alignment_summary(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Mean worker/global pseudo-gradient cosine and drift over all syncs and the last quarter."""
    records = [(r["steps"], a) for r in runs for a in r.get("alignment") or []]
    if not records:
        return None

    def mean_of(key: str, late: bool) -> float:
        values = [v for steps, a in records if not late or a["step"] > 0.75 * steps for v in a[key]]
        return statistics.fmean(values) if values else math.nan

    return {
        "syncs_per_run": len(records) / len(runs),
        "cosine_mean": mean_of("cosine", False),
        "cosine_last_quarter": mean_of("cosine", True),
        "drift_mean": mean_of("drift", False),
    }


def summarize_method(
    runs: Sequence[Mapping[str, Any]],
    target: float | None,
    compute_s: float,
    links: Mapping[str, Link] = LINK_PRESETS,
) -> dict[str, Any]:
    """Everything the report says about one method's runs (one per seed)."""
    reached = [steps_to_target(r["evals"], target) if target is not None else None for r in runs]
    bytes_sent = stats(r["bytes_per_worker"] for r in runs)["mean"]
    ddp_bytes = stats(r["ddp_bytes_per_worker"] for r in runs)["mean"]
    return {
        "lr": runs[0]["settings"]["lr"],
        "settings": runs[0]["settings"],
        "sync_policy": runs[0].get("sync_policy"),
        "seeds": [r["config"]["seed"] for r in runs],
        "steps": runs[0]["steps"],
        "final_val_loss": stats(r["final_val_loss"] for r in runs),
        "val_ppl": stats(r["val_ppl"] for r in runs),
        "steps_to_target": {
            "per_seed": reached,
            "reached": sum(s is not None for s in reached),
            "n": len(runs),
            "stats": stats(s for s in reached if s is not None),
        },
        "bytes_per_worker": bytes_sent,
        "ddp_bytes_per_worker": ddp_bytes,
        "traffic_vs_ddp": traffic_ratio(ddp_bytes, bytes_sent),
        "wallclock": modelled_wallclock(runs, reached, compute_s, links),
        "alignment": alignment_summary(runs),
    }


# -- every method --------------------------------------------------------------------------------


def summarize_compare(
    runs_by_method: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    settings: Mapping[str, Any],
    sweep: Mapping[str, Any] | None = None,
    failures: Mapping[str, str] | None = None,
    links: Mapping[str, Link] = LINK_PRESETS,
    compute_runs: Iterable[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The aggregate written to results.json and rendered into report.md and the plots."""
    present = {m: list(r) for m, r in runs_by_method.items() if r}
    if not present:
        raise ValueError("no finished runs to report on")
    all_runs = [r for runs in present.values() for r in runs]
    measured = list(compute_runs) if compute_runs is not None else all_runs
    compute_s = shared_compute_seconds(measured)
    ddp_loss = stats(r["final_val_loss"] for r in present["ddp"]) if "ddp" in present else None
    target = ddp_loss["mean"] if ddp_loss else None
    return {
        "settings": dict(settings),
        "significance_rule": SIGNIFICANCE_RULE,
        "target_val_loss": target,
        "compute_s_per_step": compute_s,
        "compute_s_runs": len(measured),
        "links": {
            name: {"bandwidth_gbit": link.bandwidth_gbit, "latency_s": link.latency_s}
            for name, link in links.items()
        },
        "methods": {
            m: summarize_method(runs, target, compute_s, links) for m, runs in present.items()
        },
        "missing_methods": [m for m, r in runs_by_method.items() if not r],
        "sweep": dict(sweep) if sweep else None,
        "failures": dict(failures or {}),
        "runs": present,
    }


# -- the paper's claim ---------------------------------------------------------------------------


def versus(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Two methods' final-loss :func:`stats` side by side under the significance rule."""
    difference = abs(a["mean"] - b["mean"])
    return {
        "outcome": compare_losses(a, b),
        "difference": difference,
        "relative_percent": difference / b["mean"] * 100 if b["mean"] else math.nan,
        "noise": a["std"] + b["std"],
        "noise_known": a["n"] > 1 and b["n"] > 1,
        "finite": math.isfinite(a["mean"]) and math.isfinite(b["mean"]),
    }


def claim_checks(methods: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """MT-DAO against DDP (it must match or beat it: better or a tie) and each claim baseline (it
    must beat it); a baseline that was not run is listed with ``holds`` None."""
    checks = []
    for other in ("ddp", *CLAIM_BASELINES):
        check: dict[str, Any] = {"other": other, "versus": None, "holds": None}
        if other in methods:
            check["versus"] = versus(
                methods["mtdao"]["final_val_loss"], methods[other]["final_val_loss"]
            )
            outcome = check["versus"]["outcome"]
            check["holds"] = outcome in ("better", "tie") if other == "ddp" else outcome == "better"
        checks.append(check)
    return checks


def ranking(methods: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Methods by mean final validation loss, best first."""
    return sorted(methods, key=lambda m: methods[m]["final_val_loss"]["mean"])
