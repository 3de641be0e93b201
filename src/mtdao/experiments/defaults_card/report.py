"""The defaults card as report.md and card.png, from its summary
(:mod:`.summary`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mtdao.experiments.common.figures import saved_figure
from mtdao.experiments.common.formatting import MISSING, failures_section, pm, signed, table
from mtdao.train.config import TextSettings

ENTRY_COLORS = {
    "ddp": "#222222",
    "local-adam": "#ff7f0e",
    "mtdao": "#d62728",
    "mtdao-warmup-0.3": "#9467bd",
    "mtdao-0.95-0.7": "#1f77b4",
    "mtdao-cosine": "#2ca02c",
    "ddp-cosine": "#7f7f7f",
    "local-adam-cosine": "#ffbb78",
    "mtdao-lr-warmup-0.05": "#e377c2",
    "ddp-lr-warmup-0.05": "#bcbd22",
    "local-adam-lr-warmup-0.05": "#8c564b",
    # the names of cards made before WSD became the default (2026-12-04)
    "mtdao-wsd": "#2ca02c",
    "ddp-wsd": "#7f7f7f",
    "local-adam-wsd": "#ffbb78",
}
PERIOD_STYLES = ("-", "--", ":")


SPLIT_NOTES = {
    "contiguous": "non-IID: equal cuts of the corpus in path order, the split of every card "
    "before 2026-12-02",
    "by-file": "non-IID: each worker its own run of files",
}


def render(summary: dict[str, Any]) -> str:
    """report.md from the card's results.json."""
    return "\n".join(card_report_lines(summary)) + "\n"


def card_report_lines(summary: dict[str, Any]) -> list[str]:
    entries = summary["entries"]
    # a summary without the field predates the shuffled split: its shards were contiguous
    grid, split = summary["grid"], summary.get("data_split", "contiguous")
    lines = [
        "# The defaults card: every method at its own defaults",
        "",
        "Each run is `mtdao train --model micro --method M --steps N --sync-period K --data D "
        "--seed S` and nothing else: every other flag, the learning rate included, at its "
        "default. Final validation loss, mean ± sample std over seeds "
        f"{', '.join(map(str, grid['seeds']))}; {summary['significance_rule']}.",
        "",
        "Entries: "
        + "; ".join(f"`{e['name']}`" + (f" ({e['note']})" if e["note"] else "") for e in entries)
        + ".",
        "",
        "Corpora: "
        + ", ".join(f"{name} (`{path}`)" for name, path in summary["data"].items())
        + "".join(f"; {name} missing: {why}" for name, why in summary["missing"].items())
        + ".",
        "",
        f"Worker shards: `--data-split {split}`"
        + (
            " (the default)."
            if split == TextSettings.data_split
            else f" ({SPLIT_NOTES.get(split, '')})."
        ),
        "",
    ]
    own = sorted(_own_rounds(summary))
    if own:
        lines += [
            "K: the sync period of the entries that take one; DDP and "
            + ", ".join(f"`{name}`" for name in own)
            + " (its own rounds) are the same runs in every K row.",
            "",
        ]
    if drawable(summary):  # then plot_card drew card.png
        lines += ["![MT-DAO against DDP and Local Adam, per corpus](card.png)", ""]
    header = ["corpus", "steps", "K", *(f"`{e['name']}`" for e in entries)]
    header += ["MT-DAO − Local Adam", "MT-DAO − DDP"]
    rows = []
    for cell in summary["cells"]:
        values = [pm(cell["entries"][e["name"]]["stats"]) for e in entries]
        gaps = cell["gaps"].get("mtdao", {})
        rows.append(
            [
                cell["corpus"],
                str(cell["steps"]),
                str(cell["sync_period"]),
                *values,
                _gap(gaps.get("local-adam")),
                _gap(gaps.get("ddp")),
            ]
        )
    lines += table(header, rows) + [""]
    lines += [
        "Gap: difference of means (relative), the verdict of the significance rule, and on how "
        "many seeds MT-DAO is lower. `one seed`: not enough seeds for a verdict yet.",
        "",
        f"{summary['runs_finished']} runs finished." + _reused(summary.get("reused")),
        "",
    ]
    lines += steps_to_ddp_lines(summary.get("steps_to_ddp", []))
    lines += horizon_lines(summary.get("horizons", []), [e["name"] for e in entries])
    return lines + failures_section(summary["failures"])


def steps_to_ddp_lines(timed: list[dict[str, Any]]) -> list[str]:
    """How many steps each current entry needs to reach DDP's loss at the reference length."""
    if not timed:
        return []
    names = list(timed[0]["entries"])
    reference = timed[0]["reference_steps"]
    header = ["corpus", "K", f"DDP at {reference}", *(f"`{n}`" for n in names)]
    rows = [
        [check["corpus"], str(check["sync_period"]), f"{check['target']:.4f}"]
        + [_steps(check["entries"][name], reference) for name in names]
        for check in timed
    ]
    return [
        "## Steps to DDP's loss",
        "",
        f"The fewest steps a run needs to end at or below DDP's mean final loss at {reference} "
        "steps: each length is its own run with its own schedule, and the steps are interpolated "
        "linearly between the lengths around the first that reaches it; mean ± std over the "
        "seeds that reach it (as a fraction of the reference length), and how many of the "
        "seeds whose reference run finished do.",
        "",
        *table(header, rows),
        "",
    ]


def _reused(reused: dict[str, Any] | None) -> str:
    if not reused or not reused["runs"]:
        return ""
    return (
        f" The final losses of {len(reused['runs'])} more runs are those recorded in "
        f"`{reused['from']}` (their short-run checks too): that card's runs, not trained again."
    )


def _steps(timed: dict[str, Any], reference: int) -> str:
    if not timed["seeds"]:
        return MISSING
    reached = f"{timed['reached']}/{timed['seeds']} seeds"
    if timed["stats"] is None:
        return f"not by {reference} ({reached})"
    mean, std = timed["stats"]["mean"], timed["stats"]["std"]
    return f"{mean:.0f} ± {std:.0f} ({timed['fraction']:.2f}x; {reached})"


def horizon_lines(checks: list[dict[str, Any]], names: list[str]) -> list[str]:
    """Is a short run the start of a long one? One row per corpus, K and pair of lengths."""
    if not checks:
        return []
    header = ["corpus", "K", "short run / longer run", *(f"`{n}`" for n in names)]
    rows = []
    for check in checks:
        cells = []
        for name in names:
            value = check["entries"].get(name)
            cells.append(
                MISSING if value is None else f"{value['mean'] * 100:+.1f}% ({value['seeds']})"
            )
        rows.append(
            [check["corpus"], str(check["sync_period"]), f"{check['short']} / {check['long']}"]
            + cells
        )
    return [
        "## Is a short run the start of a long one?",
        "",
        "Each short run's final validation loss against the longer run's at the same step "
        "(interpolated between its evaluations), relative, mean over the seeds that have both "
        "(their number in brackets). The short run's learning rate has annealed by then and the "
        "longer one's has not, which moves every method alike; an entry is as horizon-free as "
        "the baselines where its figure is no higher than theirs.",
        "",
        *table(header, rows),
        "",
    ]


def _gap(gap: dict[str, Any] | None) -> str:
    if gap is None:
        return MISSING
    relative = f" ({gap['relative'] * 100:+.1f}%)" if gap["relative"] is not None else ""
    return (
        f"{signed(gap['difference'])}{relative} {gap['verdict']}, "
        f"lower on {gap['lower_on']}/{gap['shared_seeds']}"
    )


def _drawn_entries(summary: dict[str, Any]) -> list[str]:
    return [e["name"] for e in summary["entries"] if e["name"] != "ddp"]


def _own_rounds(summary: dict[str, Any]) -> set[str]:
    """Entries that run their own rounds in every K cell: one line each, not one per K."""
    return {e["name"] for e in summary["entries"] if e.get("own_rounds")}


def _relative_points(cells: list[dict[str, Any]], name: str) -> list[tuple[int, float]]:
    """(steps, % above DDP's final loss) of ``name`` in each of ``cells`` where both finished."""
    return [
        (c["steps"], 100 * (s["mean"] / d["mean"] - 1))
        for c in cells
        if (s := c["entries"][name]["stats"]) and (d := c["entries"]["ddp"]["stats"])
    ]


def drawable(summary: dict[str, Any]) -> bool:
    """Whether card.png has a point to show."""
    return any(_relative_points(summary["cells"], name) for name in _drawn_entries(summary))


def plot_card(summary: dict[str, Any], path: Path) -> bool:
    """One panel per corpus: each entry's loss relative to DDP's against the run length, one
    line style per sync period. False when there is nothing to draw."""
    if not drawable(summary):
        return False
    corpora = list(dict.fromkeys(cell["corpus"] for cell in summary["cells"]))
    periods = sorted({cell["sync_period"] for cell in summary["cells"]})
    own_rounds = _own_rounds(summary)  # drawn once, with the first period
    panels = max(1, len(corpora))
    size = (4.2 * panels, 3.6)
    with saved_figure(path, 1, panels, figsize=size, squeeze=False, sharey=True) as (fig, axes):
        for axis, corpus in zip(axes[0], corpora):
            for p_index, period in enumerate(periods):
                cells = sorted(
                    (
                        c
                        for c in summary["cells"]
                        if c["corpus"] == corpus and c["sync_period"] == period
                    ),
                    key=lambda c: c["steps"],
                )
                for name in _drawn_entries(summary):
                    points = _relative_points(cells, name)
                    if not points or (name in own_rounds and p_index > 0):
                        continue
                    steps, relative = zip(*points)
                    axis.plot(
                        steps,
                        relative,
                        PERIOD_STYLES[p_index % 3],
                        marker="o",
                        markersize=3,
                        color=ENTRY_COLORS.get(name, "#1f77b4"),
                        label=name if name in own_rounds else f"{name}, K = {period}",
                    )
            axis.axhline(0, color=ENTRY_COLORS["ddp"], linewidth=0.8)
            axis.set_xscale("log")
            lengths = sorted({c["steps"] for c in summary["cells"] if c["entries"]["ddp"]["stats"]})
            axis.set_xticks(lengths, [f"{n:g}" for n in lengths])
            axis.minorticks_off()
            axis.set_title(corpus)
            axis.set_xlabel("steps (run length)")
        axes[0][0].set_ylabel("final val loss above DDP's (%)")
        # from every panel: a card run in part may have nothing on the first corpus
        legend = {}
        for axis in axes[0]:
            for handle, label in zip(*axis.get_legend_handles_labels()):
                legend.setdefault(label, handle)
        labels = list(legend)
        fig.legend(
            list(legend.values()),
            labels,
            loc="lower center",
            ncol=min(4, len(labels)),
            fontsize=8,
            bbox_to_anchor=(0.5, -0.02),
        )
        fig.tight_layout(rect=(0, 0.08, 1, 1))
    return True
