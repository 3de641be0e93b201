"""Real worker processes (gloo on loopback): a killed worker restarted by ``torchrun
--max-restarts`` ends bit-identical to an uninterrupted run, with one command line for the first
start and the restart; a frozen worker ends the others within ``--collective-timeout``.

Every process is started in its own process group and killed with it in ``finally``; every wait
has a timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torchrun_job
from sessions import kill, killed_at_exit
from wait_limits import limit_s

from mtdao.testing.ports import unused_port
from mtdao.train.distributed import (
    CollectiveError,
    ProcessInfo,
    collective_errors,
    explain_collective_failure,
)
from mtdao.train.metrics import read_metrics

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is unavailable")

FLAGS = [
    *("--model", "micro", "--workers", "2", "--sync-period", "4", "--batch-size", "2"),
    *("--seq-len", "32", "--eval-tokens", "512", "--log-every", "1", "--no-progress"),
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


# -- the one-line errors of a failed collective (no processes) ------------------------------------

GLOO_TIMEOUT = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
    "3000ms for recv operation to complete"
)
GLOO_PEER_GONE = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:45196: "
    "Connection reset by peer. This is typically caused by a remote worker hanging"
)


def test_a_failed_collective_reads_as_one_line_naming_what_to_do():
    timeout = explain_collective_failure(RuntimeError(GLOO_TIMEOUT), 30.0)
    assert str(timeout) == (
        "no answer from another worker within 30 s (--collective-timeout 30): a peer is frozen, "
        "stalled or lost; raise --collective-timeout if the workers are only slow"
    )
    gone = str(explain_collective_failure(RuntimeError(GLOO_PEER_GONE), 30.0))
    assert gone.startswith("another worker ended or lost its connection during a collective (")
    assert "Read error [127.0.0.1]:45196: Connection reset by peer)" in gone
    assert "pair.cc" not in gone
    assert explain_collective_failure(ValueError(GLOO_TIMEOUT), 30.0) is None
    assert explain_collective_failure(RuntimeError("shape mismatch"), 30.0) is None

    two_processes = collective_errors(ProcessInfo(rank=0, world_size=2), 5.0)
    with pytest.raises(CollectiveError, match="--collective-timeout 5"), two_processes:
        raise RuntimeError(GLOO_TIMEOUT)
    one_process = collective_errors(ProcessInfo(), 5.0)  # no collective can fail there
    with pytest.raises(RuntimeError, match="Timed out"), one_process:
        raise RuntimeError(GLOO_TIMEOUT)


# -- real processes -------------------------------------------------------------------------------


def children(pid: int) -> dict[int, int]:
    """{RANK: pid} of the direct children of ``pid`` (torchrun's workers)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        ranks = [v[5:] for v in environ if v.startswith(b"RANK=")]
        if parent == pid and ranks:
            found[int(ranks[0])] = int(entry.name)
    return found


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def torchrun(out: Path, data: Path, *extra: str) -> subprocess.Popen:
    argv = ["--max-restarts", "1", "--monitor-interval", "0.1", "-m", "mtdao", "train", *FLAGS]
    return torchrun_job.start([*argv, "--data", str(data), "--out", str(out), *extra])


def complete_checkpoint(out: Path) -> bool:
    root = out / "checkpoints"
    return root.is_dir() and any(
        p.name.startswith("step-") and "." not in p.name for p in root.iterdir()
    )


# Two torchrun jobs of two workers at once: torchrun's start, then its workers', to the first
# checkpoint; after the kill, the restart (or the other job's rest) and every step.
STEPS, CHECKPOINT_EVERY, JOB_PROCESSES = 24, 4, 2 * 2
CHECKPOINT_S = limit_s(starts=2, steps=CHECKPOINT_EVERY, processes=JOB_PROCESSES)
END_S = limit_s(starts=1, steps=STEPS, processes=JOB_PROCESSES)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_a_killed_worker_restarts_from_its_checkpoint_to_the_identical_end(tmp_path, corpus_dir):
    """Two torchrun jobs with the same command line (--resume included): one runs through, in the
    other worker 0 (the holder of the run's lock) is killed with SIGKILL mid-run, after a
    checkpoint. torchrun restarts both workers once; they resume and end bit-identical."""
    every = str(CHECKPOINT_EVERY)
    run = ("--steps", str(STEPS), "--eval-every", every, "--checkpoint-every", every, "--resume")
    run += ("--collective-timeout", "60")
    started = time.monotonic()
    jobs = {name: torchrun(tmp_path / name, corpus_dir, *run) for name in ("straight", "killed")}
    with killed_at_exit(*jobs.values()):
        killed = jobs["killed"]
        wait_for(lambda: complete_checkpoint(tmp_path / "killed"), CHECKPOINT_S, "a checkpoint")
        victim = children(killed.pid)[0]
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic() - started
        outputs = {}
        for name, job in jobs.items():
            outputs[name] = job.communicate(timeout=END_S)[0]
            print(f"{name}: ended {time.monotonic() - started:.1f} s after the launch")
        print(f"worker 0 of the killed job was killed {killed_at:.1f} s after the launch")
    for name, job in jobs.items():
        assert job.returncode == 0, outputs[name][-8000:]
    assert "starting fresh" in outputs["straight"] and "resumed from" not in outputs["straight"]
    assert outputs["killed"].count("starting fresh") == 1  # the first start
    assert "resumed from step " in outputs["killed"], outputs["killed"][-8000:]
    assert not Path(f"/proc/{victim}").exists()

    straight, restarted = tmp_path / "straight", tmp_path / "killed"
    results = [json.loads((d / "results.json").read_text()) for d in (straight, restarted)]
    for key in ("steps", "final_val_loss", "bytes_per_worker", "comm_events", "evals"):
        if key == "evals":
            assert [e["val_loss"] for e in results[0][key]] == [
                e["val_loss"] for e in results[1][key]
            ]
        else:
            assert results[0][key] == results[1][key], key

    def losses(run_dir):
        return [(r["step"], r["train_loss"]) for r in read_metrics(run_dir) if "train_loss" in r]

    assert losses(straight) == losses(restarted) and len(losses(straight)) == STEPS
    last = f"step-{STEPS:08d}"
    for rank in (0, 1):
        states = [
            torch.load(d / "checkpoints" / last / f"rank{rank}.pt", weights_only=True)
            for d in (straight, restarted)
        ]
        for name, value in states[0]["params"].items():
            assert torch.equal(value, states[1]["params"][name]), (rank, name)


# Two workers at once, to step 1. Once one is frozen the other sits out the timeout and ends: the
# test accepts an end up to ENDING_S past the timeout (asserted below), so its wait allows that.
FIRST_STEP_S = limit_s(starts=1, steps=1, processes=2)
ENDING_S = 30


@pytest.mark.slow
def test_a_frozen_worker_ends_the_others_within_the_collective_timeout(tmp_path, corpus_dir):
    """Worker 1 is stopped (SIGSTOP: alive, silent) once the run is training; worker 0 stops
    within --collective-timeout with one line naming the flag, instead of hanging."""
    timeout_s = 10
    argv = [sys.executable, "-m", "mtdao", "train", *FLAGS, "--steps", "5000"]
    argv += ["--data", str(corpus_dir), "--out", str(tmp_path / "run")]
    argv += ["--collective-timeout", str(timeout_s)]
    env = {**ENV, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(unused_port())}
    workers = []
    try:
        for rank in (0, 1):
            workers.append(
                subprocess.Popen(
                    argv,
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
            )
        metrics = tmp_path / "run" / "metrics.jsonl"
        wait_for(lambda: metrics.is_file() and metrics.stat().st_size > 0, FIRST_STEP_S, "step 1")
        os.kill(workers[1].pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        err = workers[0].communicate(timeout=timeout_s + ENDING_S)[1]
        waited = time.monotonic() - frozen_at
        print(
            f"worker 0 ended {waited:.1f} s after worker 1 froze (--collective-timeout {timeout_s})"
        )
    finally:
        for worker in workers:
            kill(worker)
    lines = [line for line in err.strip().splitlines() if line.startswith("mtdao")]
    assert workers[0].returncode == 2 and "Traceback" not in err, err
    assert lines == [
        f"mtdao train: error: no answer from another worker within {timeout_s} s "
        f"(--collective-timeout {timeout_s}): a peer is frozen, stalled or lost; raise "
        "--collective-timeout if the workers are only slow"
    ], err
    assert waited < timeout_s + ENDING_S
