"""The harness never loses a run: checkpoints kept and never diverged, one run per directory, no run
replaced by accident, a resume with nothing to resume from, and the causes a NaN is blamed on.

Failures are injected in-process (a NaN written into a state, a lock held by this process, a
monkeypatched step); every run is the tiny model on 2 simulated workers for a dozen steps.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from test_train_cli import assert_one_line_error, tiny_args
from test_train_resume import assert_runs_equal, tiny_config, train_until_interrupted

from mtdao.cli import main
from mtdao.state_files import first_unsavable
from mtdao.train import trainer
from mtdao.train.checkpoint.checkpointer import Checkpointer
from mtdao.train.metrics import read_metrics
from mtdao.train.run_lock import RunLock

pytestmark = pytest.mark.usefixtures("one_thread", "no_plot")


def checkpoint_names(run_dir: Path) -> list[str]:
    return sorted(path.name for path in (run_dir / "checkpoints").iterdir())


def poison_after(monkeypatch, step: int, poison) -> None:
    """Call ``poison(run)`` right after optimizer step ``step`` (before the loop's checks)."""
    real_step = trainer.train_step

    def step_then_poison(run):
        losses = real_step(run)
        if run.step == step:
            poison(run)
        return losses

    monkeypatch.setattr(trainer, "train_step", step_then_poison)


def nan_in_second_moment(run) -> None:
    first = next(iter(run.optimizer.state.values()))
    first["exp_avg_sq"].view(-1)[0] = float("nan")


# -- checkpoints: the newest N, never a diverged one ------------------------------------------------


CHECKPOINTS = dict(checkpoint_every=2, keep_checkpoints=3)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_dir) -> tuple[Path, dict]:
    """12 steps, checkpoints every 2, the newest 3 kept: the run the interrupted ones must equal."""
    out = tmp_path_factory.mktemp("reference") / "run"
    return out, trainer.train(tiny_config(out, corpus_dir, **CHECKPOINTS))


def test_keeps_the_newest_checkpoints_and_saves_the_last_step_once(reference):
    # step 12 is saved by the loop; the final save does not write it a second time
    assert checkpoint_names(reference[0]) == ["step-00000008", "step-00000010", "step-00000012"]


def test_a_diverged_state_never_replaces_the_last_good_checkpoint(
    tmp_path, corpus_dir, capsys, monkeypatch
):
    """A NaN second moment after step 5 (no round due, the loss still finite): the save at step 5
    is refused in one line naming the step, the tensor and the last finite checkpoint, which stays
    on disk with the one before it, and the run resumes from it."""
    out = tmp_path / "run"
    args = tiny_args(out, corpus_dir, "--steps", "12", "--checkpoint-every", "1")
    with monkeypatch.context() as patch:
        poison_after(patch, 5, nan_in_second_moment)
        assert_one_line_error(
            capsys,
            args,
            r"checkpoint at step 5 refused, nothing written: optimizer.state.0.exp_avg_sq holds "
            f"NaN/inf; the last finite checkpoint is {out}/checkpoints/step-00000004 (step 4)",
        )
    assert checkpoint_names(out) == ["step-00000003", "step-00000004"]
    for name in checkpoint_names(out):
        state = torch.load(out / "checkpoints" / name / "rank0.pt", weights_only=True)
        assert first_unsavable(state) is None
    assert main([*args, "--resume"]) == 0
    assert json.loads((out / "results.json").read_text())["steps"] == 12


# -- one run per directory, never replaced by accident ----------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, corpus_dir) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    trainer.train(tiny_config(out, corpus_dir, steps=2))
    return out


def snapshot_files(run_dir: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(run_dir)): path.read_bytes()
        for path in sorted(run_dir.rglob("*"))
        if path.is_file() and path.name != "run.lock"
    }


def test_a_second_run_on_a_directory_in_use_is_refused_naming_the_holder(
    finished_run, corpus_dir, capsys
):
    before = snapshot_files(finished_run)
    args = tiny_args(finished_run, corpus_dir, "--steps", "2", "--resume")
    with RunLock(finished_run):  # another run holds it (this process, through another descriptor)
        assert_one_line_error(capsys, args, f"is in use by another run (pid {os.getpid()})")
    assert snapshot_files(finished_run) == before
    # the lock dies with its holder: the same command now runs (and releases it when done)
    assert main(args) == 0
    RunLock(finished_run).acquire().release()


def test_the_lock_is_released_when_a_run_fails(tmp_path, corpus_dir, capsys):
    out = tmp_path / "run"
    assert_one_line_error(capsys, tiny_args(out, corpus_dir, "--lr", "1e6"), "NaN/inf")
    RunLock(out).acquire().release()


def test_out_naming_a_file_is_refused(tmp_path, corpus_dir, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    assert_one_line_error(capsys, tiny_args(a_file, corpus_dir), "is an existing file, not a dir")
    assert a_file.read_text() == "mine"


def test_a_fresh_run_never_replaces_a_run_without_overwrite(tmp_path, corpus_dir, capsys):
    """A directory with only metrics.jsonl (a run that died before its first checkpoint) holds a
    run: refused. --overwrite deletes the run's files, and only those."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 10, "train_loss": 3.0}\n')
    (out / "notes.txt").write_text("mine")
    args = tiny_args(out, corpus_dir)
    assert_one_line_error(capsys, args, "already holds a run (metrics.jsonl); pass --resume")
    assert (out / "metrics.jsonl").read_text() == '{"step": 10, "train_loss": 3.0}\n'

    assert main([*args, "--overwrite"]) == 0
    assert "--overwrite: deleted metrics.jsonl from" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "mine"
    assert [r["step"] for r in read_metrics(out) if "val_loss" in r] == [1, 2, 3, 4]


def test_resume_with_no_checkpoint_yet_starts_fresh_and_says_so(
    reference, tmp_path, corpus_dir, capsys, monkeypatch
):
    """The first attempt dies during step 2, before its first checkpoint: the same command line
    starts fresh, says so, and gives the uninterrupted run."""
    out = tmp_path / "run"
    config = tiny_config(out, corpus_dir, resume=True, **CHECKPOINTS)

    def dying_step(run):
        raise KeyboardInterrupt  # killed during step 2

    with monkeypatch.context() as patch:
        poison_after(patch, 2, dying_step)
        with pytest.raises(KeyboardInterrupt):
            trainer.train(config)
    assert not (out / "checkpoints").exists() and (out / "metrics.jsonl").stat().st_size > 0
    capsys.readouterr()
    resumed = trainer.train(config)
    assert f"--resume: no checkpoint in {out} yet; starting fresh" in capsys.readouterr().err
    assert_runs_equal(reference[0], out, reference[1], resumed)


def test_resume_with_no_checkpoint_refuses_another_runs_directory(tmp_path, corpus_dir, capsys):
    out = tmp_path / "run"
    out.mkdir()
    other = tiny_config(out, corpus_dir, lr=1e-3).to_dict()
    (out / "config.json").write_text(json.dumps(other))
    assert_one_line_error(
        capsys,
        tiny_args(out, corpus_dir, "--resume"),
        "has no checkpoint yet, and its config.json is another run's (lr: 0.001 -> 0.008",
    )
    assert json.loads((out / "config.json").read_text()) == other


def test_resume_never_starts_a_run_among_files_that_are_not_a_runs(tmp_path, corpus_dir, capsys):
    """--resume with a mistyped --out (a folder of the user's own): refused, nothing written."""
    out = tmp_path / "documents"
    (out / "photos").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    assert_one_line_error(
        capsys,
        tiny_args(out, corpus_dir, "--resume"),
        f"--resume: {out} holds no run to resume, but other files (notes.txt, photos); a run is "
        "not started among them: give --out a new or empty directory",
    )
    assert sorted(path.name for path in out.iterdir()) == ["notes.txt", "photos"]


@pytest.mark.parametrize("resume", [[], ["--resume"]], ids=["fresh", "resume"])
def test_a_failed_start_leaves_nothing_behind(tmp_path, capsys, resume):
    """A run that stops before it writes anything (here: no such data) removes its lock file and
    the directories it made; an existing directory is left as it was found."""
    missing = tmp_path / "no-such-corpus"
    made = tmp_path / "new" / "run"
    assert_one_line_error(capsys, tiny_args(made, missing, *resume), str(missing))
    assert list(tmp_path.iterdir()) == []
    existing = tmp_path / "empty"
    existing.mkdir()
    assert_one_line_error(capsys, tiny_args(existing, missing, *resume), str(missing))
    assert list(existing.iterdir()) == []


def test_a_repeated_resume_with_every_checkpoint_damaged_never_starts_over(
    tmp_path, corpus_dir, capsys
):
    """The first --resume finds the only checkpoint damaged and sets it aside; the next one (a
    restart policy's retry) must not take the run for one that never began: it stops, naming
    what was set aside, and leaves the run's files as they were."""
    out = tmp_path / "run"
    assert main(tiny_args(out, corpus_dir)) == 0
    (only,) = (out / "checkpoints").iterdir()
    weights = only / "rank0.pt"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    files = {name: (out / name).read_bytes() for name in ("metrics.jsonl", "results.json")}
    args = tiny_args(out, corpus_dir, "--resume")
    assert_one_line_error(capsys, args, "no usable checkpoint")
    assert checkpoint_names(out) == [f"{only.name}.damaged"]
    for _ in range(2):
        assert_one_line_error(capsys, args, f"set aside (checkpoints/{only.name}.damaged)")
    assert {name: (out / name).read_bytes() for name in files} == files
    assert checkpoint_names(out) == [f"{only.name}.damaged"]
    assert main([*tiny_args(out, corpus_dir), "--overwrite"]) == 0  # the operator's decision


def test_resume_of_a_finished_run_without_checkpoints_never_starts_over(
    tmp_path, corpus_dir, capsys
):
    out = tmp_path / "run"
    assert main(tiny_args(out, corpus_dir)) == 0
    shutil.rmtree(out / "checkpoints")
    results = (out / "results.json").read_text()
    assert_one_line_error(capsys, tiny_args(out, corpus_dir, "--resume"), "holds a finished run")
    assert (out / "results.json").read_text() == results


# -- what a NaN is blamed on ----------------------------------------------------------------------


def test_nan_at_the_first_step_after_a_resume_names_the_checkpoint(
    finished_run, tmp_path, corpus_dir, capsys, monkeypatch
):
    """A state that passed its checksums but is bad (injected into the restored run) turns the
    loss NaN at once: the message names the checkpoint, not only the learning rate."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    real_restore = Checkpointer.restore

    def bad_restore(self, run, start):
        start = real_restore(self, run, start)
        with torch.no_grad():
            run.workers.named_parameters()[0][1].fill_(float("nan"))
        return start

    monkeypatch.setattr(Checkpointer, "restore", bad_restore)
    checkpoint = out / "checkpoints" / "step-00000002"
    assert_one_line_error(
        capsys,
        tiny_args(out, corpus_dir, "--steps", "4", "--resume", "--extend"),
        f"training loss is NaN/inf at step 3 on every worker, the first step after resuming from "
        f"{checkpoint}: that checkpoint's state may be bad (rename it to step-00000002.damaged",
    )


# -- --on-non-finite skip: evaluation and checkpoints while a worker is left out -------------------


def test_skip_mode_evaluates_the_finite_workers_and_heals_before_a_checkpoint(
    tmp_path, corpus_dir, caplog, monkeypatch
):
    """Worker 1's parameters turn NaN after step 5 (K = 4: its next round is at step 8). The
    evaluations at steps 5 and 6 are of worker 0 alone and say so; the checkpoint at step 6 heals
    worker 1 first (counted as heal traffic), so it is finite and the run goes on to the end."""

    def nan_in_worker_1(run):
        with torch.no_grad():
            run.workers.named_parameters()[0][1][1].fill_(float("nan"))

    out = tmp_path / "run"
    config = tiny_config(out, corpus_dir, on_non_finite="skip", eval_every=1, checkpoint_every=6)
    poison_after(monkeypatch, 5, nan_in_worker_1)
    results = trainer.train(config)

    evals = {record["step"]: record for record in results["evals"]}
    assert all(torch.isfinite(torch.tensor(r["val_loss"])) for r in evals.values())
    assert evals[5]["excluded_workers"] == [1] and "excluded_workers" not in evals[4]
    assert "excluded_workers" not in evals[7]  # healed at the checkpoint of step 6
    assert "step 5: evaluating the average of the workers but [1]" in caplog.text
    (heal,) = results["skipped_rounds"]
    assert heal["step"] == 6 and heal["workers"] == [1] and heal["healed_tensors"] > 0
    assert results["bytes_by_kind"]["heal"] > 0
    meta = json.loads((out / "checkpoints" / "step-00000006" / "meta.json").read_text())
    assert meta["finite"] is True
    assert all(r["train_loss"] == r["train_loss"] for r in read_metrics(out) if "train_loss" in r)


def test_a_flipped_byte_in_the_newest_checkpoint_falls_back_and_ends_the_same(
    reference, tmp_path, corpus_dir, caplog, capsys, monkeypatch
):
    """A crash after step 9, one byte of step 8's file flipped: the resume names the file, sets
    it aside, continues from step 6 and ends as if nothing happened."""
    out = tmp_path / "run"
    train_until_interrupted(monkeypatch, tiny_config(out, corpus_dir, **CHECKPOINTS), 9)
    damaged = out / "checkpoints" / "step-00000008" / "rank0.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))

    resumed = trainer.train(tiny_config(out, corpus_dir, resume=True, **CHECKPOINTS))
    assert f"{damaged} is corrupted or incomplete (its xxh3_128 checksum differs)" in caplog.text
    assert (out / "checkpoints" / "step-00000008.damaged").is_dir()
    assert "resumed from step 6 of 12" in capsys.readouterr().err
    assert_runs_equal(reference[0], out, reference[1], resumed)


def test_a_torn_last_metrics_line_is_dropped_on_resume(
    reference, tmp_path, corpus_dir, caplog, monkeypatch
):
    """A crash in the middle of an append leaves half a line: the resume drops it, names the file
    and the line, and the metrics end as those of the uninterrupted run."""
    out = tmp_path / "run"
    train_until_interrupted(monkeypatch, tiny_config(out, corpus_dir, **CHECKPOINTS), 6)
    metrics = out / "metrics.jsonl"
    lines = len(metrics.read_text().splitlines())
    with open(metrics, "a") as handle:
        handle.write('{"step": 7, "train_lo')

    resumed = trainer.train(tiny_config(out, corpus_dir, resume=True, **CHECKPOINTS))
    assert (
        f"{metrics}: dropped line {lines + 1}, a record torn by an interrupted run" in caplog.text
    )
    assert_runs_equal(reference[0], out, reference[1], resumed)
