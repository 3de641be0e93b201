"""Pictures of the experiment reports; every figure takes the summary dict its report renders.

Each method keeps one color in every figure (DDP black, MT-DAO red, Local Adam orange, ...), curves
are means over seeds with a min-max band, and the DDP target loss is a dashed line where it helps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mtdao.experiments.report import label
from mtdao.experiments.wallclock import LINK_PRESETS, step_end_times

METHOD_COLORS = {
    "ddp": "#222222",
    "qh-ddp": "#8c8c8c",
    "local-adam": "#ff7f0e",
    "diloco": "#2ca02c",
    "desloc": "#9467bd",
    "mtdao": "#d62728",
}
TIME_LINKS = ("1gbit", "100mbit-cross-continent")
STYLE = {
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.titleweight": "bold",
    "legend.frameon": False,
    "font.size": 10,
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def color(method: str) -> str:
    return METHOD_COLORS.get(method, "#1f77b4")


def _order(summary: Mapping[str, Any]) -> list[str]:
    wanted = summary["settings"].get("methods") or list(summary["runs"])
    return [m for m in wanted if m in summary["runs"]]


def _name(summary: Mapping[str, Any], method: str) -> str:
    return label(method, summary["settings"].get("optimizer", "adam"))


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


def plot_loss_vs_tokens(summary: Mapping[str, Any], path: Path) -> Path:
    plt = _pyplot()
    with plt.rc_context(STYLE):
        fig, (full, zoom) = plt.subplots(1, 2, figsize=(12, 4.6), dpi=130)
        means = []
        for method in _order(summary):
            _, tokens, values = eval_matrix(summary["runs"][method])
            mean = values.mean(axis=0)
            means.append(mean)
            n = values.shape[0]
            for ax in (full, zoom):
                ax.plot(
                    tokens,
                    mean,
                    color=color(method),
                    lw=2,
                    label=f"{_name(summary, method)} ({n} seed{'s' * (n > 1)})",
                )
                if n > 1:
                    ax.fill_between(
                        tokens, values.min(0), values.max(0), color=color(method), alpha=0.15, lw=0
                    )
        for ax in (full, zoom):
            _target_line(ax, summary)
            ax.set_xlabel("training tokens (all workers)")
            ax.set_ylabel("validation loss (nats/token)")
        full.set_yscale("log")
        _plain_log_ticks(full.yaxis)
        for ax in (full, zoom):
            ax.xaxis.set_major_formatter(_eng())
        full.set_title("Validation loss vs tokens")
        zoom.set_title("Second half, zoomed (dashed: DDP's final loss)")
        if means:
            zoom.set_xlim(tokens[len(tokens) // 2] if len(tokens) > 2 else tokens[0], tokens[-1])
            _focus_ylim(zoom, means, summary.get("target_val_loss"), 0.5)
        full.legend(loc="upper right")
        fig.suptitle(_subtitle(summary), fontsize=9, color="0.35", y=0.01, va="bottom")
        fig.tight_layout(rect=(0, 0.04, 1, 1))
        fig.savefig(path)
        plt.close(fig)
    return Path(path)


def _eng(unit: str = ""):
    from matplotlib.ticker import EngFormatter

    return EngFormatter(unit=unit, sep="" if not unit else " ")


def _plain_log_ticks(axis) -> None:
    """Log axis labelled 0.7, 1, 2, 3, 5 instead of 7x10^-1, 10^0, ..."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    def text(value, _):
        mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9) if value > 0 else 0
        return f"{value:g}" if round(mantissa, 6) in (1, 2, 3, 5) else ""

    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(text))
    axis.set_minor_formatter(FuncFormatter(lambda value, _: ""))


def _subtitle(summary: Mapping[str, Any]) -> str:
    s = summary["settings"]
    return (
        f"{s.get('model')} model, M = {s.get('workers')} workers, K = {s.get('sync_period')}, "
        f"{s.get('steps')} steps, seeds {', '.join(map(str, s.get('seeds', [])))}; "
        "band: min-max over seeds"
    )


def _time_unit(seconds: float) -> tuple[str, float]:
    if seconds < 120:
        return "s", 1.0
    if seconds < 7200:
        return "min", 60.0
    return "h", 3600.0


def _focus_xlim(ax, curves) -> None:
    """Start the x axis where the first curve enters the (zoomed) y range, or at 0 if early."""
    top = ax.get_ylim()[1]
    entries = [x[np.argmax(y <= top)] for x, y in curves if (y <= top).any()]
    right = max(x[-1] for x, _ in curves) if curves else 1.0
    left = min(entries) if entries else 0.0
    ax.set_xlim(0.0 if left < 0.3 * right else 0.95 * left, right * 1.03)


def plot_loss_vs_time(summary: Mapping[str, Any], path: Path) -> Path:
    plt = _pyplot()
    compute_s = summary["compute_s_per_step"]
    links = [name for name in TIME_LINKS if name in LINK_PRESETS]
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(
            1, len(links), figsize=(6 * len(links), 4.6), dpi=130, squeeze=False
        )
        for ax, name in zip(axes[0], links):
            link = LINK_PRESETS[name]
            curves, ends = [], []
            for method in _order(summary):
                runs = summary["runs"][method]
                steps, _, values = eval_matrix(runs)
                times = np.array(
                    [
                        step_end_times(
                            compute_s,
                            [tuple(e) for e in r["comm_events"]],
                            r["workers"],
                            link,
                            steps=r["steps"],
                        )
                        for r in runs
                    ]
                ).mean(axis=0)[steps - 1]
                curves.append((method, times, values))
                ends.append(times[-1])
            unit, scale = _time_unit(max(ends) if ends else 1.0)
            for method, times, values in curves:
                mean = values.mean(axis=0)
                ax.plot(
                    times / scale, mean, color=color(method), lw=2, label=_name(summary, method)
                )
                ax.plot(times[-1] / scale, mean[-1], "o", color=color(method), ms=5)
                if values.shape[0] > 1:
                    ax.fill_between(
                        times / scale,
                        values.min(0),
                        values.max(0),
                        color=color(method),
                        alpha=0.15,
                        lw=0,
                    )
            _target_line(ax, summary)
            _focus_ylim(
                ax, [c[2].mean(axis=0) for c in curves], summary.get("target_val_loss"), 0.2
            )
            ax.set_title(
                f"{name}: {link.bandwidth_gbit:g} Gbit/s, {link.latency_s * 1e3:g} ms latency"
            )
            ax.set_xlabel(f"modelled wall-clock time ({unit})")
            ax.set_ylabel("validation loss (nats/token)")
            _focus_xlim(ax, [(c[1] / scale, c[2].mean(axis=0)) for c in curves])
        axes[0][0].legend(loc="lower left")
        fig.suptitle(
            f"Same tokens, modelled time: compute {compute_s * 1e3:.1f} ms/step for every method "
            "+ ring all-reduces of the logged traffic (dot: end of run)",
            fontsize=9,
            color="0.35",
            y=0.01,
            va="bottom",
        )
        fig.tight_layout(rect=(0, 0.04, 1, 1))
        fig.savefig(path)
        plt.close(fig)
    return Path(path)


def _alignment_matrix(runs: Sequence[Mapping[str, Any]], key: str):
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


def plot_alignment(summary: Mapping[str, Any], path: Path) -> Path:
    plt = _pyplot()
    methods = [m for m in _order(summary) if all(r.get("alignment") for r in summary["runs"][m])]
    with plt.rc_context(STYLE):
        fig, (cos_ax, drift_ax) = plt.subplots(1, 2, figsize=(12, 4.6), dpi=130)
        for method in methods:
            runs = summary["runs"][method]
            for ax, key in ((cos_ax, "cosine"), (drift_ax, "drift")):
                steps, values = _alignment_matrix(runs, key)
                if not len(steps):
                    continue
                ax.plot(
                    steps,
                    values.mean(0),
                    "-",
                    marker="o",
                    ms=3,
                    color=color(method),
                    lw=2,
                    label=_name(summary, method),
                )
                if values.shape[0] > 1:
                    ax.fill_between(
                        steps, values.min(0), values.max(0), color=color(method), alpha=0.15, lw=0
                    )
        for level in (0.95, 0.7):
            cos_ax.axhline(
                level,
                color="0.5",
                lw=0.9,
                ls=":",
                label="paper: MT-DAO > 0.95, Local ADOPT ~0.7" if level == 0.95 else None,
            )
        cos_ax.set_title("Worker / global pseudo-gradient cosine")
        cos_ax.set_xlabel("step (parameter syncs)")
        cos_ax.set_ylabel("cosine, mean over workers")
        cos_ax.set_ylim(top=1.02)
        drift_ax.set_title("Worker drift from the average before each sync")
        drift_ax.set_xlabel("step (parameter syncs)")
        drift_ax.set_ylabel("L2 distance, mean over workers")
        if methods:
            cos_ax.legend(loc="best")
        else:
            cos_ax.text(
                0.5, 0.5, "no parameter syncs logged", ha="center", transform=cos_ax.transAxes
            )
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
    return Path(path)


def plot_traffic(summary: Mapping[str, Any], path: Path) -> Path:
    from mtdao.experiments.report import format_bytes

    plt = _pyplot()
    methods = _order(summary)[::-1]  # first method on top
    summaries = summary["methods"]
    with plt.rc_context({**STYLE, "axes.grid": False, "axes.axisbelow": True}):
        fig, ax = plt.subplots(figsize=(8, 0.6 * len(methods) + 1.6), dpi=130)
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
        ax.xaxis.set_major_formatter(_eng("B"))
        ax.grid(axis="x", alpha=0.3, which="major")
        for y, method in enumerate(methods):
            info = summaries[method]
            ratio = info["traffic_vs_ddp"]
            text = format_bytes(info["bytes_per_worker"])
            if method != "ddp":
                text += (
                    "  (nothing sent)"
                    if math.isinf(ratio)
                    else f"  ({ratio:.1f}x less than DDP)"
                    if ratio >= 1
                    else f"  ({1 / ratio:.1f}x more than DDP)"
                )
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
        fig.savefig(path)
        plt.close(fig)
    return Path(path)


def write_compare_plots(out_dir: Path, summary: Mapping[str, Any]) -> list[Path]:
    out_dir = Path(out_dir)
    return [
        plot_loss_vs_tokens(summary, out_dir / "loss_vs_tokens.png"),
        plot_loss_vs_time(summary, out_dir / "loss_vs_time.png"),
        plot_alignment(summary, out_dir / "alignment.png"),
        plot_traffic(summary, out_dir / "traffic.png"),
    ]


# -- ablation -------------------------------------------------------------------------------------


def plot_degradation_vs_k(
    curves: Mapping[str, Mapping[str, Any]], path: Path, title: str, subtitle: str = ""
) -> Path:
    """One line per variant: ``curves[variant] = {"periods", "degradation", "std", "color", "linestyle"}``."""
    plt = _pyplot()
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(10, 4.8), dpi=130)
        periods_seen: set[int] = set()
        for variant, curve in curves.items():
            periods = np.array(curve["periods"], dtype=float)
            values = np.array(curve["degradation"], dtype=float)
            periods_seen.update(curve["periods"])
            ax.plot(
                periods,
                values,
                marker="o",
                lw=2,
                color=curve.get("color"),
                ls=curve.get("linestyle", "-"),
                label=variant,
            )
            std = np.array(curve.get("std") or [0.0] * len(values), dtype=float)
            if std.any():
                ax.fill_between(
                    periods, values - std, values + std, color=curve.get("color"), alpha=0.12, lw=0
                )
        ax.axhline(0.0, color=color("ddp"), lw=1, ls="--")
        ax.annotate("DDP", (0.01, 0.0), xycoords=("axes fraction", "data"), fontsize=8, va="bottom")
        ax.set_xscale("log", base=2)
        ticks = sorted(periods_seen)
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
        fig.savefig(path)
        plt.close(fig)
    return Path(path)
