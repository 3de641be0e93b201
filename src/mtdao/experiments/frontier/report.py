"""``mtdao frontier``'s outputs: frontier.png, report.md, frontier.json (every point, for tools)
and results.json (what report.md re-renders from), from the rows of :mod:`.summary`
(numbers through :mod:`mtdao.experiments.common.formatting` only)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mtdao.experiments.common import figures
from mtdao.experiments.common.formatting import (
    MISSING,
    SIGNIFICANCE_RULE,
    failures_section,
    format_bytes,
    format_lr,
    join_numbers,
    label,
    pm,
    stats,
    table,
)
from mtdao.experiments.common.results import json_text, stamped, write_report
from mtdao.experiments.frontier.summary import (
    BUDGET_FACTORS,
    KIND,
    SCHEMA,
    budget_rows,
    finite,
    frontier_json,
    fronts_by_method,
    goal_points,
)


def write_frontier_report(
    report: Path, settings: Mapping[str, Any], outcome: Mapping[str, Any], failures
) -> None:
    rows = outcome["rows"]
    content = {"settings": dict(settings), **outcome, "failures": failures}
    write_report(report, stamped(KIND, SCHEMA, content), render)
    (report / "frontier.json").write_text(json_text(frontier_json(rows)))
    if any(finite(r) for r in rows):
        plot_frontier(report / "frontier.png", rows)


def ddp_row(rows: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    return next((r for r in rows if r["method"] == "ddp" and finite(r)), None)


def render(results: Mapping[str, Any]) -> str:
    """report.md from a results.json."""
    rows, s = results["rows"], results["settings"]
    lines = [
        f"# Loss against traffic: {s['model']} model, M = {s['workers']}, {s['steps']} steps",
        "",
        f"Command: `{s['command']}`",
        "",
        f"- {s['workers']} workers x {s['batch_size']} sequences x {s['seq_len']} tokens per step, "
        f"{s['steps']} steps: equal tokens for every point; grid `{s['grid']}`; worker shards "
        f"`{s['data_split']}`; LR schedule `{s['schedule']}`, warm-up {s['warmup']:g} of the steps",
        f"- seeds {', '.join(map(str, s['seeds']))} for every point, plus "
        f"{', '.join(map(str, s['frontier_seeds'])) or 'none'} for the points on a method's "
        "Pareto frontier",
        "- bytes per worker: what the harness's traffic account counts (codes, top-k positions, "
        "scales, padding), 2(M-1)/M of it on a ring",
        f"- {SIGNIFICANCE_RULE}; a single seed gives no noise estimate",
        *lr_line(s),
        *reused_line(s),
        "",
        "![final loss against bytes per worker](frontier.png)",
        "",
    ]
    ddp = ddp_row(rows)
    if ddp is not None:
        lines += budget_section(rows, ddp) + goals_section(rows, ddp)
    lines += ["## Every point", ""]
    lines += table(
        ["point", "LR", "final val loss", "seeds", "bytes / worker", "vs DDP (steady)", "front"],
        point_lines(rows),
    )
    lines += [
        "",
        "\\* shorter than one full sync cycle (a state period beyond the run): the reduction "
        "measured over the run.",
        "",
        "## Learning-rate sweeps (first seed)",
        "",
    ]
    for method, sweep in results["sweeps"].items():
        losses = ", ".join(
            f"{lr}: {loss:.4f}" if math.isfinite(loss) else f"{lr}: {MISSING} (not run or diverged)"
            for lr, loss in sweep["losses"].items()
        )
        line = f"- {label(method)} on `{sweep['point']}`: {losses}; best {format_lr(sweep['best'])}"
        outside = sweep.get("outside") or {}
        if outside:
            found = ", ".join(f"{lr}: {loss:.4f}" for lr, loss in outside.items())
            best = sweep["losses"].get(format_lr(sweep["best"]), math.inf)
            better = [lr for lr, loss in outside.items() if loss < best]
            line += f"; finished outside this sweep (not chosen from): {found}"
            if better:
                line += f". **{', '.join(better)} did better: {label(method)} is not at its best LR here**"
        lines.append(line)
    lines += other_lrs_section(rows, results.get("other_lr_rows", []))
    lines += ["", "Each point's exact `mtdao train` flags are in frontier.json (`argv`).", ""]
    lines += failures_section(results["failures"])
    return "\n".join(lines) + "\n"


def other_lrs_section(rows, other_rows) -> list[str]:
    """Points that also ran at an LR their method's sweep did not choose, beside the same seeds'
    runs at the chosen LR."""
    if not other_rows:
        return []
    chosen = {r["name"]: r for r in rows}
    body = []
    for other in sorted(other_rows, key=lambda r: (r["method"], r["bytes_per_worker"] or 0)):
        row = chosen.get(other["name"], {})
        here_by_seed = dict(zip(row.get("seeds", []), row.get("val_loss", {}).get("values", [])))
        there_by_seed = dict(zip(other["seeds"], other["val_loss"]["values"]))
        common = [seed for seed in other["seeds"] if seed in here_by_seed]
        here_text = change = MISSING
        if common:  # the change over the seeds both LRs ran
            here = stats(here_by_seed[seed] for seed in common)
            there = stats(there_by_seed[seed] for seed in common)
            seeds = "" if len(common) == len(other["seeds"]) else f" (seeds {join_numbers(common)})"
            here_text = f"{format_lr(row['lr'])}: {pm(here)}{seeds}"
            if math.isfinite(here["mean"]) and math.isfinite(there["mean"]):
                change = f"{there['mean'] / here['mean'] - 1:+.1%}"
        body.append(
            [
                f"`{other['name']}`",
                format_lr(other["lr"]),
                pm(other["val_loss"]),
                join_numbers(other["seeds"]),
                here_text,
                change,
            ]
        )
    return [
        "",
        "## Points at other learning rates",
        "",
        "Finished runs at an LR other than the one their method's sweep chose (kept, not "
        "plotted), against the chosen LR's runs of the same seeds (the change is over the seeds "
        "both ran):",
        "",
        *table(["point", "LR", "final val loss", "seeds", "same seeds, chosen LR", "change"], body),
    ]


def lr_line(settings) -> list[str]:
    if not settings.get("lr_per_point"):
        return [
            "- learning rates: each method's best on its reference point (the sweeps below), "
            "for all its points"
        ]
    return [
        "- learning rates: each point at the best of its method's sweep LRs on the first seed "
        "(`--lr-per-point`); the lowest of a few noisy runs reads a little low, alike for "
        "points swept at as many LRs"
    ]


def reused_line(settings) -> list[str]:
    count = settings.get("reused_runs")
    if not count:
        return []
    return [
        f"- {count} run(s) taken from an earlier report (`--reuse`: --out had no run directory "
        "for them): their final losses and traffic as that report recorded them"
    ]


def budget_section(rows, ddp) -> list[str]:
    lines = ["## The best method at each budget", ""]
    body = []
    for entry in budget_rows(rows, ddp["bytes_per_worker"], BUDGET_FACTORS):
        named = {r["name"]: r for r in rows}
        winner = named.get(entry["winner"])
        if winner is None:
            body.append(
                [f"{entry['factor']}x", format_bytes(entry["budget_bytes"]), "no point"]
                + [MISSING] * 3
            )
            continue
        runner = named.get(entry.get("runner_up"))
        verdict = {True: "yes", False: "no (tie)", None: "no noise estimate"}[
            entry.get("beyond_noise")
        ]
        body.append(
            [
                f"{entry['factor']}x",
                format_bytes(entry["budget_bytes"]),
                f"{label(winner['method'])} `{winner['name']}` {pm(winner['val_loss'])}",
                f"{label(runner['method'])} `{runner['name']}` {pm(runner['val_loss'])}"
                if runner
                else MISSING,
                f"{entry['margin']:.4f}" if runner else MISSING,
                verdict if runner else MISSING,
            ]
        )
    lines += table(
        ["less than DDP", "budget", "best", "runner-up method", "margin", "beyond noise"], body
    )
    return lines + [
        "",
        f"DDP: {pm(ddp['val_loss'])}, {format_bytes(ddp['bytes_per_worker'])} per worker.",
        "",
    ]


def goals_section(rows, ddp) -> list[str]:
    lines = ["## MT-DAO against the goals", ""]
    for goal in goal_points(rows, ddp["val_loss"]["mean"]):
        within = f"within {goal['within']:.0%} of DDP's loss at >= {goal['wanted_reduction']}x"
        if goal["point"] is None:
            lines.append(f"- {within}: no MT-DAO point is that close")
        else:
            state = "met" if goal["met"] else "not met"
            lines.append(
                f"- {within}: {state}: cheapest such point `{goal['point']}`, "
                f"{goal['reduction']:.0f}x less than DDP"
            )
    return lines + [""]


def point_lines(rows) -> list[list[str]]:
    on_front = {r["name"] for front in fronts_by_method(rows).values() for r in front}
    ordered = sorted(rows, key=lambda r: (r["method"], r["bytes_per_worker"] or 0))
    return [
        [
            f"`{r['name']}`",
            format_lr(r["lr"]),
            pm(r["val_loss"]),
            join_numbers(r["seeds"]) or MISSING,
            format_bytes(r["bytes_per_worker"]) if r["bytes_per_worker"] else MISSING,
            reduction_text(r),
            "yes" if r["name"] in on_front else "",
        ]
        for r in ordered
    ]


def reduction_text(row) -> str:
    """The steady-state reduction; * where the run was shorter than one full sync cycle."""
    reduction = row["comm_reduction_steady_state"]
    if not reduction:
        return MISSING
    return f"{reduction:.1f}x" + ("*" if row.get("no_steady_state") else "")


def plot_frontier(path: Path, rows) -> None:
    with figures.saved_figure(path, figsize=(8, 5), constrained_layout=True) as (_, ax):
        ddp = ddp_row(rows)
        for method, front in fronts_by_method(rows).items():
            points = [r for r in rows if r["method"] == method and finite(r)]
            colour = figures.color(method)
            ax.scatter(
                [r["bytes_per_worker"] for r in points],
                [r["val_loss"]["mean"] for r in points],
                color=colour,
                alpha=0.35,
                s=18,
            )
            ax.plot(
                [r["bytes_per_worker"] for r in front],
                [r["val_loss"]["mean"] for r in front],
                color=colour,
                marker="o",
                drawstyle="steps-post",
                label=label(method),
            )
        if ddp is not None:
            for factor in BUDGET_FACTORS:
                ax.axvline(ddp["bytes_per_worker"] / factor, color="#999999", lw=0.6, ls=":")
            ax.axhline(ddp["val_loss"]["mean"], color=figures.color("ddp"), lw=0.6, ls="--")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(figures.eng_formatter("B"))
        ax.set_xlabel("bytes sent per worker (log; dotted: 10x .. 1000x less than DDP)")
        ax.set_ylabel("final validation loss")
        ax.set_title("Loss against traffic, each method's Pareto frontier")
        ax.legend()
