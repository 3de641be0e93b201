"""A faulty holder of the run's secret costs a round, not the run.

Replica 0 of examples/fault_tolerant_loop.py (under tests/steered_example.py) serves heal states
whose parameters hold NaN. It trains alone for two commits, then replicas 1 and 2 join: the only
member at the top commit count is the faulty one, so both must heal from it, and both refuse its
state (a joiner whose first quorum comes after the other's refusal need not). They name it in
their claims from then on, and no later quorum heals from it: the two
healthy replicas are up to date among themselves, the faulty one heals from them at each quorum.
Every replica finishes its steps, the healthy ones discard a round or two of some thirty, and
all three end with bit-identical parameters (before, the joiners asked again for as long as the
faulty replica lived, and ended with other models). No process is left behind (the drill kills
what still runs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from wait_limits import limit_s

from mtdao.testing.fault_drill import Drill

pytest.importorskip("torchft")

pytestmark = pytest.mark.slow

STEERED = Path(__file__).resolve().parent / "steered_example.py"
PERIOD, STEPS = 4, 120
FAULTY_HOLDS_AT = 3  # its third quorum request: after the first quorum and one round
DISCARDS_AT_MOST = 3  # the quorum that refused the faulty state, and what a busy machine adds


def test_the_healthy_replicas_refuse_a_faulty_source_once_and_average_on(tmp_path):
    with Drill(tmp_path, []) as drill:
        drill.start_lighthouse(min_replicas=1)
        (tmp_path / "r0.hold-quorum").write_text(str(FAULTY_HOLDS_AT))

        def command(replica: int, *options: str) -> list[str]:
            argv = [sys.executable, str(STEERED), str(tmp_path), f"r{replica}", *options, "--"]
            argv += ["--lighthouse", drill.lighthouse, "--replica-id", str(replica)]
            argv += ["--steps", str(STEPS), "--out", str(tmp_path / f"r{replica}")]
            return argv + ["--sync-period", str(PERIOD)]

        drill._spawn("r0", command(0, "--faulty"))
        held = lambda: (tmp_path / "r0.asked").exists() and "step 4" in drill.log("r0")  # noqa: E731
        drill.wait_for(held, limit_s(steps=2 * PERIOD), "the faulty replica's second round")
        for replica in (1, 2):
            drill._spawn(f"r{replica}", command(replica))
        asked = lambda: all((tmp_path / f"r{r}.asked").exists() for r in (1, 2))  # noqa: E731
        drill.wait_for(asked, limit_s(processes=3), "both joiners asking for a quorum")
        (tmp_path / "r0.hold-quorum").unlink()  # all three in one quorum: the joiners heal
        for name in ("r0", "r1", "r2"):
            assert drill.wait_exit(name, limit_s(steps=STEPS, processes=3)) == 0, drill.tails()
    results = {r: json.loads((tmp_path / f"r{r}" / "result.json").read_text()) for r in range(3)}
    assert all(result["step"] == STEPS for result in results.values()), results
    discarded = [results[healthy]["discarded_rounds"] for healthy in (1, 2)]
    assert sum(discarded) >= 1 and max(discarded) <= DISCARDS_AT_MOST, results  # refused, once
    assert len({result["params_sha256"] for result in results.values()}) == 1, results
