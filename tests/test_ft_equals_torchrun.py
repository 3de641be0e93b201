"""A fault-tolerant run with no failure is the torchrun run, bit for bit, with every round option on:
two ``mtdao train --fault-tolerant`` replicas and ``torchrun --nproc-per-node 2 -m mtdao train``
with delayed, fragmented, int8 rounds and error feedback hold the same parameters, optimizer
states, anchors, residuals and rounds in flight on every worker midway (a checkpoint taken with a
round in flight); with the final round, every worker and replica ends with one and the same model.
One run of each gives both checkpoints. (Both are the simulated workers bit for bit in what the
rounds compute: tests/test_ft_communicator.py; a whole simulated run differs from real processes
in the model's own arithmetic, to float tolerance: tests/test_train_torchrun.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchrun_job
from sessions import killed_at_exit
from test_ft_communicator import assert_same
from wait_limits import limit_s

from mtdao.testing.fault_drill import Drill
from mtdao.train.command import config_to_argv
from mtdao.train.config import TrainConfig

pytest.importorskip("torchft")

pytestmark = pytest.mark.slow

STEPS = 16
MIDWAY = 8  # rounds at 4 and 8, delayed by 2 steps: the one at 8 is in flight
FLAGS = dict(workers=2, model="micro", steps=STEPS, sync_period=4, batch_size=2, seq_len=32)
FLAGS.update(eval_every=8, eval_tokens=512, log_every=4, device="cpu", progress=False)
FLAGS.update(checkpoint_every=MIDWAY)  # kept: keep_checkpoints is 2
FLAGS.update(sync_delay=2, sync_fragments=2, sync_dtype=("int8",), error_feedback=True)
PROCESSES = 2 * FLAGS["workers"]  # the replicas and torchrun's workers, at once
REPLICA_LIMIT_S = limit_s(steps=STEPS, processes=PROCESSES)  # launch to exit
TORCHRUN_LIMIT_S = limit_s(starts=2, steps=STEPS, processes=PROCESSES)  # torchrun, then workers


def saved_state(run_dir: Path, rank: int, step: int) -> dict:
    step_dir = run_dir / "checkpoints" / f"step-{step:08d}"
    return torch.load(step_dir / f"rank{rank}.pt", weights_only=False)


@pytest.fixture(scope="module")
def runs(corpus_dir, tmp_path_factory) -> dict[int, dict[str, list[dict]]]:
    """{step: {"torchrun": [each rank's state], "fault-tolerant": [each replica's]}} at MIDWAY
    and at the end."""
    root = tmp_path_factory.mktemp("ft-torchrun")
    config = TrainConfig.of(data=str(corpus_dir), out=str(root / "torchrun"), **FLAGS)
    job = torchrun_job.start(["-m", "mtdao", "train", *config_to_argv(config)])
    flags = config_to_argv(TrainConfig.of(data=str(corpus_dir), **FLAGS))
    with killed_at_exit(job):
        with Drill(root / "ft", flags) as drill:
            drill.start_lighthouse(min_replicas=2)
            for replica in range(2):
                drill.start(f"r{replica}", replica)
            exits = [drill.wait_exit(f"r{replica}", REPLICA_LIMIT_S) for replica in range(2)]
            assert exits == [0, 0], drill.tails()
            drill.stop("lighthouse")
        output = job.communicate(timeout=TORCHRUN_LIMIT_S)[0]
    assert job.returncode == 0, output[-4000:]
    return {
        step: {
            "torchrun": [saved_state(root / "torchrun", rank, step) for rank in range(2)],
            "fault-tolerant": [saved_state(root / "ft" / f"r{r}", 0, step) for r in range(2)],
        }
        for step in (MIDWAY, STEPS)
    }


def test_fault_tolerant_replicas_are_the_torchrun_workers_bit_for_bit(runs):
    midway = runs[MIDWAY]
    for worker, (real, replica) in enumerate(zip(midway["torchrun"], midway["fault-tolerant"])):
        assert real["step"] == replica["step"] == MIDWAY
        assert_same(real["params"], replica["params"], f"worker {worker} params")
        assert_same(real["optimizer"]["state"], replica["optimizer"]["state"], "optimizer")
        for key in ("step", "anchors", "pending", "pseudo_gradients", "alignment"):
            assert_same(real["sync"][key], replica["sync"][key], f"worker {worker} {key}")
        assert real["sync"]["pending"], "a round is in flight midway"
        assert real["sync"]["traffic"]["bytes"] == replica["sync"]["traffic"]["bytes"]
    first, second = (state["params"]["embed.weight"] for state in midway["torchrun"])
    assert not torch.equal(first, second)  # each worker keeps its own last D steps


def test_with_the_final_round_every_worker_and_replica_ends_with_one_model(runs):
    states = [*runs[STEPS]["torchrun"], *runs[STEPS]["fault-tolerant"]]
    for worker, state in enumerate(states[1:], start=1):
        assert state["step"] == STEPS
        assert_same(states[0]["params"], state["params"], f"worker {worker} params")
        assert_same(states[0]["optimizer"]["state"], state["optimizer"]["state"], "optimizer")
        assert state["sync"]["pending"] == []  # the rounds in flight landed first
        assert state["sync"]["events"] == states[0]["sync"]["events"]
    assert states[0]["sync"]["events"][-1]["final"]
