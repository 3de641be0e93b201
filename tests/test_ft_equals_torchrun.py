"""A fault-tolerant run with no failure is the torchrun run, bit for bit, with every round option on:
two ``mtdao train --fault-tolerant`` replicas and ``torchrun --nproc-per-node 2 -m mtdao train``
with delayed, fragmented, int8 rounds and error feedback end with the same parameters, optimizer
states, anchors, residuals and rounds in flight on every worker (``--no-final-round``); with the
final round, every worker and replica ends with one and the same model. (Both are the simulated workers
bit for bit in what the rounds compute: tests/test_ft_communicator.py; a whole simulated run
differs from real processes in the model's own arithmetic, to float tolerance:
tests/test_train_torchrun.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_ft_communicator import assert_same
from wait_limits import limit_s

from mtdao.testing.fault_drill import Drill
from mtdao.train.command import config_to_argv
from mtdao.train.config import TrainConfig

pytest.importorskip("torchft")

pytestmark = pytest.mark.slow

STEPS = 16
FLAGS = dict(workers=2, model="micro", steps=STEPS, sync_period=4, batch_size=2, seq_len=32)
FLAGS.update(eval_every=8, eval_tokens=512, log_every=4, device="cpu", progress=False)
FLAGS.update(sync_delay=2, sync_fragments=2, sync_dtype=("int8",), error_feedback=True)
PROCESSES = 2 * FLAGS["workers"]  # the replicas and torchrun's workers, at once
REPLICA_LIMIT_S = limit_s(steps=STEPS, processes=PROCESSES)  # launch to exit
TORCHRUN_LIMIT_S = limit_s(starts=2, steps=STEPS, processes=PROCESSES)  # torchrun, then workers


def final_state(run_dir: Path, rank: int) -> dict:
    step_dir = run_dir / "checkpoints" / f"step-{STEPS:08d}"
    return torch.load(step_dir / f"rank{rank}.pt", weights_only=False)


def train_both(corpus_dir, root: Path, final_round: bool) -> dict[str, list[dict]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    flags = dict(FLAGS, final_round=final_round)
    config = TrainConfig.of(data=str(corpus_dir), out=str(root / "torchrun"), **flags)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    argv += ["2", "-m", "mtdao", "train", *config_to_argv(config)]
    job = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    flags = config_to_argv(TrainConfig.of(data=str(corpus_dir), **flags))
    with Drill(root / "ft", flags) as drill:
        drill.start_lighthouse(min_replicas=2)
        for replica in range(2):
            drill.start(f"r{replica}", replica)
        exits = [drill.wait_exit(f"r{replica}", REPLICA_LIMIT_S) for replica in range(2)]
        assert exits == [0, 0], drill.tails()
        drill.stop("lighthouse")
    output, _ = job.communicate(timeout=TORCHRUN_LIMIT_S)
    assert job.returncode == 0, output.decode()[-4000:]
    return {
        "torchrun": [final_state(root / "torchrun", rank) for rank in range(2)],
        "fault-tolerant": [final_state(root / "ft" / f"r{replica}", 0) for replica in range(2)],
    }


@pytest.fixture(scope="module")
def runs(corpus_dir, tmp_path_factory) -> dict[str, list[dict]]:
    return train_both(corpus_dir, tmp_path_factory.mktemp("ft-torchrun"), final_round=False)


@pytest.fixture(scope="module")
def final_runs(corpus_dir, tmp_path_factory) -> dict[str, list[dict]]:
    return train_both(corpus_dir, tmp_path_factory.mktemp("ft-torchrun-final"), final_round=True)


def test_fault_tolerant_replicas_are_the_torchrun_workers_bit_for_bit(runs):
    for worker, (real, replica) in enumerate(zip(runs["torchrun"], runs["fault-tolerant"])):
        assert real["step"] == replica["step"] == STEPS
        assert_same(real["params"], replica["params"], f"worker {worker} params")
        assert_same(real["optimizer"]["state"], replica["optimizer"]["state"], "optimizer")
        for key in ("step", "anchors", "pending", "pseudo_gradients", "alignment"):
            assert_same(real["sync"][key], replica["sync"][key], f"worker {worker} {key}")
        assert real["sync"]["pending"], "the runs end with a round in flight"
        assert real["sync"]["traffic"]["bytes"] == replica["sync"]["traffic"]["bytes"]
    first, second = (state["params"]["embed.weight"] for state in runs["torchrun"])
    assert not torch.equal(first, second)  # each worker keeps its own last D steps


def test_with_the_final_round_every_worker_and_replica_ends_with_one_model(final_runs):
    states = [*final_runs["torchrun"], *final_runs["fault-tolerant"]]
    for worker, state in enumerate(states[1:], start=1):
        assert state["step"] == STEPS
        assert_same(states[0]["params"], state["params"], f"worker {worker} params")
        assert_same(states[0]["optimizer"]["state"], state["optimizer"]["state"], "optimizer")
        assert state["sync"]["pending"] == []  # the rounds in flight landed first
        assert state["sync"]["events"] == states[0]["sync"]["events"]
    assert states[0]["sync"]["events"][-1]["final"]
