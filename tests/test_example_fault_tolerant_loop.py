"""examples/fault_tolerant_loop.py: fault tolerance in a plain loop through the library's API.

A lighthouse and 3 replicas of the example on localhost; one is killed with SIGKILL midway and
started again with the same command. All three finish their steps and write the same SHA-256 of
their final parameters, with plain rounds and with delayed int8 rounds with error feedback (and
the run's secret); no process is left behind (the drill kills what is still running)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from wait_limits import limit_s

from mtdao.testing.fault_drill import Drill
from mtdao.testing.ports import unused_port

pytest.importorskip("torchft")

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fault_tolerant_loop.py"
STEPS, PERIOD = 96, 8
# three replicas start and train a third of the steps (a step of this MLP costs less than the
# micro model's); then the killed one starts again, heals, and all three train the rest: the
# survivors wait for it at their next round, no timeout (the lighthouse needs all three)
THIRD_S = limit_s(steps=STEPS // 3, processes=3)
REST_S = limit_s(steps=STEPS - STEPS // 3, processes=3)
ROUND_OPTIONS = {
    "plain rounds": [],
    "delayed int8 rounds with error feedback": [
        "--sync-delay",
        "2",
        "--sync-dtype",
        "int8",
        "--error-feedback",
    ],  # fmt: skip
}
# what a survivor may say of its quorum's members: nothing, or replica 1 leaving and coming back
QUORUM_WITHOUT_1 = "quorum now replicas 0, 2 (replica 1 left)"
QUORUM_WITH_1 = "quorum now replicas 0, 1, 2 (replica 1 joined)"


def steps_said(drill: Drill, name: str) -> list[int]:
    """The steps a replica's progress lines name (one after each round: "...; step N")."""
    return [int(line.split()[-1]) for line in drill.log(name).splitlines() if "; step " in line]


def reached(drill: Drill, name: str, step: int) -> bool:
    said = steps_said(drill, name)
    return bool(said) and said[-1] >= step


@pytest.mark.parametrize("options", ROUND_OPTIONS.values(), ids=ROUND_OPTIONS.keys())
def test_a_replica_killed_midway_and_restarted_ends_with_the_same_model(tmp_path, options):
    flags, secret = [*options], []
    if options:  # the run's secret, from a file (the lighthouse admits only its holders)
        (tmp_path / "token").write_text("a-secret-the-three-replicas-share\n")
        secret = ["--auth-token-file", str(tmp_path / "token")]
        flags += secret
    with Drill(tmp_path, []) as drill:
        # three replicas needed for a quorum: the survivors wait at their next round for the
        # killed one to come back, however slowly this machine starts it
        drill.start_lighthouse(min_replicas=3, flags=secret)

        def command(replica: int) -> list[str]:
            out = tmp_path / f"r{replica}"
            argv = [sys.executable, str(EXAMPLE), "--lighthouse", drill.lighthouse]
            argv += ["--replica-id", str(replica), "--steps", str(STEPS), "--out", str(out)]
            return argv + ["--sync-period", str(PERIOD), *flags]

        for replica in range(3):
            drill._spawn(f"r{replica}", command(replica))
        drill.wait_for(lambda: reached(drill, "r1", STEPS // 3), THIRD_S, "r1 a third through")
        drill.kill("r1")
        drill._spawn("r1-again", command(1))  # the same command line
        exits = [drill.wait_exit(name, REST_S) for name in ("r0", "r1-again", "r2")]
        assert exits == [0, 0, 0], drill.tails()
        # without the run's secret a replica says so once, with what that leaves unprotected
        assert drill.log("r0").count("replicas prove themselves with") == (0 if secret else 1)
        # the restarted replica healed to where the others were, not from step 0, and said so
        assert steps_said(drill, "r1-again")[0] > STEPS // 3, drill.tails()
        joined = [line for line in drill.log("r1-again").splitlines() if " joined at " in line]
        assert len(joined) == 1, drill.tails()
        said = re.match(r"replica 1: joined at step (\d+) with replicas 0, 1, 2, healed from "
                        r"replica [02] \(", joined[0])  # fmt: skip
        assert said and int(said.group(1)) > STEPS // 3, joined
        # the survivors say their quorum's members when they change, not at every round: if a
        # round went on without the killed one (not yet proven to the lighthouse), then back
        for name in ("r0", "r2"):
            lines = drill.log(name).splitlines()
            said = [line.split(": ", 1)[1] for line in lines if " quorum now " in line]
            assert said in ([], [QUORUM_WITHOUT_1, QUORUM_WITH_1]), drill.tails()
    results = [json.loads((tmp_path / f"r{r}" / "result.json").read_text()) for r in range(3)]
    assert [r["step"] for r in results] == [STEPS] * 3
    assert len({r["params_sha256"] for r in results}) == 1, results


def test_a_replica_that_cannot_reach_the_lighthouse_stops_in_one_line(tmp_path):
    argv = [sys.executable, str(EXAMPLE), "--lighthouse", f"127.0.0.1:{unused_port()}"]
    argv += ["--replica-id", "0", "--steps", "8", "--out", str(tmp_path), "--connect-timeout", "1"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=limit_s(starts=1) + 1)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith("replica 0: cannot reach the lighthouse at http://127.0.0.1:")
    ), done.stderr
    assert not (tmp_path / "result.json").exists()
