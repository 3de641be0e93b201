"""report.md of the horizon and variants study (:mod:`.run`): where MT-DAO
wins.

Rendered from the study's results.json alone, so the committed report re-renders from its data;
the numbers come from :mod:`.summary`, the figures it shows from :mod:`.plots`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from mtdao.experiments.common.formatting import format_lr
from mtdao.experiments.horizon.summary import (
    HORIZON_METHODS,
    baselines,
    crossing,
    experiments_by_id,
    gap,
    horizon_id,
    paired,
    screen_rows,
    state,
    stats,
)

NAMES = (
    "Names: `mtdao-default` is the former `mtdao` default (beta 0.95, omega 0.7, no warm-up), the "
    "default until 2026-12-01; `beta-wu` (the paper's 0.99 / 0.9 with `--beta-warmup 0.3`) is the "
    "`mtdao` default since; `mtdao-paper` is 0.99 / 0.9 without warm-up, `both-wu` with "
    "`--omega-warmup 0.3 --beta-warmup 0.3`. Blocks: p1 horizons, p3 variants at K = 32, p4 "
    "other sync periods, p5 batch x4, p6 the held-out corpus, p7 a cosine schedule instead of WSD "
    "(`mtdao train`'s default schedule until 2026-12-04)."
)


def render_horizon_report(summary: Mapping[str, Any]) -> str:
    by_id = experiments_by_id(summary)
    screen = screen_rows(summary, by_id)  # the table and whether its plot exists
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
            e = by_id.get(horizon_id(label, horizon))
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
        pair = baselines(e)
        if pair is None or stats(e) is None:
            continue
        local, ddp = (by_id.get(i, {"values": []}) for i in pair)
        lines.append(
            f"| {e['id']} | {_gap_text(gap(e, local))} | {_paired_text(paired(e, local))} | "
            f"{_gap_text(gap(e, ddp))} | {crossing(e, local)} | {state(e)} |"
        )
    return lines


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
