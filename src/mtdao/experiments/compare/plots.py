"""The four figures of ``mtdao compare``; each takes the summary dict its report renders.

Curves are means over seeds with a min-max band; the DDP target loss is a dashed line where it
helps. Colours and style: :mod:`mtdao.experiments.common.figures`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mtdao.experiments.common.figures import (
    STYLE,
    color,
    eng_formatter,
    plain_log_ticks,
    saved_figure,
)
from mtdao.experiments.common.formatting import format_bytes, format_traffic, join_numbers, label
from mtdao.experiments.compare.wallclock import LINK_PRESETS, Link, step_end_times

TIME_LINKS = ("1gbit", "100mbit-cross-continent")
VAL_LOSS = "validation loss (nats/token)"


def _order(summary: Mapping[str, Any]) -> list[str]:
    wanted = summary["settings"].get("methods") or list(summary["runs"])
    return [m for m in wanted if m in summary["runs"]]


def _name(summary: Mapping[str, Any], method: str) -> str:
    return label(method, summary["settings"].get("optimizer", "adam"))


# -- curves over seeds ----------------------------------------------------------------------------


def eval_matrix(runs: Sequence[Mapping[str, Any]], key: str = "val_loss"):
    """(steps, tokens, values[seed, eval]) over the evaluation steps every run has."""
    common = set.intersection(*({e["step"] for e in r["evals"]} for r in runs))
    steps = sorted(common)
    tokens = [next(e["tokens"] for e in runs[0]["evals"] if e["step"] == s) for s in steps]
    values = np.array(
        [[next(e[key] for e in r["evals"] if e["step"] == s) for s in steps] for r in runs],
        dtype=float,
    )
    return np.array(steps), np.array(tokens, dtype=float), values


def _alignment_matrix(runs: Sequence[Mapping[str, Any]], key: str):
    """(sync steps, mean over workers[seed, sync]) over the syncs every run has."""
    common = set.intersection(*({a["step"] for a in r.get("alignment") or []} for r in runs))
    steps = sorted(common)
    values = np.array(
        [
            [np.mean(next(a[key] for a in r["alignment"] if a["step"] == s)) for s in steps]
            for r in runs
        ],
        dtype=float,
    )
    return np.array(steps), values


def modelled_times(runs: Sequence[Mapping[str, Any]], compute_s: float, link: Link, steps):
    """Modelled seconds at which each of ``steps`` completes, mean over ``runs``."""
    per_run = [
        step_end_times(
            compute_s, [tuple(e) for e in r["comm_events"]], r["workers"], link, steps=r["steps"]
        )
        for r in runs
    ]
    return np.array(per_run).mean(axis=0)[np.asarray(steps) - 1]


def _mean_and_band(ax, x, values: np.ndarray, method: str, **line) -> np.ndarray:
    """The mean over seeds as a line, the min-max band behind it when there are several."""
    mean = values.mean(axis=0)
    ax.plot(x, mean, color=color(method), lw=2, **line)
    if values.shape[0] > 1:
        ax.fill_between(x, values.min(0), values.max(0), color=color(method), alpha=0.15, lw=0)
    return mean


def _target_line(ax, summary: Mapping[str, Any]) -> None:
    target = summary.get("target_val_loss")
    if target is not None:
        ax.axhline(target, color=color("ddp"), lw=0.8, ls="--", alpha=0.6)


def _focus_ylim(ax, curves: Sequence[np.ndarray], target: float | None, start: float) -> None:
    """Zoom the y axis onto the late part of the curves (from fraction ``start`` of each)."""
    late = [c[int(len(c) * start) :] for c in curves if len(c)]
    finite = np.concatenate([c[np.isfinite(c)] for c in late]) if late else np.array([])
    if not finite.size:
        return
    low = finite.min()
    finals = [c[np.isfinite(c)][-1] for c in curves if np.isfinite(c).any()]
    high = max(max(finals), target if target is not None else -math.inf)
    span = max(high - low, 1e-3)
    ax.set_ylim(low - 0.1 * span, min(finite.max(), high + 1.5 * span))


def _focus_xlim(ax, curves) -> None:
    """Start the x axis where the first curve enters the (zoomed) y range, or at 0 if early."""
    top = ax.get_ylim()[1]
    entries = [x[np.argmax(y <= top)] for x, y in curves if (y <= top).any()]
    right = max(x[-1] for x, _ in curves) if curves else 1.0
    left = min(entries) if entries else 0.0
    ax.set_xlim(0.0 if left < 0.3 * right else 0.95 * left, right * 1.03)


def _time_unit(seconds: float) -> tuple[str, float]:
    if seconds < 120:
        return "s", 1.0
    if seconds < 7200:
        return "min", 60.0
    return "h", 3600.0


def _footnote(fig, text: str) -> None:
    fig.suptitle(text, fontsize=9, color="0.35", y=0.01, va="bottom")
    fig.tight_layout(rect=(0, 0.04, 1, 1))


# -- the figures ----------------------------------------------------------------------------------


def plot_loss_vs_tokens(summary: Mapping[str, Any], path: Path) -> Path:
    with saved_figure(path, 1, 2, figsize=(12, 4.6), dpi=130) as (fig, (full, zoom)):
        means, tokens = [], []
        for method in _order(summary):
            _, tokens, values = eval_matrix(summary["runs"][method])
            n = values.shape[0]
            name = f"{_name(summary, method)} ({n} seed{'s' * (n > 1)})"
            for ax in (full, zoom):
                mean = _mean_and_band(ax, tokens, values, method, label=name)
            means.append(mean)
        for ax in (full, zoom):
            _target_line(ax, summary)
            ax.set_xlabel("training tokens (all workers)")
            ax.set_ylabel(VAL_LOSS)
            ax.xaxis.set_major_formatter(eng_formatter())
        full.set_yscale("log")
        plain_log_ticks(full.yaxis)
        full.set_title("Validation loss vs tokens")
        zoom.set_title("Second half, zoomed (dashed: DDP's final loss)")
        if means and len(tokens) > 1:  # one evaluation (a tiny budget): nothing to zoom into
            zoom.set_xlim(tokens[len(tokens) // 2] if len(tokens) > 2 else tokens[0], tokens[-1])
            _focus_ylim(zoom, means, summary.get("target_val_loss"), 0.5)
        full.legend(loc="upper right")
        s = summary["settings"]
        _footnote(
            fig,
            f"{s.get('model')} model, M = {s.get('workers')} workers, K = {s.get('sync_period')}, "
            f"{s.get('steps')} steps, seeds {join_numbers(s.get('seeds', []))}; "
            "band: min-max over seeds",
        )
    return Path(path)


def _loss_vs_time_panel(ax, summary: Mapping[str, Any], name: str) -> None:
    link = LINK_PRESETS[name]
    curves = []
    for method in _order(summary):
        runs = summary["runs"][method]
        steps, _, values = eval_matrix(runs)
        curves.append(
            (method, modelled_times(runs, summary["compute_s_per_step"], link, steps), values)
        )
    unit, scale = _time_unit(max(c[1][-1] for c in curves) if curves else 1.0)
    for method, times, values in curves:
        mean = _mean_and_band(ax, times / scale, values, method, label=_name(summary, method))
        ax.plot(times[-1] / scale, mean[-1], "o", color=color(method), ms=5)
    _target_line(ax, summary)
    _focus_ylim(ax, [c[2].mean(axis=0) for c in curves], summary.get("target_val_loss"), 0.2)
    ax.set_title(f"{name}: {link.bandwidth_gbit:g} Gbit/s, {link.latency_s * 1e3:g} ms latency")
    ax.set_xlabel(f"modelled wall-clock time ({unit})")
    ax.set_ylabel(VAL_LOSS)
    _focus_xlim(ax, [(c[1] / scale, c[2].mean(axis=0)) for c in curves])


def plot_loss_vs_time(summary: Mapping[str, Any], path: Path) -> Path:
    links = [name for name in TIME_LINKS if name in LINK_PRESETS]
    size = (6 * len(links), 4.6)
    with saved_figure(path, 1, len(links), figsize=size, dpi=130, squeeze=False) as (fig, axes):
        for ax, name in zip(axes[0], links):
            _loss_vs_time_panel(ax, summary, name)
        axes[0][0].legend(loc="lower left")
        _footnote(
            fig,
            f"Same tokens, modelled time: compute {summary['compute_s_per_step'] * 1e3:.1f} "
            "ms/step for every method + ring all-reduces of the logged traffic (dot: end of run)",
        )
    return Path(path)


def plot_alignment(summary: Mapping[str, Any], path: Path) -> Path:
    from matplotlib.ticker import MaxNLocator

    methods = [m for m in _order(summary) if all(r.get("alignment") for r in summary["runs"][m])]
    with saved_figure(path, 1, 2, figsize=(12, 4.6), dpi=130) as (fig, (cos_ax, drift_ax)):
        sync_steps: set[int] = set()
        for method in methods:
            for ax, key in ((cos_ax, "cosine"), (drift_ax, "drift")):
                steps, values = _alignment_matrix(summary["runs"][method], key)
                sync_steps.update(int(step) for step in steps)
                if len(steps):
                    _mean_and_band(
                        ax, steps, values, method, marker="o", ms=3, label=_name(summary, method)
                    )
        cos_ax.axhline(
            0.95, color="0.5", lw=0.9, ls=":", label="paper: MT-DAO > 0.95, Local ADOPT ~0.7"
        )
        cos_ax.axhline(0.7, color="0.5", lw=0.9, ls=":")
        cos_ax.set_title("Worker / global pseudo-gradient cosine")
        cos_ax.set_ylabel("cosine, mean over workers")
        cos_ax.set_ylim(top=1.02)
        drift_ax.set_title("Worker drift from the average before each sync")
        drift_ax.set_ylabel("L2 distance, mean over workers")
        for ax in (cos_ax, drift_ax):
            ax.set_xlabel("step (parameter syncs)")
            if 0 < len(sync_steps) <= 12:  # few syncs: a tick at each
                ax.set_xticks(sorted(sync_steps))
            else:
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: no 31.5
        if methods:  # below the panels: with few syncs any corner of a panel holds data
            handles, labels = cos_ax.get_legend_handles_labels()
            fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4))
            fig.tight_layout(rect=(0, 0.08 * math.ceil(len(labels) / 4), 1, 1))
        else:
            cos_ax.text(
                0.5, 0.5, "no parameter syncs logged", ha="center", transform=cos_ax.transAxes
            )
            fig.tight_layout()
    return Path(path)


def plot_traffic(summary: Mapping[str, Any], path: Path) -> Path:
    methods = _order(summary)[::-1]  # first method on top
    summaries = summary["methods"]
    style = {**STYLE, "axes.grid": False, "axes.axisbelow": True}
    size = (8, 0.6 * len(methods) + 1.6)
    with saved_figure(path, style=style, figsize=size, dpi=130) as (fig, ax):
        sent = [max(summaries[m]["bytes_per_worker"], 1.0) for m in methods]
        floor = min(sent) / 10
        ax.barh(
            [_name(summary, m) for m in methods],
            [v - floor for v in sent],
            left=floor,
            color=[color(m) for m in methods],
            height=0.6,
        )
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(eng_formatter("B"))
        ax.grid(axis="x", alpha=0.3, which="major")
        for y, method in enumerate(methods):
            text = format_bytes(summaries[method]["bytes_per_worker"])
            if method != "ddp":
                text += f"  ({format_traffic(summaries[method]['traffic_vs_ddp'], 'DDP')})"
            ax.annotate(
                text,
                (sent[y], y),
                xytext=(4, 0),
                textcoords="offset points",
                va="center",
                fontsize=9,
            )
        ax.set_xlim(floor, max(sent) * 12)
        ax.set_xlabel("bytes sent per worker over the run (log scale)")
        ax.set_title("Communication per worker")
        fig.tight_layout()
    return Path(path)


def write_compare_plots(out_dir: Path, summary: Mapping[str, Any]) -> list[Path]:
    out_dir = Path(out_dir)
    return [
        plot_loss_vs_tokens(summary, out_dir / "loss_vs_tokens.png"),
        plot_loss_vs_time(summary, out_dir / "loss_vs_time.png"),
        plot_alignment(summary, out_dir / "alignment.png"),
        plot_traffic(summary, out_dir / "traffic.png"),
    ]
