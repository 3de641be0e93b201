"""The tests' own bounded read: a line in time, the rest left to communicate, a hang refused."""

from __future__ import annotations

import subprocess
import sys

import pytest
from wait_limits import first_line

PRINTS = "import sys, time; print('ready', flush=True); time.sleep(0.2); print('rest')"


def start(script: str) -> subprocess.Popen:
    pipes = {"stdout": subprocess.PIPE, "text": True}
    return subprocess.Popen([sys.executable, "-c", script], **pipes)


def test_the_first_line_is_read_and_the_rest_is_left_for_communicate():
    process = start(PRINTS)
    assert first_line(process, 30.0) == "ready\n"
    assert process.communicate(timeout=30)[0] == "rest\n"


def test_a_process_that_prints_nothing_in_time_fails_the_wait():
    process = start("import time; time.sleep(30)")
    try:
        with pytest.raises(TimeoutError, match="no line from"):
            first_line(process, 0.5)
    finally:
        process.kill()
        process.wait()
