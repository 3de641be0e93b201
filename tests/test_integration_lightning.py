"""mtdao.integrations.lightning: a Lightning run through the sync engine.

In one process: the optimizer and engine are the method's, the logs carry the traffic, a resume
continues bit for bit, bad settings are refused. Under torchrun with two gloo processes
(tests/integration_lightning_run.py and examples/lightning_trainer.py): the Lightning run equals
the README's plain loop over the same batches bit for bit, a resume from a checkpoint taken
mid-round (the workers differ) is exact, the ranks differ between syncs (no DDP all-reduce) and
agree after one (with the ddp method, at every step: the engine averages the gradients inside
Lightning's step), a run stopped between syncs ends with one model (the final round), validation
between syncs scores the workers' average, and the example prints its traffic and one model.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
import torchrun_job
from sessions import killed_at_exit
from wait_limits import limit_s

from mtdao.optim import MTAdam

pytestmark = pytest.mark.skipif(find_spec("lightning") is None, reason="needs the lightning extra")

ROOT = Path(__file__).resolve().parents[1]
# A Lightning process's start costs two of the model's, as a transformers one does (lightning
# beside torch); the checks run five Lightning fits and a plain loop in turn.
LIGHTNING_STARTS = 2
EPOCH_BATCHES = 5  # one process, batches of 4


@pytest.fixture(scope="module", autouse=True)
def lightning_imports() -> None:
    """Lightning and what this file takes from it, imported once its first test runs, not at
    collection: every test process collects every file, and these imports cost seconds of CPU."""
    global L, LocalUpdates, LocalUpdateStrategy, method_optimizer, RUN_STEPS, TinyLM, tokens
    import lightning as L
    from integration_lightning_run import RUN_STEPS, TinyLM, tokens

    from mtdao.integrations.lightning import LocalUpdates, LocalUpdateStrategy, method_optimizer


@pytest.fixture(autouse=True)
def one_process_group():
    """Lightning starts a process group of one (and sets MASTER_PORT) even for one device: both
    end with the test, so the next test in this process starts clean."""
    environ = dict(os.environ)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


def fit(out: Path, method: LocalUpdates, module=None, resume=None, **trainer_args):
    settings = dict(logger=False, enable_checkpointing=False, default_root_dir=out)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=LocalUpdateStrategy(method),
        enable_progress_bar=False,
        enable_model_summary=False,
        **{**settings, **trainer_args},
    )
    module = module or TinyLM()
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(tokens(4 * EPOCH_BATCHES, seed=3)), batch_size=4
    )
    trainer.fit(module, data, ckpt_path=resume)
    return trainer, module


def test_one_process_trains_with_the_methods_optimizer_and_engine(tmp_path):
    logger = L.pytorch.loggers.CSVLogger(tmp_path, name="")
    latest = L.pytorch.callbacks.ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=2)
    trainer, module = fit(
        tmp_path,
        LocalUpdates(sync_period=4),
        max_steps=6,
        logger=logger,
        log_every_n_steps=2,
        callbacks=[latest],
        enable_checkpointing=True,
    )
    strategy = trainer.strategy
    assert isinstance(trainer.optimizers[0], MTAdam)
    assert strategy.sync.step_count == 6
    assert strategy.model is module  # not wrapped in DistributedDataParallel
    with open(Path(logger.log_dir) / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row["sync_ddp_bytes_per_worker"]]
    # the latest checkpoint only (save_top_k=1): each one removed took its per-rank folder along
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "epoch=1-step=6.ckpt",
        "epoch=1-step=6.ckpt.mtdao",
    ]
    per_step = strategy.sync.traffic.ddp_bytes_per_step
    assert [float(row["sync_ddp_bytes_per_worker"]) for row in rows] == [
        2 * per_step,
        4 * per_step,
        6 * per_step,
    ]


def test_one_process_resume_is_exact(tmp_path):
    """DiLoCo's outer step keeps an anchor and a momentum: lost on resume, the run would differ.
    Two epochs of 5 steps, K = 4; the checkpoint at the end of the first is mid-round."""
    method = LocalUpdates(method="diloco", sync_period=4)
    saver = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path, save_top_k=-1, save_on_train_epoch_end=True
    )
    _, straight = fit(
        tmp_path / "a", method, max_epochs=2, callbacks=[saver], enable_checkpointing=True
    )
    checkpoint = tmp_path / f"epoch=0-step={EPOCH_BATCHES}.ckpt"
    assert (Path(f"{checkpoint}.mtdao") / "mtdao-rank0-of-1.pt").is_file()
    trainer, resumed = fit(tmp_path / "b", method, max_epochs=2, resume=checkpoint)
    assert trainer.strategy.sync.step_count == 2 * EPOCH_BATCHES
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_bad_settings_are_refused(tmp_path):
    class OwnOptimizer(TinyLM):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class OnAnotherStrategy(TinyLM):
        def configure_optimizers(self):
            return method_optimizer(self, 1e-3)

    with pytest.raises(ValueError, match="accumulate_grad_batches=1"):
        fit(tmp_path, LocalUpdates(), max_steps=1, accumulate_grad_batches=2)
    scaled = L.pytorch.plugins.MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="does not take precision='16-mixed'"):  # a GPU's
        fit(tmp_path, LocalUpdates(), max_steps=1, plugins=[scaled])
    with pytest.raises(ValueError, match="returns the one optimizer"):
        fit(tmp_path, LocalUpdates(), OwnOptimizer(), max_steps=1)
    with pytest.raises(ValueError, match="^`method`: unknown value 'lamb'"):
        fit(tmp_path, LocalUpdates(method="lamb"), max_steps=1)
    with pytest.raises(ValueError, match="one process per worker"):
        LocalUpdateStrategy(LocalUpdates(shards=2))
    with pytest.raises(ValueError, match="does not take find_unused_parameters"):
        LocalUpdateStrategy(find_unused_parameters=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False)
    with pytest.raises(ValueError, match="needs Trainer.strategy=LocalUpdateStrategy"):
        trainer.fit(OnAnotherStrategy(), torch.utils.data.DataLoader(tokens(4, seed=3)))


# -- two gloo processes --------------------------------------------------------------------------


def torchrun(script: Path, *args: str, processes: int = 2) -> subprocess.Popen:
    return torchrun_job.start([str(script), *args], processes=processes, standalone=False, cwd=ROOT)


# stopped between syncs (24 of K = 16): the final round makes one model
EXAMPLE_ARGS = ("--max-steps", "24", "--sync-period", "16", "--chars", "60000")


@pytest.fixture(scope="module")
def lightning_job(tmp_path_factory) -> dict:
    """One torchrun job: examples/lightning_trainer.py, then the checks, in the same two
    processes (tests/integration_lightning_run.py): each process's start costs more than its
    steps."""
    root = tmp_path_factory.mktemp("lightning-torchrun")
    job = torchrun(Path(__file__).parent / "integration_lightning_run.py", str(root), *EXAMPLE_ARGS)
    # torchrun's start, then its processes': the example's fit (its corpus, model and Trainer,
    # about a start's work) and 24 steps, then the checks' five fits and a plain loop
    starts = 1 + LIGHTNING_STARTS + 1
    steps = int(EXAMPLE_ARGS[1]) + 5 * RUN_STEPS + 3
    with killed_at_exit(job):
        output = job.communicate(timeout=limit_s(starts=starts, steps=steps, processes=2))[0]
    assert job.returncode == 0, output[-6000:]
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]
    return {"ranks": ranks, "output": output}


@pytest.mark.slow
def test_lightning_run_equals_the_plain_loop_bit_for_bit(lightning_job):
    for rank in lightning_job["ranks"]:
        assert rank["plain_loop_max_diff"] == 0.0
        assert rank["traffic_bytes"] > 0


@pytest.mark.slow
def test_resume_mid_round_is_exact_on_every_rank(lightning_job):
    for rank in lightning_job["ranks"]:
        assert rank["checkpoint_files"] == ["mtdao-rank0-of-2.pt", "mtdao-rank1-of-2.pt"]
        assert rank["resume_max_diff"] == 0.0
        assert rank["saved_at_validation_are_own"] is True
        assert rank["resumed_engine_step"] == RUN_STEPS


@pytest.mark.slow
def test_workers_drift_between_syncs_and_agree_after_one(lightning_job):
    """Under DDP the ranks would agree at every step: drifting proves no gradient all-reduce."""
    for rank in lightning_job["ranks"]:
        assert rank["agree_mid_round"] is False
        assert rank["agree_after_sync"] is True


@pytest.mark.slow
def test_the_ddp_method_averages_gradients_inside_lightnings_step(lightning_job):
    for rank in lightning_job["ranks"]:
        assert rank["ddp_agree_without_final_round"] is True


@pytest.mark.slow
def test_a_run_stopped_between_syncs_ends_with_one_model(lightning_job):
    for rank in lightning_job["ranks"]:
        assert rank["agree_at_end_between_syncs"] is True


@pytest.mark.slow
def test_validation_between_syncs_scores_the_global_model(lightning_job):
    for rank in lightning_job["ranks"]:
        assert abs(rank["val_loss_mid_round"] - rank["averaged_model_loss"]) < 1e-5
        assert abs(rank["own_model_loss"] - rank["averaged_model_loss"]) > 1e-4  # they differ


@pytest.mark.slow
def test_the_traffic_is_in_the_logged_metrics(lightning_job):
    for rank in lightning_job["ranks"]:
        logged = rank["logged_traffic"]
        assert logged["sync_bytes_per_worker"] == rank["traffic_bytes"]
        assert logged["sync_ddp_bytes_per_worker"] > logged["sync_bytes_per_worker"]
        assert logged["sync_rounds"] == 3


@pytest.mark.slow
def test_example_prints_the_traffic_and_identical_ranks(lightning_job):
    output = lightning_job["output"]
    assert output.count("ranks identical: True") == 1, output[-3000:]
    line = next(line for line in output.splitlines() if line.startswith("traffic:"))
    assert "in 2 rounds over 24 steps" in line and "less than DDP" in line
