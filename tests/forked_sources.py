"""Runs Python sources as ``python -c SOURCE`` would, each in a process of its own, forked from
this one once it has imported the libraries that several of them import (torch costs 2 - 4
core-seconds per process, transformers' Trainer 6 more): a source starts with nothing of its
own run yet, and a module it forgets to import is still missing from its namespace.

Usage: ``python forked_sources.py JOBS PRELOAD...``. JOBS is a JSON list of
``{"source", "cwd", "env", "timeout_s", "out"}``; each job's process runs in ``cwd`` with
exactly ``env``, writes its stdout and stderr to ``out``/stdout and ``out``/stderr, and this
process writes its exit status (or ``timeout``, after killing it) to ``out``/status.
"""

from __future__ import annotations

import builtins
import importlib
import json
import os
import signal
import sys
import time
import types
from pathlib import Path


def run_as_dash_c(job: dict) -> None:
    """In the forked process: what ``python -c`` sets up, then the source; never returns (an
    uncaught exception or the end of the source exits the interpreter the ordinary way)."""
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    out = Path(job["out"])
    for fd, name in ((1, "stdout"), (2, "stderr")):
        os.dup2(os.open(out / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv = ["-c"]
    sys.path[0] = ""  # the working directory, as for -c
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    exec(compile(job["source"], "<string>", "exec", dont_inherit=True), main.__dict__)
    sys.exit(0)


def wait_or_kill(pid: int, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return str(os.waitstatus_to_exitcode(status))
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "timeout"


if __name__ == "__main__":
    jobs = json.loads(Path(sys.argv[1]).read_text())
    for module in sys.argv[2:]:
        importlib.import_module(module)
    for job in jobs:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_as_dash_c(job)
        status = wait_or_kill(pid, job["timeout_s"])
        (Path(job["out"]) / "status").write_text(status)
