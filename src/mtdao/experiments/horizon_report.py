"""Report of the horizon and variants study (``benchmarks/horizon_study.py``): where MT-DAO wins.

Renders report.md and horizon.png from the study's results.json alone (the collected LR sweeps,
final losses and evaluation curves), so the committed report re-renders from its data. Every
experiment is one configuration at one horizon; its LR is the best of a seed-0 sweep, the other
seeds run at that LR. An experiment is *final* when its sweep is bracketed (a worse LR on both
sides of the best), refined (both sqrt(2) neighbours of the best run) and every planned seed has
finished; otherwise its figures are provisional.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mtdao.experiments.formatting import format_lr

BASELINES = {"p1": ("local-adam", "ddp"), "p2": ("local-adopt", "ddp")}
HORIZON_METHODS = ("ddp", "local-adam", "mtdao-default", "mtdao-paper", "beta-wu", "both-wu")
# the horizon curve's runs live in p1, except where a variant's K = 32 screen ran that horizon
HORIZON_HOMES = {("both-wu", 3000): "p3", ("beta-wu", 3000): "p3"}
NAMES = (
    "Names: `mtdao-default` is the former `mtdao` default (beta 0.95, omega 0.7, no warm-up), the "
    "default until 2026-12-01; `beta-wu` (the paper's 0.99 / 0.9 with `--beta-warmup 0.3`) is the "
    "`mtdao` default since; `mtdao-paper` is 0.99 / 0.9 without warm-up, `both-wu` with "
    "`--omega-warmup 0.3 --beta-warmup 0.3`. Blocks: p1 horizons, p3 variants at K = 32, p4 "
    "other sync periods, p5 batch x4, p6 the held-out corpus, p7 a cosine schedule instead of WSD "
    "(the schedule `mtdao train` uses by default)."
)
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


def _loss(value: float | None) -> str:
    return "diverged" if value is None else f"{value:.4f}"


def _pm(experiment: Mapping[str, Any]) -> str:
    s = stats(experiment)
    if s is None:
        return "-"
    seeds = f"({s['n']}/{len(experiment['planned_seeds'])})"
    return f"{s['mean']:.4f} {seeds}" if s["n"] < 2 else f"{s['mean']:.4f} ± {s['std']:.4f} {seeds}"


def _gap_text(g: dict[str, Any] | None) -> str:
    if g is None:
        return "-"
    return f"{g['diff']:+.4f} ({100 * g['relative']:+.1f}%, noise {g['noise']:.4f}): {g['verdict']}"


def _traffic(experiment: Mapping[str, Any]) -> str:
    """Bytes per worker against DDP's at the same steps ("-" for DDP itself or before a run)."""
    reduction = experiment.get("reduction")
    if not reduction or math.isclose(reduction, 1.0):
        return "-"
    return f"{reduction:.1f}x less"


def _paired_text(p: dict[str, Any] | None) -> str:
    if p is None:
        return "-"
    return f"{p['diff']:+.4f}, lower on {p['lower']}/{p['n']} seeds"


def _by_id(summary: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["id"]: e for e in summary["experiments"]}


def _baselines(experiment: Mapping[str, Any]) -> tuple[str, str] | None:
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


def _screen_references(experiment: Mapping[str, Any]) -> tuple[str, str] | None:
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


# -- report.md ---------------------------------------------------------------------------------


def render_horizon_report(summary: Mapping[str, Any]) -> str:
    by_id = _by_id(summary)
    screen = _screen_rows(summary, by_id)  # the table and whether its plot exists
    lines = [
        "# Where MT-DAO wins: horizons and variants",
        "",
        f"Status at {summary['collected']}: {summary['finished_runs']} runs finished, "
        f"{len(summary['running'])} running ({', '.join(summary['running']) or 'none'}). "
        "Figures marked provisional will change as the remaining runs finish.",
        "",
        NAMES,
        "",
        "## Protocol",
        "",
        *[f"- {line}" for line in summary["protocol"]],
        "",
        "## Final loss against horizon",
        "",
        "![final loss and gaps against horizon](horizon.png)",
        "",
        *_horizon_table(summary, by_id),
        "",
        "## Gaps",
        "",
        "Negative: lower loss than the baseline. Crossing: the first evaluation where MT-DAO's mean "
        "curve is below Local Adam's, and from which step on it stays below.",
        "",
        *_gap_table(summary, by_id),
        "",
        "## Seed-0 screen: variants, sync periods, batch size",
        "",
        "Each configuration at the best LR of its own seed-0 sweep, against MT-DAO default and "
        "Local Adam of the same setting on the same seed (same data order and initial weights). "
        "Seed-to-seed spread at 3000 steps is 0.002-0.008 (see above): a screen difference "
        "smaller than about 0.01 says nothing; a configuration that clears it gets seeds 1 and 2.",
        "",
        *(["![seed-0 screen](screen.png)", ""] if screen else []),
        "Loss against traffic at 3000 steps, every configuration measured:",
        "",
        "![loss against traffic](traffic.png)",
        "",
        *_screen_table(screen),
        "",
        "## Batch x4 at equal tokens",
        "",
        *_batch_table(by_id),
        "",
        "## Every experiment",
        "",
        *_experiment_table(summary, by_id),
        "",
        "## LR sweeps (seed 0)",
        "",
        *_sweep_lines(summary),
    ]
    return "\n".join(lines) + "\n"


def _horizon_table(summary, by_id) -> list[str]:
    horizons = sorted({e["steps"] for e in summary["experiments"] if e["id"].startswith("p1/")})
    lines = ["| method | " + " | ".join(f"{h} steps" for h in horizons) + " |"]
    lines.append("|---" * (len(horizons) + 1) + "|")
    for label in HORIZON_METHODS:
        cells = []
        for horizon in horizons:
            e = by_id.get(_horizon_id(label, horizon))
            if e is None or stats(e) is None:
                cells.append("not run yet" if e is None or not e.get("sweep") else "diverged")
                continue
            final = "" if state(e) == "final" else " *"
            cells.append(f"{_pm(e)} @ {format_lr(e['best_lr'])}{final}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "mean ± sample std (seeds done / planned) @ best LR; * provisional."]
    return lines


def _gap_table(summary, by_id) -> list[str]:
    lines = [
        "| experiment | vs Local | vs Local, paired by seed | vs DDP | crossing of Local | state |",
        "|---|---|---|---|---|---|",
    ]
    for e in summary["experiments"]:
        pair = _baselines(e)
        if pair is None or stats(e) is None:
            continue
        local, ddp = (by_id.get(i, {"values": []}) for i in pair)
        lines.append(
            f"| {e['id']} | {_gap_text(gap(e, local))} | {_paired_text(paired(e, local))} | "
            f"{_gap_text(gap(e, ddp))} | {crossing(e, local)} | {state(e)} |"
        )
    return lines


def _screen_rows(summary, by_id) -> list[tuple[dict[str, Any], float, float | None, float | None]]:
    """(experiment, seed-0 loss, - MT-DAO default, - Local Adam) of every screened experiment."""
    rows = []
    for e in summary["experiments"]:
        refs, loss = _screen_references(e), seed0_best(e)
        if refs is None or loss is None:
            continue
        diffs = []
        for ref_id in refs:
            ref = seed0_best(by_id.get(ref_id, {}))
            diffs.append(None if ref is None or ref_id == e["id"] else loss - ref)
        rows.append((e, loss, diffs[0], diffs[1]))
    return rows


def _screen_table(screen) -> list[str]:
    lines = [
        "| experiment | seed 0 @ best LR | - MT-DAO default | - Local Adam | traffic vs DDP | sweep |",
        "|---|---|---|---|---|---|",
    ]
    for e, loss, vs_default, vs_local in screen:
        cells = [f"{d:+.4f}" if d is not None else "-" for d in (vs_default, vs_local)]
        sweep = "bracketed" if e.get("bracketed") else "not bracketed yet"
        lines.append(
            f"| {e['id']} | {loss:.4f} @ {format_lr(e['best_lr'])} | {cells[0]} | {cells[1]} | "
            f"{_traffic(e)} | {sweep} |"
        )
    return lines if len(lines) > 2 else ["No screened configuration has finished a run yet."]


def _batch_table(by_id) -> list[str]:
    lines = [
        "Per-worker batch 16 x 3000 steps against batch 64 x 750 steps: the same 12.3M tokens, a "
        "quarter of the steps and of the rounds (K = 32 both).",
        "",
        "| method | batch 16, 3000 steps | batch 64, 750 steps |",
        "|---|---|---|",
    ]
    for label in ("ddp", "local-adam", "mtdao-default"):
        cells = []
        for eid in (f"p1/{label}/3000", f"p5/b64-{label}/750"):
            e = by_id.get(eid)
            if e is None or stats(e) is None:
                cells.append("-")
                continue
            final = "" if state(e) == "final" else " *"
            cells.append(f"{_pm(e)} @ {format_lr(e['best_lr'])}{final}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _experiment_table(summary, by_id) -> list[str]:
    lines = [
        "| experiment | flags | final loss | best LR | traffic | cosine | state |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in summary["experiments"]:
        best = format_lr(e["best_lr"]) if e.get("best_lr") else "-"
        cosine = f"{e['cosine']:.3f}" if e.get("cosine") is not None else "-"
        flags = " ".join(e["flags"])
        lines.append(
            f"| {e['id']} | `{flags}` | {_pm(e)} | {best} | {_traffic(e)} | {cosine} | {state(e)} |"
        )
    return lines


def _sweep_lines(summary) -> list[str]:
    lines = []
    for e in summary["experiments"]:
        if e.get("sweep"):
            points = ", ".join(f"{format_lr(p['lr'])}: {_loss(p['loss'])}" for p in e["sweep"])
            lines.append(f"- {e['id']}: {points}")
    return lines or ["- none finished yet"]


# -- horizon.png ----------------------------------------------------------------------------------


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
            for e in _horizon_experiments(summary, label)
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
    by_id = _by_id(summary)
    # each MT-DAO setting in its colour of the left panel: solid against Local Adam, dashed DDP
    for label, base in ((m, b) for m in HORIZON_METHODS[2:] for b in ("local-adam", "ddp")):
        points = []
        for e in _horizon_experiments(summary, label):
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

    by_id = _by_id(summary)
    panels: dict[str, list[dict[str, Any]]] = {}
    for e, loss, _, _ in _screen_rows(summary, by_id):
        block, label, steps = e["id"].split("/")
        panels.setdefault(_setting_name(block, label, steps), []).append(dict(e, loss=loss))
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 4.2), squeeze=False)
    for axis, (setting, rows) in zip(axes[0], panels.items()):
        losses = [r["loss"] for r in rows]
        for y, row in enumerate(rows):
            baseline = _baselines(row) is None
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
            _screen_references(rows[0]), (":", "--"), ("MT-DAO default", "Local Adam")
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


def _horizon_id(label: str, steps: int) -> str:
    return f"{HORIZON_HOMES.get((label, steps), 'p1')}/{label}/{steps}"


def _horizon_experiments(summary: Mapping[str, Any], label: str) -> list[dict[str, Any]]:
    return [e for e in summary["experiments"] if e["id"] == _horizon_id(label, e["steps"])]


def nan_free(value: float) -> float | None:
    """JSON has no inf: a diverged run is stored as None."""
    return value if math.isfinite(value) else None
