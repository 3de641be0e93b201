"""benchmarks/gpu_campaign.py: its dry run goes through every part on the CPU to a report that has
each part's figures; a part past its time budget is stopped and reported, and the report of a
campaign stopped midway still renders."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCHMARKS / "gpu_campaign.py"
PARTS = [
    "environment",
    "exactness",
    "optimizer_step",
    "train",
    "vmapped_workers",
    "sharded",
    "torchrun",
    "paper_16m",
]
METHODS = {"ddp", "qh-ddp", "local-adam", "diloco", "desloc", "mtdao"}


def campaign(*flags: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=timeout
    )


def report_module():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import gpu_campaign_report
    finally:
        sys.path.remove(str(BENCHMARKS))
    return gpu_campaign_report


@pytest.mark.slow
@pytest.mark.soak  # every part of the campaign, ~100 s
def test_dry_run_reports_every_part(tmp_path, corpus_dir):
    out = tmp_path / "campaign"
    done = campaign("--dry-run", "--out", str(out), "--data", str(corpus_dir), timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "torch 2." in done.stdout and "CUDA None" in done.stdout  # the versions come first
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "results.json"]

    results = json.loads((out / "results.json").read_text())
    assert (results["kind"], results["schema"], results["dry_run"]) == ("gpu-campaign", 1, True)
    assert results["finished"] and list(results["parts"]) == PARTS
    assert {name: part["status"] for name, part in results["parts"].items()} == dict.fromkeys(
        PARTS, "ok"
    )
    data = {name: part["data"] for name, part in results["parts"].items()}

    exactness = data["exactness"]["rows"]
    assert len(exactness) == 15 and all(
        row["passed"] and row["layout"] == "flat" for row in exactness
    )
    for size in data["optimizer_step"]["sizes"]:
        rows = {row["label"]: row for row in data["optimizer_step"]["rows"] if row["size"] == size}
        for label in ("AdamW(fused=True)", "AdamW(foreach=True)", "MTAdam N=1", "MTAdam N=2"):
            assert rows[label]["median_ms"] > 0, label
        assert {
            f"{name} N={n}" for name in ("MTAdam", "MTAdopt", "MTSGD") for n in (1, 2, 3)
        } <= set(rows)
        assert rows["MTAdam N=1 flat foreach"]["layout"] == "flat"
        assert rows["MTAdam N=1"]["layout"] == "per-tensor"  # the CPU's default
    runs = data["train"]["runs"]
    assert {run["run"] for run in runs} == METHODS and all(run["passed"] for run in runs)
    assert all(row["passed"] for row in data["vmapped_workers"]["rows"])
    assert data["sharded"]["fsdp"]["passed"]
    assert data["torchrun"]["train"]["passed"] and data["torchrun"]["group"]["passed"]
    assert data["torchrun"]["group"]["backend"] == "gloo"
    paper = data["paper_16m"]
    assert paper["calibration"]["step_s"] > 0 and paper["planned"]["steps"] >= 2
    assert {run["method"] for run in paper["runs"].values()} == {"ddp", "local-adam", "mtdao"}
    assert all(math.isfinite(run["final_val_loss"]) for run in paper["runs"].values())

    report = (out / "report.md").read_text()
    for title in report_module().TITLES.values():
        assert f"## {title}" in report
    assert "| MTAdam N=2 | per-tensor | C++ |" in report and "15 of 15 cases pass" in report


def test_a_part_past_its_budget_is_stopped_and_reported(tmp_path):
    # a 6 s campaign, 5 s of it kept for the last report: the environment part gets 0.3 s, less
    # than its interpreter takes to import torch; the paper's runs get less than their minimum
    out = tmp_path / "campaign"
    done = campaign("--dry-run", "--budget-s", "6", "--out", str(out), "--parts",
                    "environment", "paper_16m", timeout=120)  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    results = json.loads((out / "results.json").read_text())
    parts = results["parts"]
    assert parts["environment"]["status"] == "timed out"
    assert parts["exactness"]["note"] == "not asked for (--parts)"
    assert parts["paper_16m"]["status"] == "skipped" and "out of time" in parts["paper_16m"]["note"]
    report = (out / "report.md").read_text()
    assert "| environment | timed out |" in report and "**timed out**" in report


def test_the_report_of_a_campaign_stopped_midway_renders():
    results = {
        "dry_run": False,
        "started_utc": "2026-12-05T00:00:00+00:00",
        "elapsed_s": 200.0,
        "budget_s": 540.0,
        "finished": False,
        "command": "python benchmarks/gpu_campaign.py --out /tmp/out",
        "parts": {
            "environment": {"status": "ok", "data": {"environment": {"torch": "2.11.0", "gpu": "H200"}}},
            "optimizer_step": {
                "status": "running",
                "data": {
                    "sizes": ["25M in 100 tensors"],
                    "rows": [
                        {"size": "25M in 100 tensors", "label": "AdamW(fused=True)", "layout": "torch",
                         "kernel": "fused", "median_ms": 0.5, "fastest_ms": 0.49, "ideal_bytes": 7e8},
                        {"size": "25M in 100 tensors", "label": "MTAdam N=1", "layout": "flat",
                         "kernel": "compiled", "median_ms": 0.45, "fastest_ms": 0.44,
                         "ideal_bytes": 7e8, "gather_ms": 0.06},
                        {"size": "25M in 100 tensors", "label": "MTAdam N=1 per-tensor foreach",
                         "layout": "per-tensor", "kernel": "foreach", "median_ms": 1.3},
                    ],
                },
            },
            "train": {"status": "timed out", "data": {"runs": [{"exit_code": -9}]}},
            "paper_16m": {"status": "pending"},
        },
    }  # fmt: skip
    report = report_module().render_report(results)
    assert "still running, or stopped before its end" in report
    assert "| MTAdam N=1 | flat | compiled | 0.45 | 0.44 | 0.9x | 1.56e+03 | 32% |" in report
    assert "MTAdam N=1 (flat, compiled): 0.90x fused AdamW, target <= 1.05x: met." in report
    assert "| MTAdam N=1 per-tensor foreach | per-tensor | foreach | 1.3 | - | 2.6x | - |" in report
    # a run without its name: that section says so, the others render
    assert "(incomplete record: KeyError: 'run')" in report
    assert "| paper_16m | pending |" in report
