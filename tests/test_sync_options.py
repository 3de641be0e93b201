"""``mtdao sync-options``: which runs it trains, and its summary and report from hand-made results
(every expected number worked out by hand)."""

from __future__ import annotations

import argparse
import json

import pytest

from mtdao.experiments.sync_options import run as sync_options
from mtdao.experiments.sync_options.report import plot_options, render_report
from mtdao.experiments.sync_options.summary import peak_step_bytes, summarize
from mtdao.train.config import resolve


def parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sync_options.add_parser(parser.add_subparsers())
    return parser.parse_args(["sync-options", *argv])


def test_runs_cover_every_option_setting_and_seed_and_skip_impossible_delays():
    args = parsed("--seeds", "0", "1")
    runs = dict(sync_options.option_runs(args))
    options, settings = len(sync_options.OPTIONS), len(sync_options.SETTINGS)
    # delay16 is not below the state period 16: left out of that setting only
    assert len(runs) == (options * settings - 1) * 2
    assert "state16-delay16-seed0" not in runs and "k32-delay16-seed1" in runs
    combo = resolve(runs["state16-combo-seed1"])
    sync = combo.sync
    assert (sync.sync_delay, sync.sync_fragments, sync.sync_dtype) == (4, 4, ("int8",))
    assert sync.error_feedback and sync.state_sync_period == 16 and combo.training.seed == 1
    assert resolve(runs["k32-fp32-seed0"]).sync.sync_dtype == ("fp32",)
    assert sync_options.option_flags("combo") == (
        "--sync-delay 4 --sync-fragments 4 --sync-dtype int8 --error-feedback"
    )


def run_results(loss: float, sent: int, events) -> dict:
    return {
        "final_val_loss": loss,
        "comm_reduction_vs_ddp": 10.0 * 1000 / sent,
        "comm_reduction_steady_state": None,
        "bytes_per_worker": sent,
        "comm_events": events,
        "parameters": 1234,
        "config": {"model": "micro", "workers": 4, "batch_size": 16, "seq_len": 64, "steps": 1000}
        | {"sync_period": 32, "lr": 0.008},
    }


def test_summary_applies_the_significance_rule_against_the_reference(tmp_path):
    results = {}
    for seed, (base, close, far) in enumerate(
        [(1.50, 1.52, 1.70), (1.52, 1.50, 1.72), (1.54, 1.54, 1.74)]
    ):
        results[f"k32-fp32-seed{seed}"] = run_results(base, 1000, [[32, 600], [64, 400]])
        results[f"k32-bf16-seed{seed}"] = run_results(close, 500, [[32, 300], [64, 200]])
        results[f"k32-frag4-seed{seed}"] = run_results(far, 1000, [{"step": 8, "bytes": 250}] * 4)
    options = {"fp32": "", "bf16": "--sync-dtype bf16", "frag4": "--sync-fragments 4"}
    summary = summarize(results, options=options, settings=["k32"], seeds=[0, 1, 2], command="c")
    rows = summary["table"]["k32"]
    assert rows["fp32"]["val_loss"]["mean"] == pytest.approx(1.52)
    assert rows["fp32"]["val_loss"]["std"] == pytest.approx(0.02)
    # bf16: mean 1.52, the same as the reference: a tie
    assert rows["bf16"]["difference"] == pytest.approx(0.0, abs=1e-12)
    assert rows["bf16"]["versus_reference"] == "tie"
    assert rows["bf16"]["reduction_vs_ddp"] == 20.0
    # frag4: +0.20 against stds 0.02 + 0.02: worse; four events at one step sum to its peak
    assert rows["frag4"]["difference"] == pytest.approx(0.20)
    assert rows["frag4"]["versus_reference"] == "worse"
    assert rows["frag4"]["peak_step_bytes"] == 1000 == peak_step_bytes(results["k32-frag4-seed0"])
    assert rows["fp32"]["peak_step_bytes"] == 600
    report = render_report(json.loads(json.dumps(summary)))  # from its results.json
    assert (
        "| frag4 | `--sync-fragments 4` | 1.7200 ± 0.0200 | +0.2000: higher (significant)" in report
    )
    assert "| bf16 | `--sync-dtype bf16` | 1.5200 ± 0.0200 | +0.0000: tie | 20.0x less" in report
    assert "1.0 kB (1.67x)" in report  # frag4's peak against the reference's 600 bytes
    # paired by seed: bf16 +0.02, -0.02, 0.00; frag4 +0.20 in every seed
    assert rows["bf16"]["paired_difference"]["mean"] == pytest.approx(0.0, abs=1e-12)
    assert rows["bf16"]["paired_difference"]["std"] == pytest.approx(0.02)
    assert "| +0.0000 ± 0.0200 (higher in 1 of 3) |" in report
    assert "| +0.2000 ± 0.0000 (higher in 3 of 3) |" in report
    assert plot_options(tmp_path, summary).is_file()
