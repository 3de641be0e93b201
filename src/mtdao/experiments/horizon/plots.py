"""The figures of the horizon and variants study: horizon.png (final loss and gaps against
horizon), screen.png (the seed-0 screen) and traffic.png (loss against traffic), from the numbers
of :mod:`.summary`. Hollow markers are provisional figures.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mtdao.experiments.horizon.summary import (
    HORIZON_METHODS,
    HORIZONS,
    baselines,
    experiments_by_id,
    gap,
    horizon_experiments,
    screen_references,
    screen_rows,
    seed0_best,
    state,
    stats,
)


def plot_horizon(summary: Mapping[str, Any], path: Path) -> None:
    """Final loss per method against horizon (left) and MT-DAO's gaps (right); hollow markers are
    provisional figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for index, label in enumerate(HORIZON_METHODS):
        points = sorted(
            (e["steps"], stats(e), state(e) == "final")
            for e in horizon_experiments(summary, label)
            if stats(e)
        )
        color = f"C{index}"
        if points:
            left.plot(
                [p[0] for p in points], [p[1]["mean"] for p in points], color=color, label=label
            )
        for steps, s, final in points:
            face = color if final else "white"
            left.errorbar(steps, s["mean"], s["std"], color=color, marker="o", mfc=face, capsize=3)
    by_id = experiments_by_id(summary)
    # each MT-DAO setting in its colour of the left panel: solid against Local Adam, dashed DDP
    for label, base in ((m, b) for m in HORIZON_METHODS[2:] for b in ("local-adam", "ddp")):
        points = []
        for e in horizon_experiments(summary, label):
            g = gap(e, by_id.get(f"p1/{base}/{e['steps']}", {"values": []}))
            if g:
                final = state(e) == "final" and state(by_id[f"p1/{base}/{e['steps']}"]) == "final"
                points.append((e["steps"], g["diff"], final))
        if points:
            points.sort()
            style = "-" if base == "local-adam" else "--"
            color = f"C{HORIZON_METHODS.index(label)}"
            right.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                style,
                color=color,
                label=f"{label} - {base}",
            )
            for steps, diff, final in points:
                right.plot(steps, diff, "o", color=color, mfc=color if final else "white")
    right.axhline(0.0, color="grey", lw=0.8)
    titles = ("final val loss (mean ± std; hollow: provisional)", "gap (negative: MT-DAO lower)")
    for axis, title in zip((left, right), titles):
        axis.set_xscale("log")
        axis.set_xticks(HORIZONS, [f"{h:,}" for h in HORIZONS])
        axis.set_xlim(HORIZONS[0] / 1.4, HORIZONS[-1] * 1.4)
        axis.set_xlabel("steps (WSD schedule, each method at its own best LR)")
        axis.set_title(title, fontsize=10)
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_screen(summary: Mapping[str, Any], path: Path) -> None:
    """Seed-0 loss of each screened configuration as a bar, one panel per setting (baselines grey,
    hatched: sweep not bracketed yet), with the setting's Local Adam and MT-DAO default as lines
    where they are not bars of the panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_id = experiments_by_id(summary)
    panels: dict[str, list[dict[str, Any]]] = {}
    for e, loss, _, _ in screen_rows(summary, by_id):
        block, label, steps = e["id"].split("/")
        panels.setdefault(_setting_name(block, label, steps), []).append(dict(e, loss=loss))
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 4.2), squeeze=False)
    for axis, (setting, rows) in zip(axes[0], panels.items()):
        losses = [r["loss"] for r in rows]
        for y, row in enumerate(rows):
            baseline = baselines(row) is None
            color = "0.55" if baseline else "C4"
            bracketed = bool(row.get("bracketed"))
            axis.barh(
                y,
                row["loss"],
                color=color if bracketed else "white",
                edgecolor=color,
                hatch=None if bracketed else "//",
            )
            axis.text(row["loss"], y, f" {row['loss']:.4f}", va="center", fontsize=7)
        shown = {r["id"] for r in rows}
        for ref_id, style, name in zip(
            screen_references(rows[0]), (":", "--"), ("MT-DAO default", "Local Adam")
        ):
            ref = seed0_best(by_id.get(ref_id, {}))
            if ref is not None and ref_id not in shown:
                axis.axvline(ref, color="0.3", ls=style, lw=1, label=f"{name} {ref:.4f}")
                losses.append(ref)
        axis.set_yticks(range(len(rows)), [r["id"].split("/")[1] for r in rows], fontsize=8)
        axis.invert_yaxis()
        axis.set_xlim(min(losses) - 0.02, max(losses) + 0.02)
        axis.set_title(setting, fontsize=10)
        axis.set_xlabel("final val loss, seed 0, own best LR (lower is better)")
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_traffic(summary: Mapping[str, Any], path: Path, steps: int = 3000) -> None:
    """Final loss against traffic (DDP's bytes per worker / the configuration's) of every
    configuration at ``steps`` steps on the built-in data: which ones buy their loss cheaply.
    Hollow markers: provisional (seed 0 only, or a sweep still open)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = []
    for e in summary["experiments"]:
        block, label, horizon = e["id"].split("/")
        s = stats(e)
        if int(horizon) != steps or block not in ("p1", "p3", "p4") or s is None:
            continue
        points.append((e.get("reduction") or 1.0, s, label, state(e) == "final"))
    if not points:
        return
    fig, axis = plt.subplots(figsize=(7.5, 4.6))
    for reduction, s, label, final in points:
        color = "0.45" if label in ("ddp", "local-adam", "k128-local-adam") else "C4"
        axis.errorbar(
            reduction,
            s["mean"],
            s["std"],
            marker="o",
            color=color,
            mfc=color if final else "white",
            capsize=3,
        )
        axis.annotate(
            label, (reduction, s["mean"]), fontsize=7, xytext=(4, 3), textcoords="offset points"
        )
    axis.set_xscale("log")
    axis.set_xlabel("less traffic than DDP (x, log scale)")
    axis.set_ylabel(f"final val loss at {steps:,} steps (mean ± std)")
    axis.set_title("loss against traffic (grey: baselines; hollow: provisional)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _setting_name(block: str, label: str, steps: str) -> str:
    if block == "p3":
        return f"K = 32 variants, {steps} steps"
    if block == "p4":
        return f"K = {label.split('-')[0][1:]}, {steps} steps"
    return f"per-worker batch 64, {steps} steps"
