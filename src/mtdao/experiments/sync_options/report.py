"""``mtdao sync-options``' report.md and options.png, rendered from its results.json alone."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mtdao.experiments.common.figures import pyplot, save
from mtdao.experiments.common.formatting import (
    SIGNIFICANCE_RULE,
    failures_section,
    format_traffic,
    pm,
    signed,
    table,
)
from mtdao.units import format_bytes

SETTING_TITLES = {
    "k32": "states on the period rule (every K)",
    "state16": "states every 16 steps (--state-sync-period 16)",
}
VERDICTS = {
    "better": "lower (significant)",
    "worse": "higher (significant)",
    "tie": "tie",
    None: "one seed, no verdict",
}


def _cells(option: str, row: Mapping[str, Any], summary: Mapping[str, Any]) -> list[str]:
    reference = summary["table"][summary["setting"]].get(summary["reference"], {})
    peak = row["peak_step_bytes"] / max(reference.get("peak_step_bytes") or 1, 1)
    is_reference = option == summary["reference"]
    return [
        option,
        f"`{summary['options'][option]}`" if summary["options"][option] else "(float32, blocking)",
        pm(row["val_loss"]),
        "-"
        if is_reference
        else f"{signed(row['difference'])}: {VERDICTS[row['versus_reference']]}",
        format_traffic(row["reduction_vs_ddp"]),
        f"{format_bytes(row['peak_step_bytes'])} ({peak:.2f}x)",
        "-" if is_reference else _paired(row.get("paired_difference")),
    ]


def _paired(paired: Mapping[str, Any] | None) -> str:
    """Mean ± std of the per-seed differences, and in how many seeds the option was higher."""
    if not paired:
        return "-"
    higher = sum(value > 0 for value in paired["values"])
    return f"{signed(paired['mean'])} ± {paired['std']:.4f} (higher in {higher} of {paired['n']})"


def render_report(summary: Mapping[str, Any]) -> str:
    setup = summary["setup"]
    lines = [
        "# Sync options: overlapped, fragmented and quantized rounds against float32 rounds",
        "",
        f"Command: `{summary['command']}`",
        "",
        f"MT-DAO, {setup['model']} model ({summary['parameters']:,} parameters), "
        f"M = {setup['workers']} simulated workers x {setup['batch_size']} x {setup['seq_len']} "
        f"tokens, {setup['steps']} steps, K = {setup['sync_period']}, lr {setup['lr']:g}, seeds "
        f"{' '.join(map(str, summary['seeds']))}. Final validation loss: mean ± std over seeds.",
        f"Significance rule: {SIGNIFICANCE_RULE}.",
    ]
    header = (
        "option",
        "flags",
        "final val loss",
        "vs float32 blocking",
        "traffic vs DDP",
        "peak per step (vs float32)",
        "paired by seed: difference, mean ± std",
    )
    for setting in summary["settings"]:
        rows = summary["table"][setting]
        context = {**summary, "setting": setting}
        lines += ["", f"## {SETTING_TITLES.get(setting, setting)}", ""]
        lines += table(header, (_cells(o, r, context) for o, r in rows.items()))
    lines += [
        "",
        "- traffic vs DDP: DDP's bytes over the run's (the harness's account: encoded payloads, "
        "scales and padding included), over the whole run.",
        "- peak per step: the most one worker sends at any one step; fragments spread a round "
        "over the period.",
        "- paired by seed: the option's final loss minus float32's with the same seed (same "
        "initialization and data), over the seeds; not the significance rule, which compares the "
        "spreads over seeds. Runs that differ only in float rounding already end a few 0.01 apart.",
    ]
    if summary.get("failures"):
        lines += ["", *failures_section(summary["failures"])]
    return "\n".join(lines) + "\n"


def plot_options(out: Path, summary: Mapping[str, Any]) -> Path:
    """Final loss per option, one panel per setting: a dot at the mean over seeds with its std as
    a line, the reference dashed, each dot labelled with its difference from the reference.

    Dots, not bars: the axis spans only the spread of the losses, and a bar's length from such an
    axis' edge would draw a difference of 0.01 as a tenfold one. Ticks are plain losses (no
    offset), and an option keeps its colour in every panel."""
    from matplotlib.ticker import ScalarFormatter

    plt = pyplot()
    settings = [s for s in summary["settings"] if summary["table"][s]]
    count = max(len(settings), 1)
    every_option = list(dict.fromkeys(n for s in settings for n in summary["table"][s]))
    colors = {name: f"C{i % 10}" for i, name in enumerate(every_option)}
    fig, axes = plt.subplots(1, count, figsize=(5.5 * count, 4.2), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        rows = summary["table"][setting]
        names = list(rows)
        means = [rows[n]["val_loss"]["mean"] for n in names]
        stds = [rows[n]["val_loss"]["std"] or 0.0 for n in names]
        reference = rows.get(summary["reference"])
        for y, (name, mean, std) in enumerate(zip(names, means, stds)):
            ax.errorbar(mean, y, xerr=std, fmt="o", color=colors[name], capsize=3, ms=6)
            if reference is not None and name != summary["reference"]:
                change = mean - reference["val_loss"]["mean"]
                ax.annotate(
                    f"{change:+.4f}", (mean, y), xytext=(0, 7), textcoords="offset points",
                    ha="center", fontsize=8, color="0.25",
                )  # fmt: skip
        if reference is not None:
            ax.axvline(reference["val_loss"]["mean"], color="0.3", ls="--", lw=1)
        ax.set_yticks(range(len(names)), names)
        ax.set_ylim(len(names) - 0.5, -0.8)  # first option on top, room for its label
        low = min(m - s for m, s in zip(means, stds))
        high = max(m + s for m, s in zip(means, stds))
        margin = 0.08 * (high - low) or 0.01
        ax.set_xlim(low - margin, high + margin)
        ax.xaxis.set_major_formatter(ScalarFormatter(useOffset=False))
        ax.set_title(SETTING_TITLES.get(setting, setting), fontsize=10)
        ax.set_xlabel(
            f"final validation loss (mean ± std over seeds; dashed: {summary['reference']})"
        )
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path = Path(out) / "options.png"
    save(fig, path)
    return path
