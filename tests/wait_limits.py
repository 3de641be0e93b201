"""How long a test that starts processes may wait, derived from what it waits for.

A bounded wait in these tests waits for processes to start, to take steps, and to sit out the
timeouts they were given (a quorum timeout, a peer's heartbeat, a test's own pause). Its limit
is what the first two cost on the slowest machine the tests must pass on, times ``HEADROOM``,
plus the third as it is::

    limit = HEADROOM * (starts * START_S + steps * STEP_S + WAKE_S) * crowding(processes)
            + sat_out_s

``START_S`` and ``STEP_S`` are core-seconds, measured on two cores beside two busy processes
(``yes > /dev/null``), one thread per process. ``mtdao train --model micro --batch-size 2
--seq-len 32`` took 8.3 - 11.8 s for 1 step (import, data, model, an evaluation, a checkpoint)
and 12.8 - 16.2 s for 201 steps, alone (1.5 processes a core); four at once took 17.5 - 20.2 s
and 32.8 - 32.9 s (3 a core). The worst per core: 11.8 / 1.5 = 7.9 s to start, (32.9 - 17.5)
/ 200 / 3 = 0.026 s a step. A smaller model or batch costs less: the bound holds for those.
``WAKE_S`` is what even a wait for no start and no step costs: the process that was waiting
wakes on crowded cores, writes what the test reads, and the test's next poll sees it.
"""

from __future__ import annotations

import os
import select
import subprocess
import time

HEADROOM = 3.0  # three runs in a row beside busy processes took up to 1.4x the first
START_S = 8.0  # core-seconds from launch to the end of a first step
STEP_S = 0.03  # core-seconds per step of the micro model (batch 2 or 4, sequences of 16 - 32)
WAKE_S = 0.5  # core-seconds: a few time slices of a crowded core, a flushed write, a poll
TINY_STEP = 5  # micro steps a tiny step costs: 0.09 - 0.11 s of CPU against 0.020 - 0.025 s
CORES = 2  # the machine the tests must pass on: CI's
BUSY = 2  # processes beside the suite that never wait (the test condition: two `yes`)
# the suite runs two test files at once (pytest -n 2): the other one's processes crowd the cores
# too, two training at a time in most of them (a drill starting 7 at once is brief)
OTHER_FILE = 2


def crowding(processes: int) -> float:
    """Processes per core: ``processes`` of ours beside the busy ones and the other file's."""
    return max(1.0, (processes + BUSY + OTHER_FILE) / CORES)


def limit_s(
    *, starts: int = 1, steps: int = 0, processes: int = 1, sat_out_s: float = 0.0
) -> float:
    """Seconds to wait for ``starts`` process starts one after the other and ``steps`` steps
    of each of ``processes`` processes running at once, plus ``sat_out_s`` seconds of timeouts
    and pauses that the processes (or the test) wait out on the way."""
    work = starts * START_S + steps * STEP_S + WAKE_S
    return HEADROOM * work * crowding(processes) + sat_out_s


def timeout_flags(seconds: dict[str, float]) -> list[str]:
    """``{"collective": 10}`` -> ``["--collective-timeout", "10"]``: a test's timeout flags built
    from the numbers its limits add up, so that changing one moves both."""
    return [arg for name, s in seconds.items() for arg in (f"--{name}-timeout", str(s))]


def first_line(process: subprocess.Popen, timeout_s: float) -> str:
    """The first line ``process`` writes to its stdout pipe, within ``timeout_s``: one that hangs
    before it prints fails its test instead of hanging it. Read from the pipe itself, byte by
    byte, so that the pipe's buffered reader (``communicate``) still has all the rest."""
    fd, line = process.stdout.fileno(), b""
    deadline = time.monotonic() + timeout_s
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError(f"no line from {process.args!r} in {timeout_s:g} s: {line!r}")
        byte = os.read(fd, 1)
        if not byte:  # it exited without a whole line
            break
        line += byte
    return line.decode()
