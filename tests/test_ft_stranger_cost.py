"""What strangers cost a fault-tolerant run: at most a bounded wait, never a round.

Real processes on loopback (mtdao lighthouse, mtdao train --fault-tolerant replicas, and
tests/rogue_peer.py, stock torchft as an attacker would run it):

* a run on loopback without a secret, a rogue claiming a far-ahead step and a flood of bogus
  replica ids: the replicas' rounds go on at least at half their pace, none is discarded (the
  rogue alone used to discard 43 rounds and stop training for as long as it lived, the flood
  used to triple the run's time);
* a restarted replica heals from its proven peer at once while a rogue and a replica of another
  run claim the highest steps, with torchft's own lighthouse, which lets them into every quorum
  (the restart sat out 131 rounds, the survivor stood still 180 s in one collective).
"""

from __future__ import annotations

import statistics
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from wait_limits import limit_s

from mtdao.testing.fault_drill import Drill
from mtdao.testing.ports import unused_port

pytest.importorskip("torchft")

pytestmark = pytest.mark.slow

ROGUE = Path(__file__).with_name("rogue_peer.py")
# torchft's own lighthouse, the console script installed beside this interpreter (found without an
# activated environment or PATH)
LIGHTHOUSE = str(Path(sysconfig.get_path("scripts")) / "torchft_lighthouse")
TOKEN_ENV = "MTDAO_AUTH_TOKEN"
K = 4
FLAGS = dict(model="micro", batch_size=2, seq_len=16, eval_tokens=256, sync_period=K)
TIMEOUTS = ["--collective-timeout", "20", "--connect-timeout", "10", "--quorum-timeout", "60"]
FLOOD = 20
JOIN_S = 5.0  # the join timeout of torchft's own lighthouse (the second test)
# A wait counts a start (wait_limits) when it takes in a launch or, after the last step, an
# evaluation, a checkpoint and the exit.
ROGUE_UP_S = limit_s(processes=2)  # the rogue's start (torch, torchft, a manager), the outsider's


def flags(corpus, workers: int, steps: int) -> list[str]:
    argv = ["--data", str(corpus), "--no-progress", "--workers", str(workers), *TIMEOUTS]
    argv += ["--steps", str(steps), "--eval-every", str(steps), "--log-every", "50"]
    for name, value in FLAGS.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def commit_times(drill: Drill, name: str) -> list[tuple[int, float]]:
    return [(e["step"], e["time"]) for e in drill.events(name, "committed")]


def intervals(times: list[tuple[int, float]], since: float, until: float) -> list[float]:
    moments = [t for _, t in times if since <= t <= until]
    return [b - a for a, b in zip(moments, moments[1:])]


def test_strangers_on_a_loopback_run_without_a_secret_cost_no_round(corpus_dir, tmp_path):
    steps = 480
    quarter_s = limit_s(steps=steps // 4, processes=2)
    # the strangers cost no timeout (the lighthouse refuses them), but run beside the replicas
    rest_s = limit_s(steps=steps - steps // 4, processes=4)
    with Drill(tmp_path / "drill", flags(corpus_dir, 2, steps), join_timeout=10.0) as drill:
        drill.env["XDG_CONFIG_HOME"] = str(tmp_path / "config")  # this account's secret, here
        drill.env.pop(TOKEN_ENV, None)
        drill.start_lighthouse(min_replicas=2)
        drill.start("r0", 0)
        drill.start("r1", 1)
        past = lambda step: lambda: min(drill.status(n)[1] for n in ("r0", "r1")) >= step  # noqa: E731
        drill.wait_for(past(steps // 4), quarter_s, "both replicas a quarter through")
        came = drill.events("r0", "committed")[-1]["time"]
        # at the lowest priority: what is measured is what the strangers cost the lighthouse and
        # the replicas, not the CPU their own processes take from them on this machine
        rogue = [sys.executable, str(ROGUE)]
        drill._spawn("rogue", [*rogue, drill.lighthouse, "/dev/null", "7"], lowest_priority=True)
        drill._spawn("flood", [*rogue, "flood", drill.lighthouse, str(FLOOD)], lowest_priority=True)
        exits = {name: drill.wait_exit(name, rest_s) for name in ("r0", "r1")}
        assert exits == {"r0": 0, "r1": 0}, drill.tails()
        assert "flooding" in drill.log("flood") and drill.returncode("flood") is None
        for name in ("r0", "r1"):
            assert not drill.events(name, "discarded"), drill.tails()
            times = commit_times(drill, name)
            before = intervals(times, 0.0, came)
            during = intervals(times, came, float("inf"))
            assert len(during) > steps // (2 * K), drill.tails()
            # at least half the pace, and never a stop (the rogue alone stopped it for 40 s)
            assert statistics.median(during) <= 2 * statistics.median(before), (before, during)
            assert max(during) < 5.0, (max(during), drill.tails())
        assert drill.rounds("r0")[steps] == drill.rounds("r1")[steps]
        assert "got lighthouse quorum" not in drill.log("rogue")


def test_a_restarted_replica_heals_from_its_proven_peer_while_strangers_claim_more(
    corpus_dir, tmp_path
):
    steps = 40 * K
    # r1b's connection, the rest of the steps beside the outsider (the rogue counts little);
    # r0's rounds while r1b connects each wait out the join timeout (for the killed r1, then
    # r1b), and the round after r1b joins one more
    rest_s = limit_s(steps=steps - 4 * K, processes=3, sat_out_s=2 * JOIN_S)
    with Drill(tmp_path / "drill", flags(corpus_dir, 3, steps), join_timeout=5.0) as drill:
        drill.env[TOKEN_ENV] = "a-secret-of-this-test-run-0123456789"
        port = unused_port()
        drill.lighthouse = f"127.0.0.1:{port}"  # torchft's own: it lets anyone in
        drill._spawn("lighthouse", [
            LIGHTHOUSE, "--bind", drill.lighthouse, "--min_replicas", "2",
            "--join_timeout_ms", str(int(JOIN_S * 1000)), "--heartbeat_timeout_ms", "1000",
        ])  # fmt: skip
        drill.gate(4 * K)
        drill.start("r0", 0)
        drill.start("r1", 1)
        # r1's restart starts now, held before it announces itself: its start-up on crowded
        # cores can outlast r0's remaining steps (r0 would end its run before r1b asks to join,
        # leaving no one to heal from), and here it overlaps r0's and r1's instead
        drill.start("r1b", 1, hold=True)
        at_gate = lambda: all(drill.status(n) == ("waiting", 4 * K) for n in ("r0", "r1"))  # noqa: E731
        ready = lambda: at_gate() and drill.status("r1b") == ("held", 0)  # noqa: E731
        drill.wait_for(ready, limit_s(steps=4 * K, processes=3), "r0, r1 at the gate, r1b held")
        drill._spawn("rogue", [sys.executable, str(ROGUE), drill.lighthouse, "/dev/null", "7"])
        drill.env[TOKEN_ENV] = "another-secret-than-the-runs-0123"
        drill.start("outsider", 2, ["--steps", str(10**4)])
        drill.env[TOKEN_ENV] = "a-secret-of-this-test-run-0123456789"
        drill.wait_for(
            lambda: "registered" in drill.log("rogue"), ROGUE_UP_S, "the rogue to register"
        )
        drill.kill("r1")
        drill.gate(None)
        drill.release("r1b")
        released = time.time()
        assert drill.wait_exit("r0", rest_s) == 0, drill.tails()
        assert drill.wait_exit("r1b", rest_s) == 0, drill.tails()
        heals = [e for e in drill.events("r1b", "quorum") if e.get("heal")]
        assert heals and heals[0]["heal"]["source"] == 0, drill.tails()
        waited = heals[0]["time"] - released
        assert waited < 60.0, (waited, drill.tails())  # its connection and one quorum
        times = commit_times(drill, "r0")
        assert max(intervals(times, 0.0, float("inf"))) < 15.0, drill.tails()
        for name in ("r0", "r1b"):
            rounds = {tuple(e["replicas"]) for e in drill.events(name, "committed")}
            assert rounds <= {(0, 1), (0,), (1,)}, (rounds, drill.tails())
        assert drill.rounds("r0")[steps] == drill.rounds("r1b")[steps]
