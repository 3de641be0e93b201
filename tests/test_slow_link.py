"""``mtdao slow-link`` plumbing: real workers in network namespaces train, agree, and clean up.

The full experiment takes minutes; this checks the launch path with 2 workers on a fast link for a
few steps. Needs root and namespaces; skips with the reason otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from wait_limits import TINY_STEP, limit_s

from mtdao.cli import main
from mtdao.experiments.slow_link import run as slow_link
from mtdao.experiments.slow_link.report import render_report
from mtdao.testing.network.netem import LinkUnavailable, emulated_link
from mtdao.train import trainer
from mtdao.train.checkpoint.store import checkpoint_path
from mtdao.train.config import TrainConfig, resolve

STEPS, SYNC_PERIOD = 4, 2
# one run (the experiment's --timeout): its two workers' start and steps, across a fast link
RUN_S = limit_s(starts=1, steps=STEPS * TINY_STEP, processes=2)


def require_link() -> None:
    try:
        with emulated_link(1, 10.0, prefix="mtdaoslowtest"):
            pass
    except LinkUnavailable as error:
        pytest.skip(str(error))


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split(" ", 1)[0] for line in out.splitlines()]


@pytest.mark.slow
def test_two_workers_across_a_link_agree_with_each_other_and_the_simulation(
    corpus_dir, tmp_path, capsys
):
    require_link()
    out = tmp_path / "slow"
    argv = ["slow-link", "--workers", "2", "--rates", "1000", "--methods", "mtdao"]
    argv += ["--steps", str(STEPS), "--local-steps", str(STEPS), "--sync-period", str(SYNC_PERIOD)]
    argv += ["--model", "tiny", "--betas", "0.95", "--omegas", "0.7"]
    argv += ["--batch-size", "2", "--seq-len", "32", "--eval-tokens", "512"]
    argv += ["--data", str(corpus_dir), "--timeout", f"{RUN_S:.0f}", "--out", str(out)]
    # (the variant without the final round: its int8 rounds against the float32 ones)
    argv += ["--variant", "overlap", "--sync-delay 1 --sync-dtype int8 --no-final-round"]
    assert main(argv) == 0
    assert "skipped" not in capsys.readouterr().out
    # this process's namespaces are gone (others may be running their own links meanwhile)
    assert not [ns for ns in namespaces() if ns.startswith(f"mtdaoslow-{os.getpid()}-")]

    results = json.loads((out / "results.json").read_text())
    assert (results["kind"], results["workers"]) == ("slow-link", 2)
    row, variant = results["rows"]
    assert (out / "report.md").is_file() and (out / "time_to_loss.png").is_file()
    assert (out / "time_to_ddp_loss.png").is_file()
    flags = "--sync-delay 1 --sync-dtype int8 --no-final-round"
    assert (variant["method"], variant["flags"]) == ("overlap", flags)
    assert variant["bytes_per_worker"] < row["bytes_per_worker"] / 3  # int8 payloads
    assert row["steps"] == STEPS and row["measured_mbit"] > 100
    # the workers' traffic crossed the link: at least the two parameter/state averages
    assert row["wire_bytes_per_worker"] >= row["bytes_per_worker"] / 2 > 0

    # the two processes agree: after the final average both hold the same parameters
    run_dir = Path(row["run_dir"])
    final = checkpoint_path(run_dir)
    ranks = [torch.load(final / f"rank{r}.pt") for r in range(2)]
    for name, value in ranks[0]["params"].items():
        torch.testing.assert_close(ranks[1]["params"][name], value, rtol=0, atol=0)

    # ... and are the simulated 2-worker run
    config = TrainConfig.of(
        method="mtdao",
        betas=(0.95,),
        omegas=(0.7,),
        workers=2,
        steps=STEPS,
        sync_period=SYNC_PERIOD,
        batch_size=2,
        seq_len=32,
        eval_tokens=512,
        eval_every=slow_link.eval_every(STEPS, SYNC_PERIOD),
        schedule="cosine",  # slow-link's defaults
        warmup=0.05,
        data=str(corpus_dir),
        out=str(tmp_path / "simulated"),
        device="cpu",
        progress=False,
    )
    simulated = trainer.train(config)
    assert row["final_val_loss"] == pytest.approx(simulated["final_val_loss"], abs=1e-5)
    assert row["bytes_per_worker"] == simulated["bytes_per_worker"]


def test_variants_are_flags_on_top_of_the_experiment_checked_before_anything_runs(tmp_path):
    parser = argparse.ArgumentParser()
    slow_link.add_parser(parser.add_subparsers())
    variants = [
        "--variant",
        "quiet",
        "--sync-period 100000",
        "--variant",
        "ddp-lr",
        "--method ddp --lr 0.01",
    ]
    args = parser.parse_args(["slow-link", *variants])
    specs = slow_link.run_specs(args)
    assert [(s.name, s.method) for s in specs] == [
        ("ddp", "ddp"),
        ("mtdao", "mtdao"),
        ("quiet", "mtdao"),
        ("ddp-lr", "ddp"),
    ]
    argv = slow_link.train_argv(specs[2], args, tmp_path)
    assert argv[argv.index("--sync-period") + 1] == "100000"
    assert argv[argv.index("--steps") + 1] == str(2 * args.steps)  # a local method's budget
    argv = slow_link.train_argv(specs[3], args, tmp_path)
    assert argv[argv.index("--steps") + 1] == str(args.steps) and "0.01" in argv
    for flags, match in (("--sync-delay 32", "--sync-delay 32 must be below"), ("--x", "--x")):
        args.variant = [["bad", flags]]
        with pytest.raises(ValueError, match=match):
            slow_link.run_specs(args)


def test_skips_in_one_line_without_root(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert main(["slow-link", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip().startswith("skipped: ")


def test_keep_finished_keeps_only_a_run_of_the_same_training_and_link_settings(tmp_path):
    """A resumed study keeps a finished run (its row from results.json, what the link measured
    from link.json) only if every training setting and the link's rate and delay match."""
    parser = argparse.ArgumentParser()
    slow_link.add_parser(parser.add_subparsers())
    args = parser.parse_args(["slow-link", "--model", "micro", "--steps", "64"])
    ddp = slow_link.run_specs(args)[0]
    run_dir = tmp_path / "ddp-10mbit"
    run_dir.mkdir()
    argv = slow_link.train_argv(ddp, args, run_dir)
    config = resolve(slow_link.parse_train_flags(argv))
    (run_dir / "config.json").write_text(json.dumps(config.to_dict()))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 64, "train_time_s": 6.4}) + "\n")
    link = {"rate_mbit": 10.0, "delay_ms": 50.0}
    settings = dict(link)
    assert slow_link.finished_run(run_dir, argv, settings) is None  # no results.json: unfinished
    results = {
        "steps": 64, "tokens": 65536, "final_val_loss": 2.5, "train_time_s": 6.4,
        "compute_s_per_worker_step": 0.01, "bytes_per_worker": 10**6,
        "comm_reduction_vs_ddp": 1.0, "parameters": 110912,
        "evals": [{"step": 64, "tokens": 65536, "val_loss": 2.5, "train_time_s": 6.4}],
    }  # fmt: skip
    (run_dir / "results.json").write_text(json.dumps(results))
    assert slow_link.finished_run(run_dir, argv, settings) is None  # no link.json: link unknown
    (run_dir / "link.json").write_text(json.dumps(link))
    row = slow_link.finished_run(run_dir, argv, settings)
    assert row["kept"] and row["final_val_loss"] == 2.5 and row["wire_bytes_per_worker"] is None
    assert "kept from an earlier invocation" in render_report(
        [{**row, "rate_mbit": 10.0, "measured_mbit": 8.5, "method": "ddp"}],
        command="mtdao slow-link", workers=4, torch="2.13.0", cores=2,
    )  # fmt: skip
    (run_dir / "link.json").write_text(json.dumps({**link, "wire_bytes_per_worker": 2e9}))
    assert slow_link.finished_run(run_dir, argv, settings)["wire_bytes_per_worker"] == 2e9
    assert slow_link.finished_run(run_dir, argv, {**settings, "delay_ms": 0.0}) is None
    other = parser.parse_args(["slow-link", "--model", "micro", "--steps", "65"])
    assert slow_link.finished_run(run_dir, slow_link.train_argv(ddp, other, run_dir), link) is None
    lr = parser.parse_args(["slow-link", "--model", "micro", "--steps", "64", "--lr", "0.01"])
    assert slow_link.finished_run(run_dir, slow_link.train_argv(ddp, lr, run_dir), link) is None
