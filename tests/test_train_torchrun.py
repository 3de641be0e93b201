"""``mtdao train`` under torchrun (two real gloo processes on loopback) is the simulated 2-worker
run. The runs follow one another in one job's two processes (tests/torchrun_train_runs.py);
``torchrun -m mtdao train`` itself runs in tests/test_train_restarts.py.

Each process reads the same data shard as the simulated worker of its rank, so the final validation
loss and the bytes sent per worker must agree to float tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torchrun_job
from sessions import killed_at_exit
from wait_limits import TINY_STEP, limit_s

from mtdao.train import trainer
from mtdao.train.command import config_to_argv
from mtdao.train.config import TrainConfig

RUNS_SCRIPT = Path(__file__).with_name("torchrun_train_runs.py")

# run name -> config fields besides FLAGS; the last one delays, splits and quantizes its rounds
RUNS = {
    "mtdao": dict(method="mtdao"),
    "diloco": dict(method="diloco"),
    "mtdao-overlap": dict(
        method="mtdao", sync_delay=2, sync_fragments=2, sync_dtype=("int8",), error_feedback=True
    ),
}
FLAGS = dict(
    workers=2, steps=8, sync_period=4, model="tiny", batch_size=2, seq_len=32, eval_every=4
)
FLAGS.update(eval_tokens=512, log_every=4, device="cpu", progress=False)
# one job: torchrun's start, then its processes', and each run's setup (data, model, an
# evaluation: about a start's work) and steps, one run after the other
JOB_S = limit_s(
    starts=1 + len(RUNS), steps=len(RUNS) * FLAGS["steps"] * TINY_STEP, processes=FLAGS["workers"]
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is unavailable"),
]


def train_flags(run: str, data: Path, out: Path) -> list[str]:
    config = TrainConfig.of(data=str(data), out=str(out), **FLAGS, **RUNS[run])
    return config_to_argv(config)


@pytest.fixture(scope="module")
def torchrun_results(corpus_dir, tmp_path_factory) -> dict[str, dict]:
    """Every run's results, from one torchrun job that runs them in turn."""
    root = tmp_path_factory.mktemp("torchrun")
    runs = [json.dumps(train_flags(run, corpus_dir, root / run)) for run in RUNS]
    job = torchrun_job.start([str(RUNS_SCRIPT), *runs], processes=FLAGS["workers"])
    with killed_at_exit(job):
        output = job.communicate(timeout=JOB_S)[0]
    assert job.returncode == 0, output[-8000:]
    # only rank 0 prints a run's summary line
    assert output.count('"final_val_loss"') == len(RUNS), output[-8000:]
    return {run: json.loads((root / run / "results.json").read_text()) for run in RUNS}


@pytest.mark.parametrize("run", RUNS)
def test_torchrun_equals_simulated(run, corpus_dir, torchrun_results, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = TrainConfig.of(data=str(corpus_dir), out=str(tmp_path), **FLAGS, **RUNS[run])
        simulated = trainer.train(config)
    finally:
        torch.set_num_threads(threads)
    real = torchrun_results[run]

    assert real["simulated"] is False and simulated["simulated"] is True
    assert real["steps"] == simulated["steps"] == FLAGS["steps"]
    assert real["final_val_loss"] == pytest.approx(simulated["final_val_loss"], abs=1e-5)
    for real_eval, simulated_eval in zip(real["evals"], simulated["evals"], strict=True):
        assert real_eval["val_loss"] == pytest.approx(simulated_eval["val_loss"], abs=1e-5)
    assert real["bytes_per_worker"] == simulated["bytes_per_worker"] > 0
    assert real["bytes_by_kind"] == simulated["bytes_by_kind"]
    assert real["comm_events"] == simulated["comm_events"]
    assert real["parameters"] == simulated["parameters"]
