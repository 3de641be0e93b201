"""Processes a test starts in a session of their own (``start_new_session=True``), so that each
ends with everything it started, however the test ends: a kill of the parent alone could leave
its children (torchrun's workers, a snippet's forks) running on."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator

from mtdao.testing.fault_drill import EXIT_AFTER_SIGNAL_S


def kill(process: subprocess.Popen) -> None:
    """SIGKILL ``process``'s session (the process, if it still runs, and what it started that
    still runs); reap it."""
    with contextlib.suppress(ProcessLookupError):  # the whole group ended already
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=EXIT_AFTER_SIGNAL_S)


@contextlib.contextmanager
def killed_at_exit(*processes: subprocess.Popen) -> Iterator[None]:
    """Whatever happens inside, none of ``processes`` (or theirs) runs on after it."""
    try:
        yield
    finally:
        for process in processes:
            kill(process)
