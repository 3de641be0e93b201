"""benchmarks/defaults_by_model_size.py trains every method at its defaults per model size and
prints MT-DAO's gap to DDP and Local Adam (a few steps here: the table, not the figures)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "defaults_by_model_size.py"


@pytest.mark.slow  # trains the three methods in a subprocess
def test_the_model_size_table_names_every_model_and_both_gaps(tmp_path):
    argv = ["--models", "micro", "--steps", "4", "--sync-period", "2", "--seeds", "0",
            "--out", str(tmp_path / "runs"), "--report", str(tmp_path / "size.md")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True,
                          timeout=300, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("| micro |"))
    assert "| 110,912 | 1 |" in row and row.count("(one seed)") == 2, row
    assert "±" not in row, row  # one seed has no spread to show
    assert row in (tmp_path / "size.md").read_text()
    again = subprocess.run([sys.executable, str(SCRIPT), *argv, "--collect"], capture_output=True,
                           text=True, timeout=120, env=env)  # fmt: skip
    assert "3/3 runs already finished" in again.stdout, again.stdout
