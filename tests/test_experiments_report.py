"""Report math of ``mtdao compare`` on hand-built results (no training),
the suite's bookkeeping, and one tiny end-to-end comparison."""

from __future__ import annotations

import json
import math
import shlex

import pytest

from mtdao.experiments.common import formatting, study_flags, suite
from mtdao.experiments.compare import plots as compare_plots
from mtdao.experiments.compare import report as compare_report
from mtdao.experiments.compare import summary as compare_summary
from mtdao.experiments.compare import wallclock
from mtdao.train.config import TrainConfig

PARAM_BYTES = 1000  # bytes of one model-sized buffer per worker
STEPS, EVAL_EVERY, K, WORKERS = 100, 10, 10, 4


def fake_run(method, seed, final, *, start=5.0, compute=0.01, cosine=0.9, lr=8e-3):
    """A results dict shaped like trainer.summarize: a loss curve ending at ``final``."""
    evals = [
        {
            "step": step,
            "tokens": step * 256,
            "val_loss": final + (start - final) * (1 - step / STEPS) ** 2,
            "wall_time_s": step * compute,
        }
        for step in range(EVAL_EVERY, STEPS + 1, EVAL_EVERY)
    ]
    if method == "ddp":
        events = [[step, PARAM_BYTES] for step in range(1, STEPS + 1)]
        alignment = []
    else:  # parameters and two states every K
        events = [[step, 3 * PARAM_BYTES] for step in range(K, STEPS + 1, K)]
        alignment = [
            {"step": s, "cosine": [cosine] * WORKERS, "drift": [0.1 * s / STEPS] * WORKERS}
            for s in range(K, STEPS + 1, K)
        ]
    return {
        "method": method,
        "workers": WORKERS,
        "steps": STEPS,
        "tokens": STEPS * 256,
        "final_val_loss": final,
        "val_ppl": math.exp(final),
        "bytes_per_worker": sum(b for _, b in events),
        "ddp_bytes_per_worker": PARAM_BYTES * STEPS,
        "comm_events": events,
        "alignment": alignment,
        "evals": evals,
        "compute_s_per_worker_step": compute,
        "sync_policy": "ddp" if method == "ddp" else f"unified(K={K})",
        "settings": {"lr": lr, "betas": [0.9], "omegas": [1.0], "beta2": 0.95},
        "config": {"seed": seed},
        "parameters": 250,
    }


def fake_compare(finals: dict[str, list[float]], **kwargs):
    runs = {m: [fake_run(m, s, f) for s, f in enumerate(values)] for m, values in finals.items()}
    settings = {
        "methods": list(finals),
        "model": "micro",
        "steps": STEPS,
        "workers": WORKERS,
        "sync_period": K,
        "seeds": [0, 1, 2],
        "eval_every": EVAL_EVERY,
        "tokens": STEPS * 256,
        "seq_len": 64,
        "parameters": 250,
    }
    return compare_summary.summarize_compare(runs, settings=settings, **kwargs)


# -- statistics and targets -----------------------------------------------------------------------


def test_stats_mean_and_sample_std():
    s = formatting.stats([1.0, 2.0, 3.0])
    assert (s["mean"], s["std"], s["n"]) == (2.0, 1.0, 3)
    assert formatting.stats([0.7])["std"] == 0.0
    assert formatting.stats([]) is None


def test_steps_to_target_is_first_eval_at_or_below():
    evals = [
        {"step": 10, "val_loss": 2.0},
        {"step": 20, "val_loss": 1.0},
        {"step": 30, "val_loss": 0.9},
    ]
    assert compare_summary.steps_to_target(evals, 1.0) == 20  # "at" counts
    assert compare_summary.steps_to_target(evals, 1.5) == 20
    assert compare_summary.steps_to_target(evals, 5.0) == 10
    assert compare_summary.steps_to_target(evals, 0.5) is None


def test_significance_rule():
    a = {"mean": 0.70, "std": 0.01}
    assert formatting.compare_losses(a, {"mean": 0.75, "std": 0.01}) == "better"
    assert formatting.compare_losses(a, {"mean": 0.65, "std": 0.01}) == "worse"
    assert formatting.compare_losses(a, {"mean": 0.715, "std": 0.01}) == "tie"  # 0.015 <= 0.02


def test_summary_traffic_wallclock_and_targets():
    summary = fake_compare({"ddp": [0.70, 0.71, 0.72], "local-adam": [0.80, 0.81, 0.82]})
    ddp, local = summary["methods"]["ddp"], summary["methods"]["local-adam"]
    assert summary["target_val_loss"] == pytest.approx(0.71)
    assert ddp["final_val_loss"]["mean"] == pytest.approx(0.71)
    assert ddp["final_val_loss"]["std"] == pytest.approx(0.01)
    assert ddp["traffic_vs_ddp"] == pytest.approx(1.0)
    assert local["traffic_vs_ddp"] == pytest.approx(100 / 30)  # 100 gradients vs 10 x 3 buffers
    # DDP: the seed ending at 0.70 and the one at 0.71 reach 0.71 on the last eval, 0.72 never
    assert ddp["steps_to_target"]["per_seed"] == [100, 100, None]
    assert ddp["steps_to_target"]["reached"] == 2
    assert local["steps_to_target"]["reached"] == 0
    assert summary["compute_s_per_step"] == pytest.approx(0.01)
    link = wallclock.LINK_PRESETS["1gbit"]
    expected = wallclock.run_seconds(
        0.01, [(s, 3 * PARAM_BYTES) for s in range(K, 101, K)], 4, link, steps=100
    )
    assert local["wallclock"]["1gbit"]["run_s"]["mean"] == pytest.approx(expected)
    ddp_to_target = wallclock.time_to_step(
        0.01, [(s, PARAM_BYTES) for s in range(1, 101)], 4, link, step=100
    )
    assert ddp["wallclock"]["1gbit"]["to_target_s"]["mean"] == pytest.approx(ddp_to_target)
    assert local["alignment"]["cosine_mean"] == pytest.approx(0.9)


def test_shared_compute_time_is_the_median():
    runs = [{"compute_s_per_worker_step": v} for v in (0.01, 0.05, 0.02)]
    assert compare_summary.shared_compute_seconds(runs) == 0.02


# -- verdict wording ------------------------------------------------------------------------------

BASELINES = {"local-adam": [0.80, 0.81, 0.82], "diloco": [0.85, 0.86, 0.87]}


def test_verdict_clear_win():
    summary = fake_compare({"ddp": [0.75, 0.76, 0.77], **BASELINES, "mtdao": [0.70, 0.71, 0.72]})
    text = compare_report.verdict(summary)
    assert "MT-DAO is better by 0.0500" in text
    assert "holds here." in text
    assert "Ranking by mean final loss: MT-DAO 0.7100 < DDP" in text


def test_verdict_clear_loss():
    summary = fake_compare({"ddp": [0.70, 0.71, 0.72], **BASELINES, "mtdao": [0.90, 0.91, 0.92]})
    text = compare_report.verdict(summary)
    assert "DDP is better by 0.2000" in text
    assert "does not hold here" in text
    assert "never reached DDP's final loss" in text


def test_verdict_tie_with_ddp_counts_as_matching():
    summary = fake_compare({"ddp": [0.70, 0.71, 0.72], **BASELINES, "mtdao": [0.705, 0.715, 0.725]})
    text = compare_report.verdict(summary)
    assert "tie within seed noise" in text
    assert "holds here." in text


def test_verdict_partial_and_unchecked():
    summary = fake_compare(
        {"ddp": [0.70, 0.71, 0.72], "local-adam": [0.70, 0.71, 0.72], "mtdao": [0.70, 0.71, 0.72]}
    )
    text = compare_report.verdict(summary)
    assert "DiLoCo was not run" in text
    assert (
        "holds only in part: MT-DAO matches or beats DDP, but it does not beat Local Adam" in text
    )


def test_each_method_line_shows_its_own_warmups():
    summary = fake_compare({"ddp": [0.75], "mtdao": [0.70]})
    summary["methods"]["mtdao"]["settings"].update(omega_warmup=0.3, beta_warmup=0.25)
    summary["methods"]["ddp"]["settings"].update(omega_warmup=0.0, beta_warmup=0.0)
    lines = compare_report.render(summary).splitlines()
    mtdao = next(line for line in lines if line.startswith("- MT-DAO: lr"))
    ddp = next(line for line in lines if line.startswith("- DDP: lr"))
    assert mtdao.endswith(", omega warm-up 0.3, beta warm-up 0.25") and "warm-up" not in ddp


def test_report_and_plots_are_written(tmp_path):
    sweep = {
        "seed": 0,
        "lrs": [4e-3, 8e-3],
        "losses": {"ddp": {"0.004": 0.8, "0.008": 0.75}, "mtdao": {"0.004": 0.72, "0.008": None}},
        "best": {"ddp": 8e-3, "mtdao": 4e-3},
    }
    summary = fake_compare(
        {"ddp": [0.75, 0.76, 0.77], **BASELINES, "mtdao": [0.70, 0.71, 0.72]}, sweep=sweep
    )
    text = compare_report.render(summary)
    assert "## Verdict" in text and "## Learning-rate sweep" in text
    assert "| MT-DAO | 0.008 | 0.7100 ± 0.0100 |" in text
    assert "3.3x less" in text and "**0.7500**" in text and "failed" in text
    for path in compare_plots.write_compare_plots(tmp_path, summary):
        assert path.stat().st_size > 10_000
    # results.json holds the summary: the report renders the same from it
    saved = json.loads(json.dumps(summary))
    assert compare_report.render(saved) == text


# -- suite bookkeeping ----------------------------------------------------------------------------


def test_a_report_names_the_command_that_was_typed(monkeypatch):
    monkeypatch.setattr("sys.argv", ["mtdao", "frontier", "--no-train", "--out", "runs/a b"])
    assert (
        study_flags.typed_command("frontier", ["--no-train"]) == "mtdao frontier --out 'runs/a b'"
    )
    assert study_flags.typed_command("slow-link") == "mtdao slow-link"  # called otherwise


def test_parse_lr_pins():
    methods = ["ddp", "mtdao"]
    assert study_flags.parse_lr_pins(["mtdao=1e-2", "4e-3"], methods) == {
        "ddp": 4e-3,
        "mtdao": 1e-2,
    }
    with pytest.raises(ValueError, match="unknown method"):
        study_flags.parse_lr_pins(["adam=1e-2"], methods)
    with pytest.raises(ValueError, match="METHOD=VALUE"):
        study_flags.parse_lr_pins(["mtdao=fast"], methods)


def test_suite_reuses_finished_runs_and_refuses_stale_ones(tmp_path):
    config = TrainConfig.of(model="micro", steps=3, progress=False)
    run_dir = suite.run_dir_of(tmp_path, "a")
    run_dir.mkdir(parents=True)
    (run_dir / "results.json").write_text(
        json.dumps({"final_val_loss": 1.0, "config": config.to_dict()})
    )
    lines = []
    result = suite.run_suite([("a", config)], tmp_path, log=lines.append)
    assert result.results["a"]["final_val_loss"] == 1.0 and "1/1 runs already finished" in lines[0]
    with pytest.raises(ValueError, match="steps: 3 -> 4"):
        suite.run_suite([("a", TrainConfig.of(model="micro", steps=4))], tmp_path)


def test_half_finished_run_dir_is_resumed_or_wiped(tmp_path):
    config = TrainConfig.of(model="micro", steps=3, progress=False)
    run_dir = tmp_path / "r"
    checkpoint = run_dir / "checkpoints" / "step-00000002"
    checkpoint.mkdir(parents=True)
    meta = {"step": 2, "sequence": 1, "world_size": 1, "files": {}, "config": config.to_dict()}
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    assert suite._prepare(run_dir, config).job.resume
    assert run_dir.exists()
    other = TrainConfig.of(model="micro", steps=3, lr=1e-3)
    launched = suite._prepare(run_dir, other)
    assert not launched.job.resume and not run_dir.exists() and launched.job.out == str(run_dir)


def test_a_run_another_process_is_training_is_left_alone_and_reported_failed(tmp_path):
    """Two studies on one --out: the second finds the first's live run (its lock held) and
    neither wipes its directory nor trains beside it; it reports the run failed, naming why."""
    from mtdao.train.run_lock import RunLock

    config = TrainConfig.of(model="micro", steps=3, progress=False)
    run_dir = suite.run_dir_of(tmp_path, "a")
    with RunLock(run_dir):
        (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
        for jobs in (1, 2):  # trained in this process, and in subprocesses
            result = suite.run_suite([("a", config)], tmp_path, jobs=jobs, threads=1)
            failure = result.failures["a"]
            assert "RunLockedError" in failure and "in use by another run" in failure
            assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'


# -- end to end -----------------------------------------------------------------------------------

TINY = "--seeds 0 --model micro --batch-size 2 --seq-len 16 --eval-tokens 512 --threads 1"


def run_experiment(command: str, out) -> None:
    """``mtdao <command>`` on a tiny budget into ``out``; it must exit 0."""
    from mtdao.cli import main

    assert main([*shlex.split(f"{command} {TINY}"), "--out", str(out)]) == 0


@pytest.mark.slow
def test_compare_end_to_end(tmp_path):
    out = tmp_path / "cmp"
    run_experiment("compare --methods ddp mtdao --steps 6 --eval-every 3 --sync-period 2", out)
    results = json.loads((out / "results.json").read_text())
    assert set(results["methods"]) == {"ddp", "mtdao"}
    assert results["methods"]["ddp"]["traffic_vs_ddp"] == pytest.approx(1.0)
    assert results["methods"]["mtdao"]["alignment"]["syncs_per_run"] == 3
    text = (out / "report.md").read_text()
    assert "## Verdict" in text and "| DDP | 0.008 |" in text
    assert compare_report.render(results) == text  # re-renders from results.json
    for name in ("loss_vs_tokens.png", "loss_vs_time.png", "alignment.png", "traffic.png"):
        assert (out / name).stat().st_size > 0


def test_a_suite_takes_the_thread_count_omp_num_threads_asks_for(monkeypatch):
    """Two threads per run on a busy 2-core machine are many times slower than one: a set
    OMP_NUM_THREADS is the default, not cores // jobs."""
    for value, expected in (("1", 1), ("3", 3), ("0", None), ("two", None), ("", None)):
        monkeypatch.setenv("OMP_NUM_THREADS", value)
        assert suite.omp_threads() == expected, value
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert suite.omp_threads() is None
