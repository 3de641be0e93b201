"""Every committed report under reports/ re-renders from its committed results.json to the same
report.md: the published numbers are the ones the report code computes from the runs.

A report whose wording changes on purpose is re-rendered and committed with the change.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mtdao.experiments.ablation.report import render_ablation_report
from mtdao.experiments.ablation.summary import load_summary
from mtdao.experiments.compare.report import render_compare_report
from mtdao.experiments.defaults_card.report import card_report_lines
from mtdao.experiments.frontier.report import render_results as render_frontier
from mtdao.experiments.horizon.report import render_horizon_report
from mtdao.experiments.rosenbrock.report import report_markdown
from mtdao.experiments.slow_link.report import render_report
from mtdao.experiments.sync_options.report import render_report as render_sync_options
from mtdao.experiments.wan_drill.checks import Check
from mtdao.experiments.wan_drill.report import render_report as render_wan_drill

REPORTS = Path(__file__).resolve().parent.parent / "reports"


def kind(results) -> str | None:
    """Which experiment wrote this results.json (by its shape)."""
    if isinstance(results, list):
        return "slow-link"
    if "experiments" in results and "protocol" in results:
        return "horizon"
    if results.get("kind") in ("sync-options", "wan-drill", "frontier", "defaults-card"):
        return results["kind"]
    if "variants" in results:
        return "ablation"
    if "target_val_loss" in results:
        return "compare"
    if "summary" in results and "config" in results:
        return "rosenbrock"
    return None


def render_slow_link(report_dir: Path, rows: list) -> str:
    # results.json holds the rows only; the command and machine come from the committed header
    committed = (report_dir / "report.md").read_text()
    command = re.search(r"^Command: `(.*)`$", committed, re.M).group(1)
    workers = int(re.search(r"(\d+) gloo worker processes", committed).group(1))
    torch, cores = re.search(r"torch (\S+), (\d+) CPU cores\.", committed).groups()
    return render_report(rows, command=command, workers=workers, torch=torch, cores=int(cores))


def rendered(report_dir: Path) -> str:
    results = json.loads((report_dir / "results.json").read_text())
    renderers = {
        "compare": lambda: render_compare_report(results),
        "horizon": lambda: render_horizon_report(results),
        "ablation": lambda: render_ablation_report(load_summary(report_dir / "results.json")),
        "rosenbrock": lambda: report_markdown(results["config"], results["summary"]),
        "slow-link": lambda: render_slow_link(report_dir, results),
        "sync-options": lambda: render_sync_options(results),
        "wan-drill": lambda: render_wan_drill(
            results["record"],
            [Check(**check) for check in results["checks"]],
            results["baselines"],
            results["ddp"],
            results["command"],
        ),
        "frontier": lambda: render_frontier(results),
        "defaults-card": lambda: "\n".join(card_report_lines(results)) + "\n",
    }
    return renderers[kind(results)]()


def known_reports() -> list[Path]:
    dirs = sorted(p.parent for p in REPORTS.glob("*/results.json"))
    return [d for d in dirs if kind(json.loads((d / "results.json").read_text())) is not None]


def test_every_experiment_has_a_committed_report():
    kinds = {kind(json.loads((d / "results.json").read_text())) for d in known_reports()}
    expected = {"compare", "ablation", "rosenbrock", "slow-link", "sync-options", "horizon"}
    assert kinds == expected | {"wan-drill", "frontier", "defaults-card"}


@pytest.mark.parametrize("report_dir", known_reports(), ids=lambda d: d.name)
def test_committed_report_re_renders_from_its_results(report_dir):
    assert rendered(report_dir) == (report_dir / "report.md").read_text()
