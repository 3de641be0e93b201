"""Pictures of the Rosenbrock toy: global trajectories on the contour plot, loss against step."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from mtdao.experiments.rosenbrock import METHODS, OPTIMUM

STYLE = {  # method -> (colour, label)
    "local-adam": ("tab:red", "Local Adam"),
    "mtdao": ("tab:blue", "MT-DAO"),
    "ddp": ("0.2", "DDP (Adam, β=0.9, reference)"),
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
    plt = _pyplot()
    points = np.array([p[1:] for r in results for p in r["trajectory"]], dtype=float)
    points = points[np.isfinite(points).all(axis=1)]
    points = np.vstack([points, [OPTIMUM]])
    low, high = points.min(axis=0), points.max(axis=0)
    margin = np.maximum(0.12 * (high - low), 0.25)
    low, high = np.maximum(low - margin, -10.0), np.minimum(high + margin, 10.0)
    x1, x2 = np.meshgrid(np.linspace(low[0], high[0], 400), np.linspace(low[1], high[1], 400))
    f = (1 - x1) ** 2 + 100 * (x2 - x1**2) ** 2

    fig, ax = plt.subplots(figsize=(7.0, 5.6), dpi=120)
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
    ax.plot(*start, "s", color="tab:green", ms=9, mec="k", label=f"start {tuple(start)}", zorder=5)
    ax.plot(*OPTIMUM, "*", color="gold", ms=16, mec="k", label="optimum (1, 1)", zorder=5)
    ax.set_xlim(low[0], high[0])
    ax.set_ylim(low[1], high[1])
    ax.set_xlabel("x1")
    ax.set_ylabel("x2")
    ax.set_title(f"Global (worker-averaged) point on noisy Rosenbrock\n{settings}", fontsize=10)
    ax.legend(loc="upper right", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_loss_curves(results: list[dict[str, Any]], path: Path, settings: str) -> Path:
    """f(global point) against step, log scale: median over seeds with a min-max band."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.0, 4.4), dpi=120)
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
                steps, np.nanmin(losses, 0), np.nanmax(losses, 0), color=colour, alpha=0.25, lw=0
            )
        dashes = (4, 2) if method == "ddp" else ()
        ax.plot(steps, np.nanmedian(losses, 0), color=colour, lw=1.8, label=label, dashes=dashes)
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
    fig.savefig(path)
    plt.close(fig)
    return path
