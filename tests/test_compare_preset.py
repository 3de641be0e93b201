"""``mtdao compare --preset paper-16m``: the paper's smallest setting in one flag, with any flag
given beside it still applying; a CPU dry run at a tiny budget goes through to the report."""

from __future__ import annotations

import json

import pytest

from mtdao.cli import build_parser, main
from mtdao.experiments.compare.presets import COMPARE_PRESETS, apply_preset
from mtdao.methods.table import METHODS


def parsed(*flags: str):
    return apply_preset(build_parser().parse_args(["compare", *flags]))


def test_preset_sets_the_paper_setting():
    args = parsed("--preset", "paper-16m")
    assert (args.model, args.optimizer, args.tokenizer, args.schedule) == (
        "16m",
        "adopt",
        "byte",
        "wsd",
    )
    assert (args.workers, args.sync_period, args.seq_len) == (4, 32, 2048)
    assert args.methods == ["ddp", "local-adam", "mtdao"] and args.seeds == [0]
    assert args.steps == COMPARE_PRESETS["paper-16m"]["steps"]


def test_flags_given_beside_the_preset_win():
    args = parsed("--steps", "20", "--preset", "paper-16m", "--optimizer", "adam", "--seeds", "1")
    assert (args.steps, args.optimizer, args.seeds) == (20, "adam", [1])
    assert args.seq_len == 2048 and args.schedule == "wsd"  # the rest is the preset's
    # a flag given at the value the plain default has still beats the preset
    assert parsed("--preset", "paper-16m", "--seq-len", "64").seq_len == 64


def test_without_a_preset_the_defaults_are_unchanged():
    args = parsed()
    assert (args.model, args.optimizer, args.schedule, args.steps) == (
        "micro",
        "adam",
        "cosine",
        1000,
    )
    assert (args.seq_len, args.batch_size, args.seeds) == (64, 16, [0, 1, 2])
    assert args.methods == list(METHODS) and args.preset is None


def test_unknown_preset_is_one_line_error(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["compare", "--preset", "paper-1b"])
    assert stopped.value.code == 2
    assert "--preset: invalid choice: 'paper-1b'" in capsys.readouterr().err


@pytest.mark.slow
def test_cpu_dry_run_at_a_tiny_budget(tmp_path, corpus_dir):
    out = tmp_path / "paper-16m"
    tiny = ["--steps", "2", "--batch-size", "1", "--seq-len", "128", "--eval-tokens", "256"]
    argv = ["compare", "--preset", "paper-16m", *tiny, "--threads", "1"]
    assert main([*argv, "--data", str(corpus_dir), "--out", str(out)]) == 0

    settings = json.loads((out / "results.json").read_text())["settings"]
    assert settings["preset"] == "paper-16m" and settings["methods"] == [
        "ddp",
        "local-adam",
        "mtdao",
    ]
    assert (settings["steps"], settings["seq_len"], settings["batch_size"]) == (2, 128, 1)
    config = json.loads((out / "runs" / "mtdao-lr0.004-seed0" / "config.json").read_text())
    assert (config["model"], config["optimizer"], config["schedule"]) == ("16m", "adopt", "wsd")
    assert (config["beta2"], config["sync_period"], config["workers"]) == (0.9999, 32, 4)
    assert (config["steps"], config["seq_len"], config["tokenizer"]) == (2, 128, "byte")
    report = (out / "report.md").read_text()
    assert "preset `paper-16m`" in report and "LR schedule `wsd`" in report
    assert "--preset paper-16m" in report  # the command line that reruns it
