"""torchrun jobs for the tests: ``python -m torch.distributed.run`` with this interpreter (no
``torchrun`` from PATH), one thread a process, its output piped, in a session of its own so that
it ends with all its workers, however the test ends (a kill of the launcher alone could leave its
workers running)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from mtdao.testing.ports import unused_port


def start(
    args: Sequence[str],
    *,
    processes: int = 2,
    standalone: bool = True,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen:
    """``torchrun --nproc-per-node PROCESSES ARGS`` (``args``: torchrun's other flags, then the
    program and its arguments), with ``env`` over this environment; its rendezvous
    ``--standalone``, or with ``standalone=False`` on loopback at a free port."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes)]
    if standalone:
        argv.append("--standalone")
    else:
        argv += ["--master-addr", "127.0.0.1", "--master-port", str(unused_port())]
    return subprocess.Popen(
        [*argv, *args],
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its workers are in its group: killed with it
    )
