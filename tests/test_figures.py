"""The experiment figures read true: no offset ticks or truncated bars for small differences,
enough labels on a narrow log axis, whole steps on a step axis, legends off the data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtdao.experiments.common import figures
from mtdao.experiments.common.figures import log_tick_values
from mtdao.experiments.compare import plots as compare_plots

# the summary of a comparison run under earlier defaults (the results.json of its report then, cut
# to what its figures read): data with the ranges these tests are about
DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture
def drawn(monkeypatch):
    """The figures a plot function saves, drawn and kept open for inspection."""
    kept = []

    def keep(fig, path, dpi=None):
        fig.canvas.draw()
        kept.append(fig)

    monkeypatch.setattr(figures, "save", keep)
    yield kept
    for fig in kept:
        figures.pyplot().close(fig)


def test_narrow_log_axes_get_several_plain_labels():
    assert log_tick_values(1.35, 3.0) == [1.4, 1.6, 1.8, 2.0, 2.5, 3.0]
    assert log_tick_values(1.0, 10.0) == [1.0, 1.5, 2.0, 3.0, 5.0, 7.0, 10.0]
    assert log_tick_values(0.5, 500.0) == [
        0.5,
        1.0,
        2.0,
        5.0,
        10.0,
        20.0,
        50.0,
        100.0,
        200.0,
        500.0,
    ]
    assert log_tick_values(2.93, 3.25) == [3.0, 3.1, 3.2]  # a 40-step smoke run's range
    assert log_tick_values(2.0, 2.0) == []


def one_sync_summary() -> dict:
    summary = json.loads((DATA / "compare-summary.json").read_text())
    for runs in summary["runs"].values():
        for run in runs:
            run["alignment"] = (run.get("alignment") or [])[:1]
    return summary


def test_alignment_with_one_sync_ticks_whole_steps_and_keeps_the_legend_off_the_data(
    tmp_path, drawn
):
    compare_plots.plot_alignment(one_sync_summary(), tmp_path / "alignment.png")
    (fig,) = drawn
    cosine, drift = fig.axes[:2]
    for ax in (cosine, drift):
        assert [tick for tick in ax.get_xticks()] == [32]
        assert ax.get_legend() is None
    assert fig.legends  # one legend for the figure, below the panels
    legend_top = fig.legends[0].get_window_extent().y1
    assert legend_top <= min(ax.get_window_extent().y0 for ax in (cosine, drift))


def test_loss_vs_tokens_labels_its_log_axis(tmp_path, drawn):
    summary = json.loads((DATA / "compare-summary.json").read_text())
    compare_plots.plot_loss_vs_tokens(summary, tmp_path / "loss_vs_tokens.png")
    (fig,) = drawn
    full = fig.axes[0]
    low, high = full.get_ylim()
    labels = [t.get_text() for t in full.get_yticklabels() if t.get_text()]
    shown = [t for t in full.get_yticks() if low <= t <= high]
    assert len(labels) >= 4 and len(set(labels)) == len(labels) == len(shown), labels
