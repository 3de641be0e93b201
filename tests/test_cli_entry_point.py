"""The ``mtdao`` program itself (``python -m mtdao``, the console script): a process that joins
process groups (launched by torchrun, a fault-tolerant replica) ends without interpreter teardown,
with the command's exit code and its output flushed; any other process ends the ordinary way."""

from __future__ import annotations

import os
import subprocess
import sys

from wait_limits import limit_s

TIMEOUT_S = limit_s(starts=1)  # the program's start (it fails before any work)

# The command fails (exit 2) before any process group is needed; the atexit line shows whether
# the interpreter was torn down.
PROGRAM = """
import atexit, sys
atexit.register(lambda: print("interpreter torn down"))
sys.argv = ["mtdao", *sys.argv[1:]]
from mtdao.cli import entry_point
sys.stdout.write("buffered, not yet flushed")
sys.exit(entry_point())
"""
PLOT = ["plot", "/nonexistent/run"]  # fails: "holds no metrics.jsonl"
REPLICA = ["train", "--fault-tolerant", "--out", "/nonexistent/run"]  # fails: no --replica-id


def run_program(*argv: str, **environment: str) -> subprocess.CompletedProcess:
    unset = ("WORLD_SIZE", "RANK", "PYTHONUNBUFFERED")  # stdout block-buffered, as in a pipe
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(environment)
    return subprocess.run(
        [sys.executable, "-c", PROGRAM, *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def test_a_torchrun_process_ends_without_teardown_and_keeps_its_exit_code_and_output():
    ended = run_program(*PLOT, WORLD_SIZE="2", RANK="1")
    assert ended.returncode == 2, ended.stderr
    assert ended.stdout == "buffered, not yet flushed"  # flushed, and no teardown after it
    assert "holds no metrics.jsonl" in ended.stderr


def test_a_fault_tolerant_replica_ends_without_teardown():
    ended = run_program(*REPLICA)
    assert ended.returncode == 2, ended.stderr
    assert ended.stdout == "buffered, not yet flushed"
    assert "--fault-tolerant needs --replica-id" in ended.stderr


def test_any_other_process_ends_the_ordinary_way():
    ended = run_program(*PLOT)
    assert ended.returncode == 2, ended.stderr
    assert ended.stdout == "buffered, not yet flushed" + "interpreter torn down\n"
