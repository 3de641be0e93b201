"""A fault-tolerant run on an open network: peers that do not belong to it, and members that
drifted. Real processes on loopback (mtdao lighthouse, mtdao train --fault-tolerant replicas, and
tests/rogue_peer.py, a stock torchft Manager run as an attacker would run it).

* a rogue that registers with the lighthouse claiming a far-ahead step and serving a pickle, and a
  replica with another secret: the lighthouse refuses both (no code runs in any replica, nobody
  heals from them or averages with them), the outsider is told why in one line, the replicas
  finish;
* in the same run, a stranger that sends torchft's ``Kill`` call to a replica's manager port (raw
  HTTP/2, as tests/grpc_calls.py does): the replica says it refused it, goes on, and finishes;
* a replica rewound 4 steps with its commit count unchanged (what a replica stuck in a
  collective came back as): it sits the round out and heals, and no round mixes steps.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
from grpc_calls import KILL, PERMISSION_DENIED, grpc_call, grpc_status, kill_request
from wait_limits import limit_s

from mtdao.testing.fault_drill import Drill

pytest.importorskip("torchft")

pytestmark = pytest.mark.slow

ROGUE = Path(__file__).with_name("rogue_peer.py")
TOKEN_ENV = "MTDAO_AUTH_TOKEN"  # spelled out: the test also runs against versions without it
SECRET = "a-secret-of-this-test-run-0123456789"
K = 4
FLAGS = dict(model="micro", batch_size=2, seq_len=16, eval_tokens=256, sync_period=K)
# connect: gloo pairs of a busy 2-core machine take seconds to form; a shorter limit splits the
# first quorum
TIMEOUTS = ["--collective-timeout", "20", "--connect-timeout", "10", "--quorum-timeout", "60"]
# No wait here sits out a timeout: the strangers are refused, no replica dies. A wait counts a
# start (wait_limits) when it takes in a launch or, after the last step, an evaluation, a
# checkpoint and the exit.
ROGUE_UP_S = limit_s()  # the rogue's start: torch, torchft and a manager


def flags(corpus, workers: int, steps: int) -> list[str]:
    argv = ["--data", str(corpus), "--no-progress", "--workers", str(workers), *TIMEOUTS]
    argv += ["--steps", str(steps)]
    for name, value in FLAGS.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def committed(drill: Drill, name: str) -> list[dict]:
    return drill.events(name, "committed")


def manager_address(log: str) -> str:
    """The manager address a replica printed at start-up (``serving on ...: manager H:P ...``)."""
    found = re.search(r"serving on \S+: manager ([^\s,]+)", log)
    assert found, log
    return found.group(1)


def test_strangers_run_no_code_get_no_quorum_and_cannot_stop_a_replica(corpus_dir, tmp_path):
    """The lighthouse (given the run's secret) refuses the rogue and the outsider before they
    reach a quorum: the rogue's heartbeats and quorum requests carry no claim (it never gets a
    quorum), the outsider's claim is signed with another secret, which it is told in one line.
    Held after their first round, both replicas refuse a stranger's ``Kill`` and go on."""
    marker, steps = tmp_path / "payload-ran", 3 * K
    # r0, r1 and the outsider at once; the rogue counts little
    first_round_s = limit_s(steps=K, processes=3)
    rest_s = limit_s(steps=steps - K, processes=3)  # the steps left, the end
    with Drill(tmp_path / "drill", flags(corpus_dir, 3, steps), join_timeout=10.0) as drill:
        drill.env[TOKEN_ENV] = SECRET
        drill.start_lighthouse(min_replicas=2)
        drill._spawn("rogue", [sys.executable, str(ROGUE), drill.lighthouse, str(marker), "7"])
        drill.wait_for(
            lambda: "registered" in drill.log("rogue"), ROGUE_UP_S, "the rogue to register"
        )
        drill.gate(K)
        drill.start("r0", 0)
        drill.start("r1", 1)
        drill.env[TOKEN_ENV] = "another-secret-than-the-runs-0123"
        drill.start("outsider", 2)
        at_gate = lambda: all(drill.status(n) == ("waiting", K) for n in ("r0", "r1"))  # noqa: E731
        drill.wait_for(at_gate, first_round_s, "both replicas after their first round")
        for name in ("r0", "r1"):
            answer = grpc_call(manager_address(drill.log(name)), KILL, kill_request())
            assert grpc_status(answer) == PERMISSION_DENIED, answer
        time.sleep(1.0)  # a Kill that got through ends the process at once
        assert drill.returncode("r0") is None and drill.returncode("r1") is None, drill.tails()
        drill.gate(None)
        exits = {name: drill.wait_exit(name, rest_s) for name in ("r0", "r1", "outsider")}
        assert not marker.exists(), f"the rogue's payload ran\n{drill.tails()}"
        assert exits == {"r0": 0, "r1": 0, "outsider": 2}, drill.tails()
        lighthouse = drill.log("lighthouse")
        assert "got lighthouse quorum" not in drill.log("rogue"), drill.tails()  # torchft's log
        assert "refused a quorum request of '2:" in lighthouse, drill.tails()
        assert "its claim is not signed with this run's secret" in lighthouse, drill.tails()
        (error,) = [line for line in drill.log("outsider").splitlines() if "error" in line]
        assert "refused this replica's quorum request" in error and "--auth-token-file" in error
        # the real replicas averaged with each other only, every round, and refused nothing
        # but the Kill
        kill_refused = f"manager's front: refused a call of {KILL} from 127.0.0.1:"
        for name in ("r0", "r1"):
            rounds = {tuple(e["replicas"]) for e in committed(drill, name)}
            assert rounds == {(0, 1)}, (rounds, drill.tails())
            refusals = [line for line in drill.log(name).splitlines() if "refused" in line]
            assert refusals and all(kill_refused in line for line in refusals), drill.tails()
        assert drill.rounds("r0") == drill.rounds("r1") and steps in drill.rounds("r0")


def test_a_replica_at_another_step_sits_the_round_out_and_heals(corpus_dir, tmp_path):
    """r2 goes back to its state after the round at step 4 once it has committed the round at
    8: its commit count matches the others', its step is 4 behind."""
    steps = 6 * K
    run_s = limit_s(steps=steps + K, processes=3)  # r2 takes K steps twice; the others wait for it
    with Drill(tmp_path / "drill", flags(corpus_dir, 3, steps), join_timeout=20.0) as drill:
        drill.start_lighthouse(min_replicas=3)
        (drill.root / "r2.rewind").write_text(f"{K} {2 * K}")
        for replica in range(3):
            drill.start(f"r{replica}", replica)
        for name in ("r0", "r1"):
            assert drill.wait_exit(name, run_s) == 0, drill.tails()
        assert "rewound to step 4" in drill.log("r2"), drill.tails()
        # every round r2 took part in, it took at the step the others took it at
        steps_of_r2 = [e["step"] for e in committed(drill, "r2")]
        for event in committed(drill, "r0"):
            if 2 in event["replicas"]:
                assert event["step"] in steps_of_r2, (event, steps_of_r2, drill.tails())
        assert steps_of_r2 == sorted(set(steps_of_r2)), steps_of_r2  # no step committed twice
        assert drill.wait_exit("r2", run_s) == 0, drill.tails()
        assert "sitting this round out (it is at step" in drill.log("r2"), drill.tails()
        assert any(e.get("heal") for e in drill.events("r2", "quorum")[1:]), drill.tails()
        finals = {drill.rounds(f"r{r}")[steps] for r in range(3)}
        assert len(finals) == 1, drill.tails()
