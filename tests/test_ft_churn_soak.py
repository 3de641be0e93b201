"""The churn benchmark, short (benchmarks/ft_churn.py): three replicas of the example loop killed
with SIGKILL at random for two minutes (a mean of 12 s between kills), restarted at once, and the
lighthouse restarted every 40 s. At least half the expected kills land, the group never goes a
minute without a commit, every replica ends with the same model, the replicas' membership changes
are in its timeline, and no process is left behind.
A soak test: ``python -m pytest -m soak``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft")

pytestmark = pytest.mark.soak

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "ft_churn.py"
MINUTES, MTBF_S, LIGHTHOUSE_EVERY_S, BASELINE_S = 2, 12, 40, 20
LONGEST_WITHOUT_COMMIT_S = 60  # the bar a churn run must clear
# the benchmark's own limits, added up: each run's start (START_LIMIT_S, its first rounds), the
# baseline (and a minute's slack), the window, and the steps to the stop it writes then (a
# minute ahead at their pace, given three times as long, then one more start's limit)
START_LIMIT_S, END_MARGIN_S = 300, 60
WINDOW_S = 60 * MINUTES
RUN_LIMIT_S = (START_LIMIT_S + BASELINE_S + 60) + (START_LIMIT_S + WINDOW_S)
RUN_LIMIT_S += 3 * END_MARGIN_S + START_LIMIT_S


def test_replicas_killed_at_random_for_minutes_end_with_one_model(tmp_path):
    figures = tmp_path / "churn.json"
    argv = [sys.executable, str(BENCHMARK), "--minutes", str(MINUTES), "--replicas", "3"]
    argv += ["--mtbf", str(MTBF_S), "--lighthouse-every", str(LIGHTHOUSE_EVERY_S)]
    argv += ["--baseline-s", str(BASELINE_S), "--json", str(figures), "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    benchmark = subprocess.Popen(argv, env=env, start_new_session=True, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        output, _ = benchmark.communicate(timeout=RUN_LIMIT_S)
    finally:
        if benchmark.poll() is None:  # SIGTERM: it kills what it started, then itself
            benchmark.send_signal(signal.SIGTERM)
            benchmark.wait(timeout=30)
        assert not left_behind(tmp_path), left_behind(tmp_path)
    assert benchmark.returncode == 0, output
    report = json.loads(figures.read_text())
    assert report["failures"] >= MINUTES * 60 / MTBF_S / 2, output
    assert report["churn"]["lighthouse_restarts"] >= 2, output
    # restarted replicas heal (on a crowded machine many are killed again before they join)
    assert report["heals"] >= 1, output
    assert report["longest_without_commit_s"] <= LONGEST_WITHOUT_COMMIT_S, output
    assert report["goodput"] > 0, output
    assert report["identical"], json.dumps(report["churn"]["results"], indent=1)
    # each replica said when its quorum's members changed; the splits are read from those lines
    timeline = (tmp_path / "churn" / "timeline.log").read_text()
    assert " quorum now replicas " in timeline, timeline[-2000:]
    assert report["splits"] == len(report["churn"]["splits"]), output


def left_behind(root: Path) -> list[str]:
    """Command lines of live processes started for this test (they name its directory)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = cmdline.read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(root) in line:
            found.append(line)
    return found
