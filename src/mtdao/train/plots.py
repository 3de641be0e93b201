"""A picture of one run (``loss.png``): loss against tokens with the sync rounds marked, and the
bytes each worker has sent, optionally beside a reference run, drawn from the run directory alone
(``metrics.jsonl``, and ``results.json`` once the run has finished)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtdao.train.metrics import read_metrics
from mtdao.units import format_bytes

# More rounds than this are not drawn one by one (DDP's every-step all-reduce would fill the plot).
MAX_MARKED_ROUNDS = 200
ROUND_COLOR = "tab:green"


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@dataclass
class RunCurves:
    """What ``loss.png`` draws of one run; every x value is in training tokens (all workers)."""

    name: str
    train: list[tuple[float, float]] = field(default_factory=list)
    val: list[tuple[float, float]] = field(default_factory=list)
    sent: list[tuple[float, float]] = field(default_factory=list)
    """Cumulative bytes sent per worker."""
    rounds: list[float] = field(default_factory=list)
    """Where a sync round (any averaging at all) ended."""
    every_step: bool = False
    """It communicated at every step (gradient averaging): no rounds to mark."""
    settings: str = ""
    """Method, workers and sync period, from the run's config.json ('' when it has none)."""

    @property
    def title(self) -> str:
        return f"{self.name}: {self.settings}" if self.settings else self.name


def _step_and_bytes(event: Sequence[Any] | Mapping[str, Any]) -> tuple[int, float]:
    """A logged communication event, ``[step, bytes]`` or ``{"step": ..., "bytes": ...}``."""
    if isinstance(event, Mapping):
        return int(event["step"]), float(event["bytes"])
    return int(event[0]), float(event[1])


def _tokens_per_step(records: list[dict[str, Any]], results: Mapping[str, Any]) -> float:
    if results.get("steps"):
        return results["tokens"] / results["steps"]
    return next((r["tokens"] / r["step"] for r in records if r.get("step") and "tokens" in r), 0.0)


def run_curves(run_dir: Path) -> RunCurves:
    """Read one run directory's curves; FileNotFoundError if it holds no ``metrics.jsonl``."""
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{run_dir} holds no metrics.jsonl: not a training run directory")
    records = read_metrics(run_dir)
    results_path = run_dir / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    config_path = run_dir / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    curves = RunCurves(
        name=run_dir.name,
        settings=describe_settings(config),
        train=[(r["tokens"], r["train_loss"]) for r in records if "train_loss" in r],
        val=[(r["tokens"], r["val_loss"]) for r in records if "val_loss" in r],
    )
    if "comm_events" not in results:  # unfinished: the bytes at each log line, no rounds
        curves.sent = [
            (r["tokens"], r["bytes_per_worker"]) for r in records if "bytes_per_worker" in r
        ]
        return curves
    per_step = _tokens_per_step(records, results)
    events = sorted(_step_and_bytes(e) for e in results["comm_events"])
    total, curves.sent = 0.0, [(0.0, 0.0)]
    for step, num_bytes in events:
        total += num_bytes
        curves.sent.append((step * per_step, total))
    if results.get("steps") and curves.sent[-1][0] < results["steps"] * per_step:
        curves.sent.append((results["steps"] * per_step, total))
    steps = {step for step, _ in events}
    curves.every_step = bool(steps) and steps >= set(range(1, max(steps) + 1))
    curves.rounds = [] if curves.every_step else [step * per_step for step in sorted(steps)]
    return curves


def describe_settings(config: Mapping[str, Any]) -> str:
    """'mtdao (adam), 4 workers, K = 32' from a run's config ('' without a method)."""
    from mtdao.methods.table import METHOD_TABLE

    method = config.get("method")
    if method not in METHOD_TABLE:
        return ""
    text = f"{method} ({config.get('optimizer', 'adam')}), {config.get('workers')} workers"
    if (config.get("shards") or 1) > 1:
        text += f" x {config['shards']} shards"
    if not METHOD_TABLE[method].averages_gradients:
        text += f", K = {config.get('sync_period')}"
    return text


def _mark_rounds(axes, curves: RunCurves) -> None:
    if curves.every_step or not curves.rounds:
        return
    if len(curves.rounds) > MAX_MARKED_ROUNDS:
        axes[0].plot([], [], color=ROUND_COLOR, lw=0.8, label=f"{len(curves.rounds)} sync rounds")
        return
    for ax in axes:
        for index, tokens in enumerate(curves.rounds):
            label = f"sync rounds ({len(curves.rounds)})" if ax is axes[0] and index == 0 else None
            ax.axvline(tokens, color=ROUND_COLOR, lw=0.8, alpha=0.35, zorder=0, label=label)


def _draw(loss_ax, sent_ax, curves: RunCurves, reference: bool) -> None:
    if reference:
        style = {"color": "0.45", "ls": "--", "lw": 1.5}
        name = f"{curves.name}, reference"
        if curves.val:
            loss_ax.plot(*zip(*curves.val), label=f"{name}: validation", **style)
    else:
        style, name = {"color": "C0", "lw": 2}, curves.name
        if curves.train:
            loss_ax.plot(*zip(*curves.train), color="0.6", lw=1, label="train (mean over workers)")
        if curves.val:
            loss_ax.plot(*zip(*curves.val), "o-", label="validation (global model)", **style)
    if curves.sent:
        every = " (averages every step)" if curves.every_step else ""
        sent_ax.plot(*zip(*curves.sent), drawstyle="steps-post", label=name + every, **style)
        _label_total(sent_ax, curves.sent[-1], style["color"])


def _label_total(ax, last: tuple[float, float], color: str) -> None:
    ax.annotate(
        format_bytes(last[1]),
        last,
        xytext=(0, 4),
        textcoords="offset points",
        ha="right",
        va="bottom",
        color=color,
    )


def figure(curves: RunCurves, reference: RunCurves | None = None):
    """The figure of ``loss.png``: loss on top, cumulative bytes sent below, tokens across."""
    from matplotlib.ticker import EngFormatter, FuncFormatter

    plt = pyplot()
    fig, (loss_ax, sent_ax) = plt.subplots(
        2, 1, figsize=(7.0, 6.0), dpi=120, sharex=True, height_ratios=(3, 2)
    )
    if reference is not None:
        _draw(loss_ax, sent_ax, reference, reference=True)
    _draw(loss_ax, sent_ax, curves, reference=False)
    _mark_rounds((loss_ax, sent_ax), curves)
    loss_ax.set_ylabel("loss (nats/token)")
    title = curves.title + (f"\nvs {reference.title}" if reference else "")
    loss_ax.set_title(title, fontsize=10)
    sent_ax.set_ylabel("bytes sent per worker")
    sent_ax.set_xlabel("tokens")
    sent_ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: format_bytes(value)))
    sent_ax.xaxis.set_major_formatter(EngFormatter())
    for ax in (loss_ax, sent_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_run(run_dir: Path, reference: Path | None = None) -> Path:
    """Write ``<run_dir>/loss.png``; ``reference`` is another run directory drawn beside it."""
    curves = run_curves(run_dir)
    other = run_curves(reference) if reference is not None else None
    fig = figure(curves, other)
    path = Path(run_dir) / "loss.png"
    fig.savefig(path)
    pyplot().close(fig)
    return path
