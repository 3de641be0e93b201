"""The Rosenbrock toy's report.md and its pictures (global trajectories on the contour plot, loss
against step), rendered from the content of results.json alone, so a committed report re-renders
from it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mtdao.experiments.common.figures import saved_figure
from mtdao.experiments.common.formatting import plus_minus, table
from mtdao.experiments.rosenbrock.problem import CONVERGED_DISTANCE, METHODS, OPTIMUM, rosenbrock

STYLE = {  # method -> (colour, label)
    "local-adam": ("tab:red", "Local Adam"),
    "mtdao": ("tab:blue", "MT-DAO"),
    "ddp": ("0.2", "DDP (Adam, β=0.9, reference)"),
}


def _label(result: dict[str, Any]) -> str:
    colour, name = STYLE[result["method"]]
    if result["method"] == "local-adam":
        return f"{name} (β={result['beta']:g})"
    if result["method"] == "mtdao":
        return f"{name} (β={result['beta']:g}, ω={result['omega']:g})"
    return name


def _by_method(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    grouped = {m: [r for r in results if r["method"] == m] for m in METHODS}
    return {m: runs for m, runs in grouped.items() if runs}


def _seeds_note(runs: list[dict[str, Any]]) -> str:
    return f"{len(runs)} seeds" if len(runs) > 1 else f"seed {runs[0]['seed']}"


def plot_trajectories(results: list[dict[str, Any]], path: Path, settings: str) -> Path:
    """The global point of every run on log-scaled contours of f; start and optimum marked."""
    points = np.array([p[1:] for r in results for p in r["trajectory"]], dtype=float)
    points = points[np.isfinite(points).all(axis=1)]
    points = np.vstack([points, [OPTIMUM]])
    low, high = points.min(axis=0), points.max(axis=0)
    margin = np.maximum(0.12 * (high - low), 0.25)
    low, high = np.maximum(low - margin, -10.0), np.minimum(high + margin, 10.0)
    x1, x2 = np.meshgrid(np.linspace(low[0], high[0], 400), np.linspace(low[1], high[1], 400))
    f = rosenbrock(np.stack([x1, x2], axis=-1))

    with saved_figure(path, figsize=(7.0, 5.6), dpi=120, style=None) as (fig, ax):
        filled = ax.contourf(x1, x2, np.log10(f + 1e-3), levels=30, cmap="Greys_r", alpha=0.45)
        ax.contour(x1, x2, np.log10(f + 1e-3), levels=15, colors="white", linewidths=0.4, alpha=0.6)
        fig.colorbar(filled, ax=ax, label="log10 f(x1, x2)")
        for method, runs in _by_method(results).items():
            colour = STYLE[method][0]
            for i, run in enumerate(runs):
                path_xy = np.array([p[1:] for p in run["trajectory"]], dtype=float)
                label = f"{_label(run)}, {_seeds_note(runs)}" if i == 0 else None
                # the reference is drawn thin, dashed and underneath: it follows MT-DAO's path closely
                reference = method == "ddp"
                ax.plot(
                    *path_xy.T,
                    color=colour,
                    lw=1.0 if reference else 1.8,
                    alpha=0.9,
                    label=label,
                    dashes=(4, 2) if reference else (),
                    zorder=2 if reference else 3,
                )
                ax.plot(*path_xy[-1], "o", color=colour, ms=4)
        start = results[0]["start"]
        ax.plot(
            *start, "s", color="tab:green", ms=9, mec="k", label=f"start {tuple(start)}", zorder=5
        )
        ax.plot(*OPTIMUM, "*", color="gold", ms=16, mec="k", label="optimum (1, 1)", zorder=5)
        ax.set_xlim(low[0], high[0])
        ax.set_ylim(low[1], high[1])
        ax.set_xlabel("x1")
        ax.set_ylabel("x2")
        ax.set_title(f"Global (worker-averaged) point on noisy Rosenbrock\n{settings}", fontsize=10)
        ax.legend(loc="upper right", fontsize=8, framealpha=0.9)
        fig.tight_layout()
    return path


def plot_loss_curves(results: list[dict[str, Any]], path: Path, settings: str) -> Path:
    """f(global point) against step, log scale: median over seeds with a min-max band."""
    with saved_figure(path, figsize=(7.0, 4.4), dpi=120, style=None) as (fig, ax):
        for method, runs in _by_method(results).items():
            colour = STYLE[method][0]
            length = min(len(r["loss_curve"]) for r in runs)
            steps = np.array([p[0] for p in runs[0]["loss_curve"][:length]])
            losses = np.array([[p[1] for p in r["loss_curve"][:length]] for r in runs], dtype=float)
            losses = np.where(np.isfinite(losses), losses, np.nan)
            label = f"{_label(runs[0])}, {_seeds_note(runs)}"
            if len(runs) > 1:
                label += " (median, band min-max)"
                ax.fill_between(
                    steps,
                    np.nanmin(losses, 0),
                    np.nanmax(losses, 0),
                    color=colour,
                    alpha=0.25,
                    lw=0,
                )
            dashes = (4, 2) if method == "ddp" else ()
            ax.plot(
                steps, np.nanmedian(losses, 0), color=colour, lw=1.8, label=label, dashes=dashes
            )
            final = np.nanmedian(losses[:, -1])
            if math.isfinite(final):
                ax.annotate(
                    f"{final:.3g}",
                    (steps[-1], final),
                    xytext=(4, 0),
                    textcoords="offset points",
                    va="center",
                    fontsize=8,
                    color=colour,
                )
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("f(global point)")
        ax.set_title(f"Noisy Rosenbrock: loss of the global point\n{settings}", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        fig.tight_layout()
    return path


def title_settings(config: Mapping[str, Any]) -> str:
    """The settings line under each plot's title."""
    return (
        f"M={config['workers']} workers, noise σ={config['noise']:g}, K={config['sync_period']}, "
        f"lr={config['lr']:g}, β2={config['beta2']:g}, {config['steps']} steps"
    )


def write_plots(results: list[dict[str, Any]], out_dir: Path, config: Mapping[str, Any]) -> None:
    plot_trajectories(results, Path(out_dir) / "trajectories.png", title_settings(config))
    plot_loss_curves(results, Path(out_dir) / "loss_curves.png", title_settings(config))


# -- report.md ------------------------------------------------------------------------------------


def _value(value: float | None) -> float:
    """A final value; None (how JSON stores a diverged run's inf) is inf again."""
    return math.inf if value is None else value


def _mean_std(stats: Mapping[str, Any], key: str) -> str:
    return plus_minus(_value(stats[f"{key}_mean"]), stats[f"{key}_std"], ".3g", ".2g")


def outcome(method: str, stats: Mapping[str, Any]) -> str:
    """One honest sentence about ``method`` over its seeds."""
    n = len(stats["seeds"])
    where = (
        f"final f = {_mean_std(stats, 'final_loss')}, "
        f"distance to (1, 1) = {_value(stats['final_distance_mean']):.3g}"
    )
    if stats["converged"] == n:
        verdict = f"converged on all {n} seeds"
    elif stats["diverged"] == n:
        verdict = f"diverged on all {n} seeds"
    elif stats["converged"] == 0 and stats["diverged"] == 0:
        verdict = f"did not converge on any of {n} seeds, nor diverge (it ends far from (1, 1))"
    else:
        verdict = f"converged on {stats['converged']}, diverged on {stats['diverged']} of {n} seeds"
    return f"**{method}** {verdict}: {where}."


def _table_row(method: str, s: Mapping[str, Any]) -> list[str]:
    n = len(s["seeds"])
    return [
        method,
        str(s["beta"]),
        str(s["omega"]),
        _mean_std(s, "final_loss"),
        _mean_std(s, "final_distance"),
        ", ".join(f"{_value(loss):.3g}" for loss in s["final_loss"]),
        f"{s['diverged']}/{n}",
        f"{s['converged']}/{n}",
    ]


def render(results: Mapping[str, Any]) -> str:
    """report.md from results.json: the shared config (every field but method and seed) and the
    summary."""
    config, summary = results["config"], results["summary"]
    seeds = " ".join(str(s) for s in next(iter(summary.values()))["seeds"])
    header = ["method", "beta", "omega", "final f (mean ± std)", "final distance"]
    header += ["per-seed final f", "diverged", "converged"]
    return "\n".join(
        [
            "# Rosenbrock toy: Local Adam vs MT-DAO",
            "",
            f"M = {config['workers']} workers, gradient noise sigma = {config['noise']}, "
            f"slow momentum beta = {config['beta']}, MT-DAO omega = {config['omega']}, "
            f"beta2 = {config['beta2']}, lr = {config['lr']}, K = {config['sync_period']}, "
            f"{config['steps']} steps from {tuple(config['start'])}, seeds {seeds}. "
            "Evaluated: the global (worker-averaged) point. Diverged: non-finite or final f above "
            f"f(start); converged: final point within {CONVERGED_DISTANCE} of (1, 1).",
            "",
            *table(header, (_table_row(m, s) for m, s in summary.items())),
            "",
            " ".join(outcome(m, s) for m, s in summary.items()),
            "",
            "![trajectories](trajectories.png)",
            "",
            "![loss curves](loss_curves.png)",
            "",
        ]
    )
