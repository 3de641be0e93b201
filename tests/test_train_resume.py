"""Checkpoint and resume: a resumed run is the same run, and bad resumes fail with one clear line.

Every run here is the tiny model on 2 workers, batch 2, 32 tokens, a dozen steps, on a ~200 KB
text directory written by the test (no download, fast to load).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mtdao.train import trainer
from mtdao.train.checkpoint import store as ckpt
from mtdao.train.config import TrainConfig
from mtdao.train.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread", "no_plot")


def tiny_config(out: Path, data: Path, **overrides) -> TrainConfig:
    values = dict(
        model="tiny",
        workers=2,
        sync_period=4,
        batch_size=2,
        seq_len=32,
        steps=12,
        eval_every=4,
        eval_tokens=256,
        log_every=1,
        data=str(data),
        out=str(out),
        device="cpu",
        progress=False,
    )
    values.update(overrides)
    return TrainConfig.of(**values)


class Interrupted(Exception):
    pass


def train_until_interrupted(monkeypatch, config: TrainConfig, stop_after: int) -> None:
    """Run ``config`` as if the process died right after step ``stop_after``."""
    real_step = trainer.train_step

    def dying_step(run):
        if run.step == stop_after:
            raise Interrupted
        return real_step(run)

    with monkeypatch.context() as patch:
        patch.setattr(trainer, "train_step", dying_step)
        with pytest.raises(Interrupted):
            trainer.train(config)


def load_final_state(run_dir: Path) -> dict:
    return torch.load(ckpt.checkpoint_path(run_dir) / "rank0.pt", weights_only=True)


def assert_same_tree(a, b, where: str = "state") -> None:
    """Exact equality of nested checkpoint contents (tensors with torch.equal)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for key in a:
            assert_same_tree(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def assert_runs_equal(reference_dir: Path, resumed_dir: Path, reference: dict, resumed: dict):
    ref_state, res_state = load_final_state(reference_dir), load_final_state(resumed_dir)
    for key in ("step", "params", "optimizer", "sync", "shards", "torch_rng"):
        assert_same_tree(ref_state[key], res_state[key], key)
    for key in ("steps", "tokens", "final_val_loss", "bytes_per_worker", "comm_reduction_vs_ddp"):
        assert resumed[key] == reference[key], key
    assert resumed["comm_events"] == reference["comm_events"]

    def train_losses(run_dir):
        return [(r["step"], r["train_loss"]) for r in read_metrics(run_dir) if "train_loss" in r]

    assert train_losses(resumed_dir) == train_losses(reference_dir)


# -- a resumed run is the same run ----------------------------------------------------------------


@pytest.mark.parametrize("method", ["mtdao", "diloco"])
def test_interrupted_run_resumes_exactly(tmp_path, corpus_dir, monkeypatch, method):
    """Crash after step 6 (inside a K=4 round), resume: bit-identical to the uninterrupted run.

    diloco also carries the outer Nesterov momentum and the anchor across the checkpoint.
    """
    reference = trainer.train(tiny_config(tmp_path / "reference", corpus_dir, method=method))

    out = tmp_path / "resumed"
    config = tiny_config(out, corpus_dir, method=method, checkpoint_every=3)
    train_until_interrupted(monkeypatch, config, stop_after=6)
    assert ckpt.load_meta(out)["step"] == 6
    resumed = trainer.train(tiny_config(out, corpus_dir, method=method, resume=True))

    assert_runs_equal(tmp_path / "reference", out, reference, resumed)
    if method == "diloco":
        assert load_final_state(out)["sync"]["outer"] is not None


def test_resume_inside_the_beta_warmup_with_an_outer_step(tmp_path, corpus_dir, monkeypatch):
    """The warm-up is a function of the step and the outer momentum is checkpointed: exact."""
    variant = dict(betas=(0.9, 0.99), omegas=(0.4, 0.5), beta_warmup=0.75, outer_step="nesterov")
    reference = trainer.train(tiny_config(tmp_path / "reference", corpus_dir, **variant))

    out = tmp_path / "resumed"
    train_until_interrupted(
        monkeypatch, tiny_config(out, corpus_dir, checkpoint_every=3, **variant), 6
    )
    resumed = trainer.train(tiny_config(out, corpus_dir, resume=True, **variant))

    assert_runs_equal(tmp_path / "reference", out, reference, resumed)
    assert load_final_state(out)["sync"]["outer"] is not None


def test_extending_a_finished_run_matches_one_long_run(tmp_path, corpus_dir):
    """--steps 6, then --resume --steps 12 --extend: equal to 12 steps straight when the LR does
    not depend on the length of the run (a cosine schedule does: see test_train_extend.py)."""
    flat = dict(schedule="constant", warmup=0.0, beta_warmup=0.0)
    reference = trainer.train(tiny_config(tmp_path / "reference", corpus_dir, **flat))

    out = tmp_path / "extended"  # (a final round at step 6 would make another run)
    trainer.train(tiny_config(out, corpus_dir, steps=6, final_round=False, **flat))
    resumed = trainer.train(
        tiny_config(out, corpus_dir, steps=12, resume=True, extend=True, **flat)
    )

    assert_runs_equal(tmp_path / "reference", out, reference, resumed)


# -- resumes that must be refused -----------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, corpus_dir) -> Path:
    """A finished 2-step run with its final checkpoint (not to be modified: copy it first)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    trainer.train(tiny_config(out, corpus_dir, steps=2))
    return out


def copy_run(finished_run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    return out


@pytest.mark.parametrize(
    "change, field",
    [({"lr": 1e-3}, "lr"), ({"method": "diloco"}, "method"), ({"workers": 4}, "workers")],
)
def test_resume_refuses_a_changed_config(finished_run, corpus_dir, change, field):
    config = tiny_config(finished_run, corpus_dir, steps=4, resume=True, **change)
    with pytest.raises(ckpt.CheckpointError, match=rf"config differs.*\b{field}:"):
        trainer.train(config)


def test_resume_says_where_it_resumed_and_reads_an_older_config(
    finished_run, corpus_dir, tmp_path, capsys
):
    """A meta.json config with unset (null) fields, as older versions wrote it, is resolved."""
    out = copy_run(finished_run, tmp_path)
    meta_path = ckpt.checkpoint_path(out) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["config"] = tiny_config(out, corpus_dir, steps=2).to_dict()
    assert meta["config"]["lr"] is None
    meta_path.write_text(json.dumps(meta))
    results = trainer.train(tiny_config(out, corpus_dir, steps=3, resume=True, extend=True))
    assert results["steps"] == 3
    assert "resumed from step 2 of 3" in capsys.readouterr().err


def test_resume_refuses_a_checkpoint_without_sync_events(finished_run, corpus_dir, tmp_path):
    """Its files verify and load, but a part of the run's state is missing (an edited file,
    its checksum fixed): refused in one line, as not fitting the run (no traceback, no guess at
    an older version); with no checkpoint before it, nothing is left to resume from."""
    from test_checkpoint_forged import forge

    out = copy_run(finished_run, tmp_path)
    newest = ckpt.checkpoint_path(out)
    state = torch.load(newest / "rank0.pt", weights_only=True)
    del state["sync"]["events"]
    forge(newest, "rank0.pt", saved_bytes(state))
    with pytest.raises(ckpt.CheckpointError, match="does not fit this run.*holds no events"):
        trainer.train(tiny_config(out, corpus_dir, steps=2, resume=True))


@pytest.mark.parametrize("part", ["clock", "evals"])
def test_resume_refuses_a_checkpoint_whose_unchecked_part_breaks_the_restore(
    finished_run, corpus_dir, tmp_path, part
):
    """A part no fit check reads (the clock, the evaluations) that is not what the run saves:
    the run is half restored when it fails, so the resume stops in one line that names the
    checkpoint and how to resume from the one before (no traceback)."""
    from test_checkpoint_forged import forge

    out = copy_run(finished_run, tmp_path)
    newest = ckpt.checkpoint_path(out)
    state = torch.load(newest / "rank0.pt", weights_only=True)
    state[part] = 5
    forge(newest, "rank0.pt", saved_bytes(state))
    with pytest.raises(ckpt.CheckpointError) as refused:
        trainer.train(tiny_config(out, corpus_dir, steps=2, resume=True))
    message = str(refused.value)
    assert message.startswith(f"--resume: {newest} cannot be restored into this run (TypeError: ")
    assert message.endswith(
        f"; rename it to {newest.name}.damaged to resume from the one before it"
    )
    assert "\n" not in message


def saved_bytes(value) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def test_resume_from_a_truncated_checkpoint(finished_run, corpus_dir, tmp_path):
    out = copy_run(finished_run, tmp_path)
    weights = ckpt.checkpoint_path(out) / "rank0.pt"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ckpt.CheckpointError, match="corrupted or incomplete"):
        trainer.train(tiny_config(out, corpus_dir, steps=2, resume=True))


def test_resume_past_the_requested_steps(finished_run, corpus_dir):
    with pytest.raises(ckpt.CheckpointError, match="past --steps 1"):
        trainer.train(tiny_config(finished_run, corpus_dir, steps=1, resume=True))


def test_new_run_refuses_a_directory_holding_a_run(finished_run, corpus_dir):
    with pytest.raises(ValueError, match=r"already holds a run \(config.json, .*\); pass --resume"):
        trainer.train(tiny_config(finished_run, corpus_dir, steps=2))


def test_checkpoint_directory_after_a_run(finished_run):
    """Only the final checkpoint is left: no staging or previous directory, no temporary files."""
    assert sorted(p.name for p in finished_run.iterdir() if p.name.startswith("checkpoint")) == [
        "checkpoints"
    ]
    assert sorted(p.name for p in (finished_run / "checkpoints").iterdir()) == ["step-00000002"]
    final = finished_run / "checkpoints" / "step-00000002"
    assert sorted(p.name for p in final.iterdir()) == ["meta.json", "rank0.pt"]
    meta = json.loads((final / "meta.json").read_text())
    assert meta["step"] == 2 and meta["world_size"] == 1 and meta["config"]["steps"] == 2


# -- checkpoint files themselves ------------------------------------------------------------------


def test_failed_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch):
    ckpt.save_checkpoint(tmp_path, 0, 1, {"step": 1, "x": torch.ones(3)}, {"step": 1})

    def failing_save(obj, handle):
        handle.write(b"half a file")
        raise OSError("disk full")

    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", failing_save)
        with pytest.raises(ckpt.CheckpointError, match="disk full"):
            ckpt.save_checkpoint(tmp_path, 0, 1, {"step": 2, "x": torch.zeros(3)}, {"step": 2})

    assert ckpt.load_meta(tmp_path)["step"] == 1
    state = ckpt.load_checkpoint(tmp_path, 0, 1)
    assert state["step"] == 1 and torch.equal(state["x"], torch.ones(3))
    # the next successful save replaces it and clears the staging directory
    ckpt.save_checkpoint(tmp_path, 0, 1, {"step": 3, "x": torch.zeros(3)}, {"step": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]
    assert ckpt.load_checkpoint(tmp_path, 0, 1)["step"] == 3


def test_checkpoint_of_another_world_size_is_refused(tmp_path):
    ckpt.save_checkpoint(tmp_path, 0, 1, {"step": 1}, {"step": 1})
    with pytest.raises(ckpt.CheckpointError, match="written by 1 process"):
        ckpt.load_checkpoint(tmp_path, 0, 4)


def test_checkpoint_saving_refuses_arbitrary_objects(tmp_path):
    """Only what the safe (weights_only) loader reads back may be saved: else it never resumes."""
    with pytest.raises(ckpt.CheckpointError, match="payload is a Interrupted, which a safe load"):
        ckpt.save_checkpoint(tmp_path, 0, 1, {"step": 1, "payload": Interrupted()}, {"step": 1})
    assert not ckpt.list_checkpoints(tmp_path)
