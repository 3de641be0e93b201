"""Bit parity between real replicas: three of examples/fault_tolerant_loop.py and a lighthouse on
loopback, one of which (tests/parity_deviant.py) has one element of a parameter moved by one
float32 step right after a round. Every replica names it and the tensor in one line at the next
round, which it sits out, it heals from the other two at the quorum after, and all three end with
the same model; no process is left behind (the drill kills what is still running)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from wait_limits import limit_s

from mtdao.testing.fault_drill import Drill

pytest.importorskip("torchft")

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent
EXAMPLE = TESTS.parent / "examples" / "fault_tolerant_loop.py"
STEPS, PERIOD, WRONG_AT = 48, 8, 16
RUN_S = limit_s(steps=STEPS, processes=3)  # three start at once and train every step


def test_a_replica_whose_parameters_go_wrong_after_a_round_is_named_and_heals(tmp_path):
    with Drill(tmp_path, []) as drill:
        drill.start_lighthouse(min_replicas=3)
        for replica in range(3):
            script = [str(TESTS / "parity_deviant.py"), str(WRONG_AT)] if replica == 1 else []
            argv = [sys.executable, *(script or [str(EXAMPLE)]), "--lighthouse", drill.lighthouse]
            argv += ["--replica-id", str(replica), "--steps", str(STEPS), "--sync-period"]
            drill._spawn(
                f"r{replica}", [*argv, str(PERIOD), "--out", str(tmp_path / f"r{replica}")]
            )
        exits = [drill.wait_exit(f"r{replica}", RUN_S) for replica in range(3)]
        assert exits == [0, 0, 0], drill.tails()
        named = (
            f"parity: after the round at step {WRONG_AT} replica 1 holds another parameter "
            "'param 0 of group 0' than replicas 0, 2; it sits the next round out and heals from "
            "them"
        )
        for replica in range(3):
            assert drill.log(f"r{replica}").count(named) == 1, drill.tails()
        deviant = drill.log("r1")
        after = deviant[deviant.index(named) :]
        assert "replica 1: healed" in after, drill.tails()  # at the quorum after
        assert "parity:" not in after[len(named) :], drill.tails()  # once healed, it agrees
    results = [json.loads((tmp_path / f"r{r}" / "result.json").read_text()) for r in range(3)]
    assert [r["step"] for r in results] == [STEPS] * 3
    assert len({r["params_sha256"] for r in results}) == 1, results
