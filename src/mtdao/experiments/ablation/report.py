"""``mtdao ablation``'s report.md and degradation_vs_k.png, rendered from its summary alone
(the content of results.json), so a committed report re-renders from its results.json."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mtdao.experiments.ablation.summary import (
    best_versus_local,
    degradation_curves,
    slope_comparison,
    slope_pairs,
)
from mtdao.experiments.common.figures import STYLE, color, pyplot, save
from mtdao.experiments.common.formatting import (
    MISSING,
    SIGNIFICANCE_RULE,
    failures_section,
    format_bytes,
    format_lr,
    format_traffic,
    join_numbers,
    pm,
    signed,
    table,
)

PLOT = "degradation_vs_k.png"


# -- the verdict ----------------------------------------------------------------------------------


def slope_sentence(variants: Mapping[str, Any], policy: str, slow_name: str, fast_name: str) -> str:
    """Whether the slower momentum's degradation grows more slowly with K, as the paper reports."""
    slow, fast = variants[slow_name], variants[fast_name]
    slow_beta, fast_beta = slow["betas"][0], fast["betas"][0]
    c = slope_comparison(slow, fast)
    more_or_less = "less" if c["difference"] < 0 else "more"
    numbers = (
        f"({signed(slow['slope_per_doubling'])} vs {signed(fast['slope_per_doubling'])} per "
        f"doubling, so {abs(c['difference']):.2g} {more_or_less} over "
        f"K = {c['ks'][0]}..{c['ks'][-1]}"
        + ("; one seed, no noise estimate" if c["noise"] == 0 else "")
    )
    verdicts = {
        "alike": f"and beta {fast_beta:g} degrade alike {numbers}, within the noise "
        f"{c['noise']:.4f}).",
        "slower": f"degrades more slowly than beta {fast_beta:g} {numbers}): as the paper reports.",
        "faster": f"degrades faster than beta {fast_beta:g} {numbers}): unlike the paper's "
        "ablation.",
    }
    return f"With {policy} periods, beta {slow_beta:g} " + verdicts[c["outcome"]]


def ablation_verdict(summary: Mapping[str, Any]) -> str:
    variants = summary["variants"]
    parts = []
    slopes = {n: v["slope_per_doubling"] for n, v in variants.items()}
    if any(s is not None for s in slopes.values()):
        parts.append(
            "Growth of the degradation per doubling of K (least-squares slope over log2 K): "
            + ", ".join(f"{n} {signed(s)}" for n, s in slopes.items() if s is not None)
            + "."
        )
    parts += [slope_sentence(variants, *pair) for pair in slope_pairs(variants)]
    words = {"better": "beats", "worse": "loses to", "tie": "ties with"}
    wins = [
        f"K = {k}: the best MT-DAO variant ({best}) {words[outcome]} Local Adam"
        for k, best, outcome in best_versus_local(variants, summary["settings"]["periods"])
    ]
    if wins:
        parts.append("; ".join(wins) + ".")
    one_seed = len(summary["settings"]["seeds"]) == 1
    parts.append(
        f"Significance rule: {SIGNIFICANCE_RULE}."
        + (
            " With one seed there is no noise estimate: every difference counts, so treat these "
            "as provisional."
            if one_seed
            else ""
        )
    )
    return " ".join(parts)


# -- report.md ------------------------------------------------------------------------------------


def _state_period_line(state_period: int | None) -> str:
    if state_period:
        return (
            f"- every optimizer state (Local Adam's too) averaged every {state_period} steps while "
            "the parameter period K grows, as in the paper's ablation"
        )
    return (
        "- every state follows the variant's period rule (the paper instead fixed the momentum "
        "and second-moment periods at 16 while K grew: `--state-period 16`)"
    )


def _settings_section(summary: Mapping[str, Any]) -> list[str]:
    s = summary["settings"]
    return [
        "## Settings",
        "",
        f"- {s['workers']} workers x {s['batch_size']} sequences x {s['seq_len']} tokens per step, "
        f"{s['steps']} steps ({s['tokens']:,} tokens) per run; base optimizer {s['optimizer']}",
        f"- learning rates: {', '.join(f'{m} {format_lr(v)}' for m, v in s['lrs'].items())}; "
        f"seeds {join_numbers(s['seeds'])}; MT-DAO slow-momentum weight omega {s['omega']:g}",
        f"- DDP reference final val loss: {pm(summary['ddp']['final_val_loss'])}",
        _state_period_line(s.get("state_period")),
    ]


def _loss_cell(cell: Mapping[str, Any] | None) -> str:
    if cell is None:
        return MISSING
    return f"{pm(cell['final_val_loss'])} ({signed(cell['degradation'])})"


def _traffic_cell(cell: Mapping[str, Any] | None) -> str:
    if cell is None:
        return MISSING
    return f"{format_bytes(cell['bytes_per_worker'])} ({format_traffic(cell['traffic_vs_ddp'])})"


def _tables(summary: Mapping[str, Any]) -> list[str]:
    periods = summary["settings"]["periods"]
    variants = summary["variants"]
    losses = [
        [
            name,
            *(_loss_cell(info["periods"].get(k)) for k in periods),
            MISSING if info["slope_per_doubling"] is None else signed(info["slope_per_doubling"]),
        ]
        for name, info in variants.items()
    ]
    traffic = [
        [name, *(_traffic_cell(info["periods"].get(k)) for k in periods)]
        for name, info in variants.items()
    ]
    k_columns = [f"K = {k}" for k in periods]
    return [
        "## Final validation loss (degradation vs DDP) by K",
        "",
        *table(["variant", *k_columns, "slope / doubling"], losses),
        "",
        "## Traffic per worker (vs DDP)",
        "",
        *table(["variant", *k_columns], traffic),
    ]


def render_ablation_report(summary: Mapping[str, Any]) -> str:
    s = summary["settings"]
    lines = [
        f"# Sync-period ablation: {s['model']} model, M = {s['workers']}, {s['steps']} steps",
        "",
        *_settings_section(summary),
        "",
        "## Verdict",
        "",
        ablation_verdict(summary),
        "",
        *_tables(summary),
        "",
        f"![degradation vs K]({PLOT})",
        "",
        *failures_section(summary.get("failures")),
    ]
    return "\n".join(lines)


# -- the plot -------------------------------------------------------------------------------------


def plot_degradation_vs_k(
    curves: Mapping[str, Mapping[str, Any]], path: Path, title: str, subtitle: str = ""
) -> Path:
    """One line per variant: ``curves[variant] = {"periods", "degradation", "std", "color",
    "linestyle"}`` (see :func:`~mtdao.experiments.ablation.summary.degradation_curves`)."""
    plt = pyplot()
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(10, 4.8), dpi=130)
        for variant, curve in curves.items():
            periods = np.array(curve["periods"], dtype=float)
            values = np.array(curve["degradation"], dtype=float)
            line = {"color": curve.get("color"), "ls": curve.get("linestyle", "-")}
            ax.plot(periods, values, marker="o", lw=2, label=variant, **line)
            std = np.array(curve.get("std") or [0.0] * len(values), dtype=float)
            if std.any():
                ax.fill_between(
                    periods, values - std, values + std, color=line["color"], alpha=0.12, lw=0
                )
        ax.axhline(0.0, color=color("ddp"), lw=1, ls="--")
        ax.annotate("DDP", (0.01, 0.0), xycoords=("axes fraction", "data"), fontsize=8, va="bottom")
        ax.set_xscale("log", base=2)
        ticks = sorted({k for curve in curves.values() for k in curve["periods"]})
        ax.set_xticks(ticks, [str(k) for k in ticks])
        ax.minorticks_off()
        ax.set_xlabel("sync period K (log2 scale)")
        ax.set_ylabel("final val loss minus DDP's")
        ax.set_title(title)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
        if subtitle:
            fig.suptitle(subtitle, fontsize=9, color="0.35", y=0.01, va="bottom")
            fig.tight_layout(rect=(0, 0.04, 1, 1))
        else:
            fig.tight_layout()
        save(fig, path)
    return Path(path)


def write_ablation_outputs(out_dir: Path, summary: Mapping[str, Any]) -> tuple[Path, Path]:
    """report.md and the degradation plot in ``out_dir``."""
    s = summary["settings"]
    plot = plot_degradation_vs_k(
        degradation_curves(summary),
        Path(out_dir) / PLOT,
        "Loss degradation vs sync period",
        f"{s['model']} model, M = {s['workers']}, {s['steps']} steps, seeds "
        f"{join_numbers(s['seeds'])}; DDP final loss {summary['ddp']['final_val_loss']['mean']:.4f}",
    )
    report = Path(out_dir) / "report.md"
    report.write_text(render_ablation_report(summary))
    return report, plot
