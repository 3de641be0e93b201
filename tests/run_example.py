"""examples/<name> run in this process as ``python examples/<name> ARGV`` runs it: a torchrun job
of the integration checks (tests/integration_*_run.py) runs its example first, so that one job's
processes serve both (an HF or Lightning process's start costs more than the steps of either)."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path
from unittest import mock

import torch.distributed as dist

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(name: str, argv: list[str]) -> None:
    """The example as its process's program, but for its last line, which ends the process group:
    the checks that follow keep it (a group set up again on torchrun's store, whose keys still
    hold the first one's addresses, may connect to a closed one). The environment the example
    changed (the frameworks set MASTER_PORT and the like) and ``sys.argv`` are restored."""
    script = EXAMPLES / name
    environ, sys_argv = dict(os.environ), sys.argv
    sys.argv = [str(script), *argv]
    try:
        with mock.patch.object(dist, "destroy_process_group"):
            runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = sys_argv
        os.environ.clear()
        os.environ.update(environ)
        sys.stdout.flush()
