"""The experiments' summarize functions and shared formatting on small hand-written results:
every expected number below is worked out by hand from the inputs."""

from __future__ import annotations

import json
import math

import pytest

from mtdao.experiments.common import formatting
from mtdao.experiments.common.formatting import NOT_RUN, failures_section, stats
from mtdao.experiments.common.results import stamped, write_report
from mtdao.experiments.compare.summary import claim_checks
from mtdao.experiments.rosenbrock.report import render as render_rosenbrock
from mtdao.experiments.rosenbrock.run import to_json
from mtdao.experiments.rosenbrock.summary import summarize as summarize_rosenbrock
from mtdao.experiments.slow_link.summary import compare_to_ddp, time_to_loss, wall_at_step

# -- shared formatting ----------------------------------------------------------------------------


def test_mean_and_std_as_text():
    assert formatting.pm(None) == "—"
    assert formatting.pm(stats([0.7])) == "0.7000"
    assert formatting.pm(stats([0.70, 0.71, 0.72])) == "0.7100 ± 0.0100"
    assert formatting.pm(stats([990.0, 990.0]), 0) == "990 ± 0"
    assert formatting.pm(stats([1.0, math.inf])) == "diverged"
    assert formatting.plus_minus(0.00387, 0.00033, ".3g", ".2g") == "0.00387 ± 0.00033"


def test_a_gap_is_relative_with_its_verdict():
    # 1.72 vs 1.67: +3.0%; beyond the stds' sum 0.02 with three seeds each, with one a verdict waits
    mine, theirs = stats([1.71, 1.72, 1.73]), stats([1.66, 1.67, 1.68])
    assert formatting.gap(mine, theirs) == "+3.0% (worse)"
    assert formatting.gap(theirs, mine) == "-2.9% (better)"
    assert formatting.gap(stats([1.72]), theirs) == "+3.0% (one seed)"
    assert formatting.gap(stats([1.671, 1.672]), theirs) == "+0.1% (tie)"
    assert formatting.gap(None, theirs) == ""


def test_a_report_is_rendered_from_its_results_json_as_written(tmp_path):
    out, seen = tmp_path / "new" / "study", []
    results = stamped("toy", 1, {"final_loss_by_seed": {2: 1.5, 10: 1.25}})
    report = write_report(out, results, lambda read: seen.append(read) or "report\n")
    assert report == out / "report.md" and report.read_text() == "report\n"
    assert seen == [json.loads((out / "results.json").read_text())]
    assert seen[0]["kind"] == "toy"
    assert list(seen[0]["final_loss_by_seed"]) == ["2", "10"]  # as a re-render reads them


def test_traffic_ratio_as_text():
    assert formatting.format_traffic(100 / 30) == "3.3x less"
    assert formatting.format_traffic(0.5, "DDP") == "2.0x more than DDP"
    assert formatting.format_traffic(1.0) == "the same"
    assert formatting.format_traffic(1.0, "DDP") == "the same as DDP"
    assert formatting.format_traffic(math.inf) == "nothing sent"


def test_units():
    assert formatting.format_seconds(0.0123) == "12 ms"
    assert formatting.format_seconds(41.06) == "41.1 s"
    assert formatting.format_seconds(576.0) == "9.6 min"
    assert formatting.format_seconds(9000.0) == "2.5 h"
    assert formatting.format_seconds(None) == "—"
    assert formatting.format_bytes(41_300_000) == "41.3 MB"
    assert formatting.format_bytes(999) == "999 B"
    assert formatting.format_count(110_976) == "111k"
    assert formatting.format_count(None) == "?"
    assert formatting.format_relative(41.5, 46.6) == "-10.9%"
    assert formatting.format_relative(1.0, 0.0) == "n/a"


def test_markdown_table():
    assert formatting.table(["a", "b"], [["1", "2"]]) == ["| a | b |", "|---|---|", "| 1 | 2 |"]


def test_a_report_tells_runs_that_failed_from_runs_not_run_yet():
    text = "\n".join(failures_section({"a-seed0": "exit code 1", "b-seed1": NOT_RUN}))
    assert "## Failed runs" in text and "`a-seed0`: exit code 1" in text
    assert "## Not run yet" in text and "`b-seed1`" in text.split("## Not run yet")[1]
    assert "b-seed1" not in text.split("## Not run yet")[0]
    assert "Failed" not in "\n".join(failures_section({"b-seed1": NOT_RUN}))
    assert failures_section({}) == [] and failures_section(None) == []


# -- compare: the paper's claim -------------------------------------------------------------------


def test_claim_checks_apply_the_significance_rule():
    methods = {
        "ddp": {"final_val_loss": stats([0.70, 0.71, 0.72])},
        "local-adam": {"final_val_loss": stats([0.60, 0.61, 0.62])},
        "mtdao": {"final_val_loss": stats([0.705, 0.715, 0.725])},
    }
    ddp, local, diloco = claim_checks(methods)
    # 0.715 vs 0.71: a difference of 0.005 within the band 0.01 + 0.01: a tie matches DDP
    assert ddp["other"] == "ddp" and ddp["holds"] is True
    assert ddp["versus"]["outcome"] == "tie"
    assert ddp["versus"]["difference"] == pytest.approx(0.005)
    assert ddp["versus"]["relative_percent"] == pytest.approx(0.005 / 0.71 * 100)
    assert ddp["versus"]["noise"] == pytest.approx(0.02) and ddp["versus"]["noise_known"]
    # 0.715 vs 0.61 beyond 0.02: worse, so "beats Local Adam" fails
    assert local["versus"]["outcome"] == "worse" and local["holds"] is False
    assert diloco == {"other": "diloco", "versus": None, "holds": None}


# -- slow link ------------------------------------------------------------------------------------


def test_time_to_loss_interpolates_between_evaluations():
    evals = [
        {"wall_time_s": 10.0, "val_loss": 3.0},
        {"wall_time_s": 20.0, "val_loss": 2.0},
        {"wall_time_s": 30.0, "val_loss": 1.5},
    ]
    assert time_to_loss(evals, 2.5) == pytest.approx(15.0)
    assert time_to_loss(evals, 3.5) == pytest.approx(10.0)
    assert time_to_loss(evals, 1.0) is None
    assert wall_at_step([(10, 5.0), (20, 9.0)], 15) == pytest.approx(7.0)
    assert wall_at_step([(10, 5.0)], 11) is None


def _slow_row(method, rate, steps, wall, evals):
    return {
        "rate_mbit": rate,
        "method": method,
        "steps": steps,
        "final_val_loss": evals[-1][1],
        "wall_time_s": wall,
        "evals": [{"step": s, "val_loss": v, "wall_time_s": w} for s, v, w in evals],
        "progress": [[s, w] for s, _, w in evals],
    }


def test_slow_link_figures_against_ddp():
    ddp = _slow_row("ddp", 100, 100, 50.0, [(50, 2.5, 25.0), (100, 2.0, 50.0)])
    local = [(50, 2.4, 10.0), (100, 2.1, 20.0), (150, 1.9, 30.0), (200, 1.8, 40.0)]
    mtdao = _slow_row("mtdao", 100, 200, 40.0, local)
    alone = _slow_row("mtdao", 1000, 200, 40.0, local)
    rows = [ddp, mtdao, alone]
    ddp_after, mtdao_after, alone_after = compare_to_ddp(rows)
    # DDP's 2.0 is reached half-way between mtdao's 2.1 (20 s) and 1.9 (30 s): 25 s; DDP took 50 s
    assert mtdao_after["target_val_loss"] == 2.0
    assert mtdao_after["time_to_ddp_loss_s"] == pytest.approx(25.0)
    assert mtdao_after["speedup_to_ddp_loss"] == pytest.approx(2.0)
    # at DDP's 100 steps' tokens: 20 s and loss 2.1, so 50 / 20 = 2.5x
    assert mtdao_after["iso_token_wall_s"] == pytest.approx(20.0)
    assert mtdao_after["iso_token_val_loss"] == 2.1
    assert mtdao_after["iso_token_speedup"] == pytest.approx(2.5)
    assert ddp_after["speedup_to_ddp_loss"] == pytest.approx(1.0)
    assert ddp_after["iso_token_speedup"] == pytest.approx(1.0)
    assert alone_after == alone and "target_val_loss" not in alone_after  # no DDP at 1000 Mbit/s
    assert "target_val_loss" not in mtdao  # the input rows are left as they were


# -- Rosenbrock -----------------------------------------------------------------------------------


def _toy_run(method, seed, loss, distance, diverged=False, converged=True):
    return {
        "method": method,
        "beta": 0.9999,
        "omega": 0.5 if method == "mtdao" else 1.0,
        "seed": seed,
        "final_loss": loss,
        "final_distance": distance,
        "diverged": diverged,
        "converged": converged,
    }


def test_rosenbrock_summary_over_seeds():
    results = [
        _toy_run("mtdao", 0, 1.0, 0.1),
        _toy_run("mtdao", 1, 3.0, 0.3),
        _toy_run("local-adam", 0, math.inf, math.inf, diverged=True, converged=False),
    ]
    summary = summarize_rosenbrock(results)
    assert list(summary) == ["local-adam", "mtdao"]  # the toy's method order
    mtdao = summary["mtdao"]
    assert (mtdao["final_loss_mean"], mtdao["final_loss_std"]) == (2.0, 1.0)  # population std
    assert mtdao["final_distance_mean"] == pytest.approx(0.2)
    assert mtdao["final_distance_std"] == pytest.approx(0.1)
    assert (mtdao["converged"], mtdao["diverged"], mtdao["seeds"]) == (2, 0, [0, 1])
    local = summary["local-adam"]
    assert local["final_loss_mean"] == math.inf and local["final_loss_std"] == 0
    assert local["diverged"] == 1


def test_rosenbrock_report_renders_the_same_from_results_json():
    results = [
        _toy_run("mtdao", 0, 0.00393, 0.13),
        _toy_run("local-adam", 0, math.inf, math.inf, diverged=True, converged=False),
    ]
    config = {
        "workers": 8,
        "noise": 2.0,
        "beta": 0.9999,
        "omega": 0.5,
        "beta2": 0.999,
        "lr": 0.01,
        "sync_period": 16,
        "steps": 60,
        "start": [-1.5, 2.0],
    }
    text = render_rosenbrock({"config": config, "summary": summarize_rosenbrock(results)})
    assert "| local-adam | 0.9999 | 1.0 | inf ± 0 | inf ± 0 | inf | 1/1 | 0/1 |" in text
    assert "**local-adam** diverged on all 1 seeds: final f = inf ± 0" in text
    # results.json stores inf as null; the report reads the same from it
    saved = json.loads(to_json({"config": config, "summary": summarize_rosenbrock(results)}))
    assert saved["summary"]["local-adam"]["final_loss_mean"] is None
    assert render_rosenbrock(saved) == text
