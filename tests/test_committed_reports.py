"""reports/ holds the reports the results page (BENCHMARKS.md) links, and only those; every one
with a results.json re-renders from it to the same report.md: the published numbers are the ones
the report code computes from the runs. A results.json names the study that wrote it (``kind``)
and the version of its layout (``schema``): that, not its shape, chooses the renderer.

A report whose wording changes on purpose is re-rendered and committed with the change.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from mtdao.experiments.common.formatting import stats
from mtdao.experiments.compare import report as compare
from mtdao.experiments.compare import summary as compare_summary
from mtdao.experiments.defaults_card import report as defaults_card
from mtdao.experiments.defaults_card import summary as defaults_card_summary
from mtdao.experiments.frontier import report as frontier
from mtdao.experiments.frontier import summary as frontier_summary
from mtdao.experiments.rosenbrock import report as rosenbrock
from mtdao.experiments.rosenbrock import summary as rosenbrock_summary
from mtdao.experiments.slow_link import report as slow_link
from mtdao.experiments.slow_link import summary as slow_link_summary
from mtdao.experiments.wan_drill import report as wan_drill

ROOT = Path(__file__).resolve().parent.parent
REPORTS = ROOT / "reports"
PAGE = ROOT / "BENCHMARKS.md"


def benchmark_script(name: str):
    """A study that is a script under benchmarks/, imported as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


workers_study = benchmark_script("defaults_by_workers")


# (kind, schema) -> the study's render: report.md from results.json's content
RENDERERS = {
    (compare_summary.KIND, compare_summary.SCHEMA): compare.render,
    (rosenbrock_summary.KIND, rosenbrock_summary.SCHEMA): rosenbrock.render,
    (slow_link_summary.KIND, slow_link_summary.SCHEMA): slow_link.render,
    (wan_drill.KIND, wan_drill.SCHEMA): wan_drill.render,
    (frontier_summary.KIND, frontier_summary.SCHEMA): frontier.render,
    (defaults_card_summary.KIND, defaults_card_summary.SCHEMA): defaults_card.render,
    (workers_study.KIND, workers_study.SCHEMA): workers_study.render,
}


def linked_reports() -> set[str]:
    """The report directories the results page links to."""
    return set(re.findall(r"\]\(reports/([^/)]+)/", PAGE.read_text()))


def report_dirs() -> list[Path]:
    return sorted(path.parent for path in REPORTS.glob("*/results.json"))


def test_reports_holds_what_the_results_page_links_and_nothing_else():
    committed = {path.name for path in REPORTS.iterdir() if path.is_dir()}
    assert committed == linked_reports()
    for name in committed:
        assert (REPORTS / name / "report.md").is_file(), name


def test_every_results_json_names_its_kind_and_schema():
    kinds = set()
    for report_dir in report_dirs():
        results = json.loads((report_dir / "results.json").read_text())
        assert isinstance(results, dict), report_dir.name
        assert (results.get("kind"), results.get("schema")) in RENDERERS, report_dir.name
        kinds.add(results["kind"])
    expected = {
        "defaults-card",
        "frontier",
        "slow-link",
        "wan-drill",
        "rosenbrock",
        "workers-scaling",
    }
    assert kinds == expected  # every study the results page quotes, with its report


@pytest.mark.parametrize("report_dir", report_dirs(), ids=lambda d: d.name)
def test_committed_report_re_renders_from_its_results(report_dir):
    results = json.loads((report_dir / "results.json").read_text())
    rendered = RENDERERS[results["kind"], results["schema"]](results)
    assert rendered == (report_dir / "report.md").read_text()


def gap_range(pairs: list[tuple[dict, dict]], digits: int) -> str:
    """The lowest and highest relative gap (percent) of each (mine, DDP) pair of stats: '2.7-6.5%'."""
    gaps = [(mine["mean"] - ddp["mean"]) / ddp["mean"] * 100 for mine, ddp in pairs]
    return f"{min(gaps):.{digits}f}-{max(gaps):.{digits}f}%"


def default_gap_range(results: dict, workers: list[int]) -> str:
    """The gap range of MT-DAO's default option to DDP across the report's corpora at
    ``workers``, each over the seeds its row finished (as the report's options table has it)."""
    pairs = []
    for row in results["options"]:
        if row["workers"] not in workers:
            continue
        if row["option"] != workers_study.default_option(row["workers"]):
            continue
        where = (row["corpus"], row["workers"])
        cell = next(c for c in results["cells"] if (c["corpus"], c["workers"]) == where)
        seeds = [int(s) for s in row["by_seed"]]
        pairs.append((stats(row["by_seed"].values()), workers_study.over_seeds(cell, "ddp", seeds)))
    return gap_range(pairs, digits=1)


def k32_gap_range(results: dict, workers: int) -> str:
    """The gap range of MT-DAO at K = 32 to DDP across the corpora, in whole percent: '12-24%'."""
    cells = [c for c in results["cells"] if c["workers"] == workers]
    return gap_range([workers_study.paired(c, "mtdao", "ddp") for c in cells], digits=0)


def test_the_many_workers_warning_quotes_the_workers_reports():
    """The warning `mtdao train --workers 16` prints quotes each gap by hand: it must follow the
    committed reports when their seeds change."""
    from mtdao.train.config import TrainConfig, config_warnings, resolve

    config = TrainConfig.of(method="mtdao", model="micro", steps=3000, workers=16, batch_size=4)
    (warning,) = [w for w in config_warnings(resolve(config)) if w.startswith("--workers")]
    study = json.loads((REPORTS / "workers-scaling" / "results.json").read_text())
    batch_128 = json.loads((REPORTS / "workers-global-batch-128" / "results.json").read_text())
    quoted = [
        f"by {default_gap_range(study, [16])} at 16 workers",
        f"{default_gap_range(study, [32])} at 32",
        f"{default_gap_range(study, [64])} at 64 at a global batch of 64",
        f"{default_gap_range(batch_128, [32, 64, 128])} at 32 to 128 workers at 128",
        f"by {k32_gap_range(study, 16)} at 16 and {k32_gap_range(study, 64)} at 64",
    ]
    for figure in quoted:
        assert figure in warning, (figure, warning)
