"""``mtdao train`` end to end: what a run writes, its communication accounting, and how every bad
input is reported (one line on stderr, exit code 2, no traceback).

Runs use the tiny model on 2 workers, batch 2, 32 tokens, a handful of steps, on a ~200 KB text
directory written by the test.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mtdao
from mtdao.cli import main
from mtdao.methods.table import METHODS
from mtdao.train import plots, trainer
from mtdao.train.metrics import read_metrics
from mtdao.train.plots import plot_run

pytestmark = pytest.mark.usefixtures("one_thread", "no_plot")
RESULT_KEYS = (
    "method",
    "workers",
    "steps",
    "tokens",
    "final_val_loss",
    "val_ppl",
    "bytes_per_worker",
    "comm_reduction_vs_ddp",
    "wall_time_s",
)


def tiny_args(out: Path, data: Path | str, *extra: str) -> list[str]:
    return [
        "train",
        *("--model", "tiny", "--workers", "2", "--sync-period", "4"),
        *("--batch-size", "2", "--seq-len", "32", "--steps", "4", "--eval-tokens", "256"),
        *("--data", str(data), "--out", str(out), "--device", "cpu", "--no-progress"),
        *extra,
    ]


def run_ok(capsys, args: list[str]) -> dict:
    """Run the CLI in this process; returns results.json of the run."""
    assert main(args) == 0, capsys.readouterr().err
    out = Path(args[args.index("--out") + 1])
    summary = json.loads(capsys.readouterr().out.splitlines()[0])
    results = json.loads((out / "results.json").read_text())
    assert summary["final_val_loss"] == results["final_val_loss"]
    return results


def assert_one_line_error(capsys, args: list[str], match: str) -> None:
    try:
        code = main(args)
    except SystemExit as exit_:  # argparse errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    # one error line; a run that got as far as loading its data said so first, what it decided
    # about its directory, and a setting that is allowed but suspicious is warned about
    said = ("data: ", "warning: ", "resumed from ", "--resume: ", "--extend: ", "--overwrite: ")
    lines = [line for line in err.strip().splitlines() if not line.startswith(said)]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("mtdao") and match in lines[0], err


# -- what a run writes ----------------------------------------------------------------------------


def test_run_outputs_and_determinism(tmp_path, corpus_dir, capsys, monkeypatch):
    """results.json, config.json, metrics.jsonl and loss.png; the same run twice is identical."""
    monkeypatch.setattr(plots, "plot_run", plot_run)  # this file's other runs draw none
    first = run_ok(capsys, tiny_args(tmp_path / "first", corpus_dir, "--eval-every", "2"))
    second = run_ok(capsys, tiny_args(tmp_path / "second", corpus_dir, "--eval-every", "2"))

    assert set(RESULT_KEYS) <= set(first)
    assert (first["method"], first["workers"], first["steps"]) == ("mtdao", 2, 4)
    assert first["tokens"] == 4 * 2 * 2 * 32
    assert math.isfinite(first["final_val_loss"]) and first["final_val_loss"] > 0
    assert first["val_ppl"] == pytest.approx(math.exp(first["final_val_loss"]))
    assert first["bytes_per_worker"] > 0 and first["wall_time_s"] > 0

    run_dir = tmp_path / "first"
    config = json.loads((run_dir / "config.json").read_text())
    assert (
        config["method"] == "mtdao" and config["steps"] == 4 and config["data"] == str(corpus_dir)
    )
    records = read_metrics(run_dir)
    assert [r["step"] for r in records if "train_loss" in r] == [4]  # --log-every 10
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4]
    assert (run_dir / "loss.png").stat().st_size > 0

    assert second["final_val_loss"] == first["final_val_loss"]
    assert [e["val_loss"] for e in second["evals"]] == [e["val_loss"] for e in first["evals"]]
    assert second["bytes_per_worker"] == first["bytes_per_worker"]


@pytest.mark.parametrize(
    "method, period, steps, reduction",
    [
        ("ddp", 4, 2, 1.0),
        ("mtdao", 4, 4, 4 / 3),  # params, one momentum and the second moment every K
        ("diloco", 4, 4, 4.0),  # params only
        ("desloc", 2, 12, 1 / (1 / 2 + 1 / 6 + 1 / 12)),  # params K, momentum 3K, second 6K
    ],
)
def test_communication_reduction_vs_ddp(
    tmp_path, corpus_dir, capsys, method, period, steps, reduction
):
    args = tiny_args(tmp_path, corpus_dir, "--method", method, "--eval-every", "100")
    args[args.index("--sync-period") + 1] = str(period)
    args[args.index("--steps") + 1] = str(steps)
    results = run_ok(capsys, args)
    assert results["comm_reduction_vs_ddp"] == pytest.approx(reduction)
    assert results["modelled_comm_fraction_of_ddp"] == pytest.approx(1 / reduction)
    assert results["bytes_per_worker"] * reduction == pytest.approx(results["ddp_bytes_per_worker"])


def test_what_the_terminal_shows(tmp_path, corpus_dir, capsys, monkeypatch):
    """The data loaded, where the results are, traffic against DDP with its steady state, and
    real wall time (evaluation included); a DDP run directory has no K in its name."""
    monkeypatch.chdir(tmp_path)
    # (without the final round, which would add a round after the last step: see test_results)
    args = tiny_args(tmp_path, corpus_dir, "--steps", "6", "--eval-every", "3", "--no-final-round")
    args.remove("--out")
    args.remove(str(tmp_path))
    assert main(args) == 0
    captured = capsys.readouterr()
    notes = ("warning: ", "the machine is busy")  # a short run's note; the thread count's
    said = [line for line in captured.err.splitlines() if not line.startswith(notes)]
    assert said[0].startswith(f"data: local:{corpus_dir.resolve()}: ")
    assert "documents" in captured.err and "tokens (byte tokenizer, vocabulary 256)" in captured.err
    summary, where, traffic = captured.out.splitlines()
    run_dir = "runs/mtdao-adam-M2-K4-seed0"
    assert where.startswith(f"results: {run_dir}/results.json")
    # K = 4, 6 steps: one round of params + 2 states (3 models) against DDP's 6 gradients;
    # over whole cycles (4 steps) that is 4 / 3
    assert json.loads(summary)["comm_reduction_vs_ddp"] == pytest.approx(2.0)
    assert json.loads(summary)["comm_reduction_steady_state"] == pytest.approx(4 / 3)
    assert "2.0x less than DDP (1.3x less in steady state" in traffic and "last 2 steps" in traffic
    results = json.loads((tmp_path / run_dir / "results.json").read_text())
    assert results["wall_time_s"] > results["train_time_s"] + results["eval_time_s"] > 0
    assert results["config"]["lr"] == 8e-3 and results["config"]["betas"] == [0.99]

    ddp = tiny_args(tmp_path, corpus_dir, "--method", "ddp", "--steps", "1")
    ddp[ddp.index("--out") : ddp.index("--out") + 2] = []
    assert main(ddp) == 0
    assert (tmp_path / "runs" / "ddp-adam-M2-seed0" / "results.json").is_file()


def test_the_terminal_says_why_nothing_was_sent_and_names_only_a_drawn_plot(
    tmp_path, corpus_dir, capsys, monkeypatch
):
    """2 workers and fewer steps than K: no round came due (not "one worker"); a plot that
    could not be drawn is not named (and no older one is left to be taken for it)."""

    def full_disk(run_dir, reference=None):
        (Path(run_dir) / "loss.png").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plots, "plot_run", full_disk)
    out = tmp_path / "run"
    short = tiny_args(out, corpus_dir, "--steps", "3", "--eval-every", "3", "--no-final-round")
    assert main(short) == 0
    _, where, traffic = capsys.readouterr().out.splitlines()
    assert traffic.endswith("(no round came due in 3 steps with --sync-period 4)"), traffic
    assert "plot:" not in where and not (out / "loss.png").exists()
    single = tiny_args(tmp_path / "one", corpus_dir, "--workers", "1", "--steps", "1")
    assert main(single) == 0
    assert "(nothing to average with one worker)" in capsys.readouterr().out


def test_out_of_memory_is_one_line_naming_the_batch_size(tmp_path, corpus_dir, capsys, monkeypatch):
    """What the CPU allocator raises (seen with --batch-size 4096 under ``ulimit -v``), and
    CUDA's error: one line, the size it tried, the flags to lower."""
    cpu = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 335544320 bytes. Error code 12 (Cannot allocate memory)"
    )
    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 ...")
    for error in (cpu, cuda):

        def allocate(run, error=error):
            raise error

        monkeypatch.setattr(trainer, "train_step", allocate)
        args = tiny_args(tmp_path / "run", corpus_dir, "--overwrite")
        assert_one_line_error(capsys, args, "out of memory on cpu (it tried to allocate ")
        assert_one_line_error(capsys, args, "lower --batch-size (now 2 sequences of --seq-len 32")


@pytest.mark.parametrize("shape", [("--workers", "1"), ("--workers", "1", "--method", "ddp")])
def test_one_worker_sends_nothing(tmp_path, corpus_dir, capsys, shape):
    """One worker has no one to average with: 0 B, and no claim of a reduction against DDP."""
    args = tiny_args(tmp_path, corpus_dir, "--eval-every", "100")
    args[args.index("--workers") : args.index("--workers") + 2] = []
    assert main([*args, *shape]) == 0, capsys.readouterr().err
    traffic = capsys.readouterr().out.splitlines()[-1]
    assert traffic == "traffic: 0 B sent per worker (nothing to average with one worker)"
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["bytes_per_worker"] == 0 and results["collectives"] == 0
    assert (
        results["comm_reduction_vs_ddp"] is None and results["bytes_by_kind"].get("params", 0) == 0
    )


def test_ddp_is_the_same_as_ddp(tmp_path, corpus_dir, capsys):
    assert main(tiny_args(tmp_path, corpus_dir, "--method", "ddp", "--eval-every", "100")) == 0
    traffic = capsys.readouterr().out.splitlines()[-1]
    assert traffic.endswith("sent per worker, the same as DDP"), traffic
    assert "1.0x" not in traffic


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"mtdao {mtdao.__version__}"


def test_hugging_face_saved_dataset(tmp_path, corpus_dir, capsys, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    datasets = pytest.importorskip("datasets")
    texts = [path.read_text() for path in sorted(corpus_dir.iterdir())]
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"id": list(range(len(texts))), "text": texts}).save_to_disk(saved)

    args = tiny_args(tmp_path / "run", f"hf:{saved}", "--workers", "1")
    args[args.index("--steps") + 1] = "2"
    results = run_ok(capsys, args)
    assert results["steps"] == 2 and math.isfinite(results["final_val_loss"])


# -- divergence -----------------------------------------------------------------------------------


def test_divergence_between_syncs_stops_the_run(tmp_path, corpus_dir, capsys):
    """No sync within the run (K=32), so only the loop can notice the NaN; nothing is written."""
    out = tmp_path / "run"
    args = tiny_args(out, corpus_dir, "--lr", "1e6", "--sync-period", "32", "--eval-every", "100")
    assert_one_line_error(capsys, args, "training loss is NaN/inf at step")
    assert not (out / "results.json").exists()


def test_divergence_at_a_sync(tmp_path, corpus_dir, capsys):
    """DDP averages gradients before each step: the engine's guard stops the run (the loop's
    guard on the training loss would only see it after the step). Which step first overflows
    (2 or 3) depends on the processor's float kernels; that it is a gradient does not."""
    args = tiny_args(tmp_path, corpus_dir, "--lr", "1e6", "--method", "ddp")
    assert_one_line_error(capsys, args, "in worker 0: gradient of")


def test_divergence_of_every_worker_cannot_be_skipped(tmp_path, corpus_dir, capsys):
    args = tiny_args(tmp_path, corpus_dir, "--lr", "1e6", "--on-non-finite", "skip")
    assert_one_line_error(capsys, args, "on every worker")
    assert not (tmp_path / "results.json").exists()


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, match",
    [
        (("--sync-period", "0"), "--sync-period must be a positive integer"),
        (("--workers", "0"), "--workers must be a positive integer"),
        (("--betas", "1.5"), "Invalid beta at index 0 of betas: 1.5"),
        (("--method", "foo"), "invalid choice: 'foo'"),
        (("--omegas", "1.2"), "sum to 1.2 > 1"),
        (("--betas", "0.9", "--omegas", "0.3", "0.3"), "has 2 weights but betas (0.9,)"),
        (("--omegas", "0.3", "0.3"), "has 2 weights but betas"),  # against the default betas
        (("--lr", "-1"), "--lr must be a finite number >= 0"),
        (("--tokens", "1000"), "--tokens: not allowed with argument --steps"),
        (("--method", "ddp", "--sync-policy", "unified"), "a sync policy does not apply"),
        (("--eval-tokens", "16"), "--eval-tokens 16 is less than one window of --seq-len 32"),
        (("--seq-len", "100000"), "--eval-tokens 256 is less than one window of --seq-len 100000"),
        (("--resume", "--overwrite"), "give --resume (continue the run in --out) or --overwrite"),
        (("--extend",), "--extend re-plans a resumed run: it needs --resume"),
        (("--min-lr-ratio", "1.5"), "--min-lr-ratio must lie in [0, 1]"),
        (("--outer-lr", "nan"), "--outer-lr must be a finite number > 0, got nan"),
        (("--keep-checkpoints", "0"), "--keep-checkpoints must be a positive integer"),
        (("--collective-timeout", "0"), "--collective-timeout must be a finite number > 0"),
    ],
)
def test_bad_flag_is_one_line(tmp_path, corpus_dir, capsys, extra, match):
    assert_one_line_error(capsys, tiny_args(tmp_path / "run", corpus_dir, *extra), match)
    assert not (tmp_path / "run" / "results.json").exists()


def test_bad_data_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "binary.bin").write_bytes(bytes(range(256)) * 8)
    cases = [
        (tmp_path / "missing", "corpus path does not exist"),
        (tmp_path / "empty", "no non-empty UTF-8 text files"),
        (tmp_path / "binary.bin", "not UTF-8 text"),
    ]
    for data, match in cases:
        assert_one_line_error(capsys, tiny_args(tmp_path / "run", data), match)


def test_errors_from_a_fresh_process(tmp_path):
    """Through ``python -m mtdao``: exit code 2, one line on stderr, no traceback."""
    cases = [
        (["--sync-period", "0"], "--sync-period must be a positive integer"),
        (["--data", str(tmp_path / "missing")], "corpus path does not exist"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "mtdao", "train", "--out", str(tmp_path / "run"), *flags],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for flags, _ in cases
    ]
    for process, (flags, match) in zip(processes, cases):
        out, err = process.communicate(timeout=120)
        assert process.returncode == 2, (flags, err)
        assert out == "" and len(err.strip().splitlines()) == 1, (flags, err)
        assert "Traceback" not in err and match in err, (flags, err)


def test_help_names_every_method(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for method in METHODS:
        assert method in text
    assert "--on-non-finite" in text and "--resume" in text


def test_flags_parse_back_into_the_config_they_were_written_from():
    from mtdao.train.command import config_from_argv, config_to_argv
    from mtdao.train.config import TrainConfig

    config = TrainConfig.of(method="diloco", sync_delay=2, sync_fragments=4, sync_dtype=("int8",))
    assert config_from_argv(config_to_argv(config)) == config
    assert config_from_argv(["--sync-fragments=4"]).sync.sync_fragments == 4
