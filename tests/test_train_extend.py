"""Extending a run is deliberate: ``--resume`` with the run's own ``--steps`` is its exact
continuation; another ``--steps`` is refused unless ``--extend``, which re-plans the schedules and
says what that does (exact for wsd resumed in its stable phase, a learning-rate jump otherwise).
"""

from __future__ import annotations

import json

import pytest
from test_train_cli import assert_one_line_error, tiny_args
from test_train_resume import assert_runs_equal, tiny_config, train_until_interrupted

from mtdao.train import trainer
from mtdao.train.config import resolve
from mtdao.train.metrics import read_metrics
from mtdao.train.schedule import lr_schedule_of

pytestmark = pytest.mark.usefixtures("one_thread")


def lr_at(config, step: int) -> float:
    """The learning rate of the step after ``step`` steps under ``config``'s plan."""
    return lr_schedule_of(resolve(config))(step)


def test_more_steps_without_extend_is_refused_with_both_learning_rates(
    tmp_path, corpus_dir, capsys
):
    out = tmp_path / "run"
    trainer.train(tiny_config(out, corpus_dir, steps=12))
    before = (out / "metrics.jsonl").read_bytes()
    old = lr_at(tiny_config(out, corpus_dir, steps=12), 12)
    new = lr_at(tiny_config(out, corpus_dir, steps=24), 12)
    args = tiny_args(out, corpus_dir, "--steps", "24", "--resume")  # the last --steps counts
    assert_one_line_error(
        capsys,
        args,
        "--resume: --steps 24 differs from the run's 12 (checkpoint at step 12). Keep --steps 12 "
        "to continue it exactly, or pass --extend to re-plan it: this re-stretches the wsd "
        f"schedule: the learning rate jumps from {old:.4g} to {new:.4g} at step 13",
    )
    assert (out / "metrics.jsonl").read_bytes() == before


def test_wsd_extended_in_its_stable_phase_is_the_longer_run(
    tmp_path, corpus_dir, capsys, monkeypatch
):
    """12 wsd steps (decay from step 10) stopped after step 8, then --steps 20 --extend: exactly
    the run that had --steps 20 from the start (both warm up for 1 step: the default, at most
    half the run, would be 6 and 10; the beta warm-up, a fraction of the run, is off)."""
    wsd = dict(schedule="wsd", checkpoint_every=4, beta_warmup=0.0, warmup_steps=1)
    reference = trainer.train(tiny_config(tmp_path / "reference", corpus_dir, steps=20, **wsd))
    out = tmp_path / "extended"
    train_until_interrupted(monkeypatch, tiny_config(out, corpus_dir, **wsd), stop_after=8)
    capsys.readouterr()
    extended = trainer.train(
        tiny_config(out, corpus_dir, steps=20, resume=True, extend=True, **wsd)
    )

    assert (
        "--extend: re-planned from 12 to 20 steps at step 8: exact here" in capsys.readouterr().err
    )
    assert_runs_equal(tmp_path / "reference", out, reference, extended)
    assert [e["val_loss"] for e in extended["evals"]] == [e["val_loss"] for e in reference["evals"]]
    (record,) = extended["extensions"]
    assert record["step"] == 8 and (record["from_steps"], record["to_steps"]) == (12, 20)
    assert record["exact"] is True


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_extending_a_finished_run_restretches_and_says_so(tmp_path, corpus_dir, capsys, schedule):
    """A finished cosine run, or a wsd run past its decay start: the plan of 16 steps has another
    learning rate at step 13 than the one the run had planned; the run takes it, says so, and
    records it in results.json."""
    out = tmp_path / "run"
    trainer.train(tiny_config(out, corpus_dir, steps=12, schedule=schedule))
    planned = lr_at(tiny_config(out, corpus_dir, steps=12, schedule=schedule), 12)
    replanned = lr_at(tiny_config(out, corpus_dir, steps=16, schedule=schedule), 12)
    assert replanned > planned
    capsys.readouterr()
    results = trainer.train(
        tiny_config(out, corpus_dir, steps=16, schedule=schedule, resume=True, extend=True)
    )

    assert (
        f"this re-stretches the {schedule} schedule: the learning rate jumps from "
        f"{planned:.4g} to {replanned:.4g} at step 13" in capsys.readouterr().err
    )
    lr_of_step = {r["step"]: r["lr"] for r in read_metrics(out) if "lr" in r}
    assert lr_of_step[13] == replanned and results["steps"] == 16
    (record,) = json.loads((out / "results.json").read_text())["extensions"]
    assert record["exact"] is False and (record["lr_planned"], record["lr_new"]) == (
        planned,
        replanned,
    )
