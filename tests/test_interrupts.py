"""Ctrl-C (SIGINT) on a real process: a run names its last checkpoint and the exact command that
continues it (which then works); the lighthouse stops cleanly, without a traceback."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from wait_limits import first_line, limit_s

from mtdao.cli import main
from mtdao.train.checkpoint.index import latest_checkpoint

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
CHECKPOINT_EVERY, RESUMED_STEPS = 2, 12
READY_S = limit_s(starts=1, steps=CHECKPOINT_EVERY)  # a start, then steps to a checkpoint
# after Ctrl-C, up to a start's work: a run's first step and evaluation if still starting, the
# lighthouse's torchft server shut down; then the interpreter's end
ENDING_S = limit_s(starts=1)


def train_argv(out: Path, data: Path, steps: int) -> list[str]:
    return [
        "train",
        *("--model", "micro", "--workers", "2", "--sync-period", "4", "--batch-size", "2"),
        *("--seq-len", "32", "--steps", str(steps), "--eval-every", "1000", "--eval-tokens", "256"),
        *("--checkpoint-every", str(CHECKPOINT_EVERY), "--data", str(data)),
        *("--out", str(out), "--no-progress"),
    ]


def start_train(argv: list[str], cwd: Path) -> subprocess.Popen:
    """``mtdao`` with ``argv`` in a process that takes Ctrl-C as a user's terminal gives it: a
    background job (``nohup``, ``cmd &``) inherits SIGINT ignored, and Python then keeps it so."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # the child: SIG_DFL
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "mtdao", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
            cwd=cwd,
        )
    finally:
        signal.signal(signal.SIGINT, previous)


def interrupt_when(process: subprocess.Popen, ready, timeout: float = READY_S) -> tuple[str, str]:
    deadline = time.monotonic() + timeout
    while not ready() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    try:
        return process.communicate(timeout=ENDING_S)
    finally:
        process.kill()


@pytest.mark.slow  # trains to a checkpoint in a subprocess
@pytest.mark.usefixtures("one_thread", "no_plot")
def test_ctrl_c_names_the_checkpoint_and_the_resume_command(tmp_path, corpus_dir, capsys):
    out = tmp_path / "run"
    argv = train_argv(out, corpus_dir, steps=100_000)
    process = start_train(argv, tmp_path)
    _, err = interrupt_when(process, lambda: latest_checkpoint(out) is not None)
    assert process.returncode == 130, err
    assert "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("mtdao train: interrupted; last checkpoint: "), err
    assert f"{out}/checkpoints/step-" in line and " of 100000)" in line, line
    command = shlex.split(line.split("continue with: ")[1])
    assert command == ["mtdao", *argv, "--resume"]
    # the command does what it says: the run continues from that checkpoint (to a shorter end,
    # re-planned with --extend so that it ends quickly). In this process: what is tested is the
    # command line, and a process start costs more than the run
    capsys.readouterr()
    code = main([*command[1:], "--steps", str(RESUMED_STEPS), "--extend"])
    resumed = capsys.readouterr().err
    if f"past --steps {RESUMED_STEPS}" in resumed:  # the interrupt came late
        pytest.skip(f"the run was past step {RESUMED_STEPS} when interrupted")
    assert code == 0, resumed
    assert "resumed from step " in resumed


def test_ctrl_c_before_any_checkpoint_says_how_to_start_again(tmp_path, corpus_dir):
    out = tmp_path / "run"
    argv = train_argv(out, corpus_dir, steps=100_000)
    argv[argv.index("--checkpoint-every") + 1] = "1000000"
    process = start_train([*argv, "--overwrite"], tmp_path)
    _, err = interrupt_when(process, lambda: (out / "metrics.jsonl").is_file())
    assert process.returncode == 130 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"mtdao train: interrupted; no checkpoint in {out} yet"), err
    # --overwrite is dropped: --resume starts the same run afresh
    assert line.endswith("start it again with: " + shlex.join(["mtdao", *argv, "--resume"]))


# A parent (a supervisor, a shell) that holds them back from its children: the mask is set in a
# process of its own and kept across exec (a preexec_fn would run Python in a fork of this test
# process, whose other threads, gRPC's among them, may hold a lock the fork never releases).
BLOCKED = (
    "import os, signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, "
    "signal.SIGTERM}); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


@pytest.mark.parametrize("after, blocked", [(0.0, False), (1.5, False), (0.0, True)])
def test_ctrl_c_stops_the_lighthouse_without_a_traceback(after, blocked):
    pytest.importorskip("torchft")
    argv = ["-m", "mtdao", "lighthouse", "--bind-host", "127.0.0.1", "--port", "0"]
    process = subprocess.Popen(
        [sys.executable, *(["-c", BLOCKED] if blocked else []), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        assert first_line(process, limit_s()).startswith("lighthouse: serving at ")
        time.sleep(after)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=ENDING_S)
    finally:
        process.kill()
    assert process.returncode == 0, err
    # The lighthouse may first say whom it admits; it ends with one line and no traceback.
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "lighthouse: stopped", err


def test_a_server_that_does_not_stop_does_not_keep_the_lighthouse_from_ending(monkeypatch):
    from mtdao.train.fault_tolerance import lighthouse

    monkeypatch.setattr(lighthouse, "STOP_S", 0.2)
    started = time.monotonic()
    assert not lighthouse._ends(lambda: time.sleep(30))
    assert time.monotonic() - started < 5
    assert lighthouse._ends(lambda: None)


def test_sigterm_stops_a_lighthouse_still_reading_its_secret(tmp_path):
    """A secret from a pipe nobody writes (--auth-token-file <(...) whose writer stalls): the
    lighthouse waits in that read, and SIGTERM still ends it in one line."""
    pytest.importorskip("torchft")
    pipe = tmp_path / "secret"
    os.mkfifo(pipe, 0o600)
    argv = [sys.executable, "-m", "mtdao", "lighthouse", "--port", "0"]
    process = subprocess.Popen(
        [*argv, "--auth-token-file", str(pipe)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    writer = None
    try:
        deadline = time.monotonic() + limit_s(starts=1)
        while writer is None:  # opens once the lighthouse has opened the pipe to read it
            try:
                writer = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # ENXIO: no reader yet
                assert time.monotonic() < deadline and process.poll() is None, "never read"
                time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=ENDING_S)
    finally:
        process.kill()
        if writer is not None:
            os.close(writer)
    assert process.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines() == ["mtdao lighthouse: interrupted"], err
