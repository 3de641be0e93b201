"""A fault-tolerant run as it happens on real machines: ``mtdao lighthouse`` and ``mtdao train
--fault-tolerant`` replicas as processes on loopback, killed with SIGKILL between syncs and during
one, restarted, joined late, and joined by a replica with another config and one with no
lighthouse to reach. One drill (mtdao.testing.fault_drill) runs it all; the tests read its record.

The drill holds the replicas at gates so that each failure lands where it should (between two
syncs, or inside an all-reduce); what happens after a failure is not steered.
"""

from __future__ import annotations

import json
import re
import time

import pytest
from wait_limits import limit_s, timeout_flags

from mtdao.testing.fault_drill import EXIT_AFTER_SIGNAL_S, Drill
from mtdao.testing.ports import unused_port
from mtdao.train import trainer
from mtdao.train.config import TrainConfig

pytest.importorskip("torchft")

pytestmark = pytest.mark.slow

K, STEPS = 4, 96
FIRST_GATE = 2 * K
FLAGS = dict(workers=3, model="micro", batch_size=4, seq_len=32, eval_tokens=1024)
FLAGS.update(steps=STEPS, sync_period=K)
TIMEOUTS_S = dict(collective=10, connect=20, quorum=60)
TIMEOUTS = timeout_flags(TIMEOUTS_S)
NOWHERE_CONNECT_S = 3  # the replica with no lighthouse to reach gives up after it
HEARTBEAT_S = 1.0
JOIN_PACE_S = 1.0  # the group's rounds, while a joiner's first quorum request is on its way
REPLICAS = 3  # training at once, at most (a joiner included)
# How long each phase may take (wait_limits): a joiner held before it connects ends its start
# (quorum, heal, first step) once released; the run's end (evaluation, checkpoint) counts a start.
JOIN_LIMIT_S = limit_s()  # released: to its first quorum request, the others at the gate
# a round of the group, a joiner's first (the end of its start) among them; a peer killed before
# it is dropped once the lighthouse misses its heartbeats
ROUND_LIMIT_S = limit_s(steps=K, processes=REPLICAS, sat_out_s=HEARTBEAT_S)
IN_ROUND_LIMIT_S = limit_s(starts=0, steps=K, processes=REPLICAS)  # to the next round's all-reduce
# a peer killed inside the all-reduce: the others' fails (at the latest at the collective
# timeout), the round after goes on without it once the lighthouse misses its heartbeats
KILLED_IN_ROUND_LIMIT_S = limit_s(
    starts=0, steps=K, processes=REPLICAS, sat_out_s=TIMEOUTS_S["collective"] + HEARTBEAT_S
)
END_LIMIT_S = limit_s(steps=STEPS, processes=REPLICAS)  # the steps left and the end
LOSS_BOUND = 0.15  # |final val loss - uninterrupted run|; see BENCHMARKS.md for what it measures


def train_flags(corpus) -> list[str]:
    flags = ["--data", str(corpus), "--no-progress", *TIMEOUTS]
    for name, value in FLAGS.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


class Scenario:
    """Moves the gate one round at a time and records what each phase saw."""

    def __init__(self, drill: Drill) -> None:
        self.drill, self.gate, self.seen = drill, FIRST_GATE, {}

    def at_gate(self, names) -> bool:
        return all(self.drill.status(n) == ("waiting", self.gate) for n in names)

    def advance(self, names, done, pace: float = 0.0) -> None:
        """Open the gate a round at a time, no sooner than ``pace`` seconds apart, until
        ``done()``; ``names`` then wait at the gate."""
        while not done():
            assert self.gate + K < STEPS - 2 * K, (
                f"the scenario ran out of steps\n{self.drill.tails()}"
            )
            opened = time.monotonic()
            self.gate += K
            self.drill.gate(self.gate)
            self.drill.wait_for(
                lambda: done() or self.at_gate(names), ROUND_LIMIT_S, f"{names} at {self.gate}"
            )
            if not done():
                time.sleep(max(0.0, opened + pace - time.monotonic()))
        self.settle(names)

    def settle(self, names, limit: float = ROUND_LIMIT_S) -> None:
        self.drill.wait_for(lambda: self.at_gate(names), limit, f"{names} at the gate")

    def join(self, name: str, group) -> None:
        """Let a held replica connect; run the group until it has committed a round. The gate
        opens once it has asked for a quorum, and moves on, a round a second, while it has not
        joined: a request that reaches the lighthouse after the group's round (a loaded
        machine) is taken in by a later one."""
        drill = self.drill
        drill.release(name)
        drill.wait_for(lambda: drill.asked_quorum(name), JOIN_LIMIT_S, f"{name} to ask to join")
        self.advance(group, lambda: bool(drill.rounds(name)), pace=JOIN_PACE_S)
        self.settle([*group, name])


@pytest.fixture(scope="module")
def drill(corpus_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("drill")
    with Drill(root, train_flags(corpus_dir), heartbeat_timeout=HEARTBEAT_S) as drill:
        drill.start_lighthouse(min_replicas=2)
        drill.gate(FIRST_GATE)
        drill.start("r0", 0)
        drill.start("r1", 1)
        for name, replica_id in (("r2", 2), ("r1b", 1), ("r2b", 2)):
            drill.start(name, replica_id, hold=True)
        drill.start("other-config", 2, ["--lr", "0.01"], hold=True)
        nowhere = ["--lighthouse", f"localhost:{unused_port()}"]
        nowhere += ["--connect-timeout", str(NOWHERE_CONNECT_S)]
        drill.start("no-lighthouse", 0, nowhere)
        scenario = Scenario(drill)
        run_scenario(drill, scenario)
        yield drill, scenario.seen


def run_scenario(drill: Drill, scenario: Scenario) -> None:
    seen = scenario.seen
    started = len(drill.processes) - 1  # every replica starts at once, held or not
    scenario.settle(["r0", "r1"], limit_s(steps=FIRST_GATE, processes=started))

    scenario.join("r2", ["r0", "r1"])  # late, at a step > 0

    drill.kill("r1")  # between syncs: every replica waits at the gate, after a round
    scenario.advance(["r0", "r2"], lambda: last_round(drill, "r0") == [0, 2])
    seen["left"] = [e for e in drill.events("r0", "quorum") if 1 in e["left"]]

    scenario.join("r1b", ["r0", "r2"])  # the killed one restarts

    round_step = scenario.gate + K  # killed inside that round's all-reduce
    drill.hold_round("r0", round_step)
    scenario.gate += 2 * K
    drill.gate(scenario.gate)
    drill.wait_for(
        lambda: drill.entered_round("r2", round_step) and drill.entered_round("r1b", round_step),
        IN_ROUND_LIMIT_S,
        "r2 and r1b inside the all-reduce",
    )
    drill.kill("r2")
    drill.release_round("r0", round_step)
    scenario.settle(["r0", "r1b"], KILLED_IN_ROUND_LIMIT_S)
    seen["round_step"] = round_step

    drill.release("other-config")
    drill.wait_for(lambda: drill.status("other-config")[0] == "running", JOIN_LIMIT_S, "other")
    scenario.advance(["r0", "r1b"], lambda: "error:" in drill.log("other-config"))
    drill.wait_exit("other-config", EXIT_AFTER_SIGNAL_S)  # it exits after its error, as if stopped

    scenario.join("r2b", ["r0", "r1b"])
    drill.gate(None)
    for name in ("r0", "r1b", "r2b"):
        assert drill.wait_exit(name, END_LIMIT_S) == 0, drill.tails()
    drill.wait_exit("no-lighthouse", limit_s(processes=started, sat_out_s=NOWHERE_CONNECT_S))
    seen["lighthouse_exit"] = drill.stop("lighthouse")


def last_round(drill: Drill, name: str) -> list[int] | None:
    """The replicas of the last round ``name`` committed."""
    committed = drill.events(name, "committed")
    return committed[-1]["replicas"] if committed else None


def results(drill: Drill, name: str) -> dict:
    return json.loads((drill.root / name / "results.json").read_text())


def test_a_replica_that_joins_late_heals_and_matches_the_others(drill):
    drill, _ = drill
    joined = drill.events("r2", "quorum")[0]
    assert joined["step"] > 0 and joined["heal"]["bytes"] > 0
    step, source = joined["step"], joined["heal"]["source"]
    assert f"[replica 2] healed from replica {source}: continuing at step {step}" in drill.log("r2")
    assert f"[replica 0] step {step}: replica 2 joined; averaging over 0, 1, 2" in drill.log("r0")
    first = min(drill.rounds("r2"))
    assert drill.rounds("r0")[first] == drill.rounds("r1")[first] == drill.rounds("r2")[first]


def test_a_replica_killed_between_syncs_is_dropped_and_the_others_go_on(drill):
    drill, seen = drill
    assert seen["left"], "replica 0 never saw replica 1 leave"
    detected = seen["left"][0]["time"] - drill.killed_at["r1"]
    assert 0 < detected < 10 * HEARTBEAT_S  # about the heartbeat timeout; measured in BENCHMARKS
    left_at = seen["left"][0]["step"]
    assert f"[replica 0] step {left_at}: replica 1 left; averaging over 0, 2" in drill.log("r0")
    after = [step for step in drill.rounds("r2") if step > left_at]
    assert after and drill.rounds("r0")[after[0]] == drill.rounds("r2")[after[0]]
    # it died between rounds: no round was lost, the next one simply went on without it
    assert all(event["step"] > left_at for event in drill.events("r0", "discarded"))


def test_a_restarted_replica_holds_exactly_the_others_state_after_its_first_sync(drill):
    drill, _ = drill
    heal = drill.events("r1b", "quorum")[0]["heal"]
    assert heal["source"] in (0, 2) and heal["bytes"] > 0
    first = min(drill.rounds("r1b"))
    assert drill.rounds("r0")[first] == drill.rounds("r2")[first] == drill.rounds("r1b")[first]


def test_a_replica_killed_during_a_sync_leaves_no_partial_average(drill):
    drill, seen = drill
    step = seen["round_step"]
    for name in ("r0", "r1b"):  # both survivors discarded that round; neither applied it
        assert step in [e["step"] for e in drill.events(name, "discarded")]
        assert step not in drill.rounds(name)
    # their next round averaged over the two of them, and made them equal again
    later = min(s for s in drill.rounds("r0") if s > step)
    committed = [e for e in drill.events("r0", "committed") if e["step"] == later][0]
    assert committed["replicas"] == [0, 1]
    assert drill.rounds("r0")[later] == drill.rounds("r1b")[later]


def test_a_replica_with_another_config_is_refused_with_the_difference(drill):
    drill, _ = drill
    assert drill.returncode("other-config") == 2
    lines = [line for line in drill.log("other-config").splitlines() if "error" in line]
    assert len(lines) == 1
    assert re.fullmatch(
        r"mtdao train: error: replica 2's config differs from the quorum's \(replica [01]\): "
        r"lr: 0\.008 there, 0\.01 here",
        lines[0],
    )


def test_an_unreachable_lighthouse_is_one_clear_error(drill):
    drill, _ = drill
    assert drill.returncode("no-lighthouse") == 2
    last = drill.log("no-lighthouse").strip().splitlines()[-1]
    assert last.startswith("mtdao train: error: cannot reach the lighthouse at http://localhost:")
    assert "within --connect-timeout 3 s" in last


def test_the_run_ends_identical_everywhere_and_close_to_an_uninterrupted_one(
    drill, corpus_dir, tmp_path, one_thread
):
    drill, _ = drill
    finals = {name: drill.rounds(name)[STEPS] for name in ("r0", "r1b", "r2b")}
    assert len(set(finals.values())) == 1
    losses = {name: results(drill, name)["final_val_loss"] for name in finals}
    assert len(set(losses.values())) == 1
    reference = trainer.train(
        TrainConfig.of(data=str(corpus_dir), out=str(tmp_path), progress=False, **FLAGS)
    )
    gap = losses["r0"] - reference["final_val_loss"]
    print(f"final val loss {losses['r0']:.4f}, uninterrupted {reference['final_val_loss']:.4f}")
    assert abs(gap) < LOSS_BOUND
    summary = results(drill, "r0")["fault_tolerance"]
    assert summary["replicas_at_end"] == [0, 1, 2] and summary["discarded_rounds"]


def test_the_lighthouse_says_where_it_serves_and_stops_cleanly(drill):
    drill, seen = drill
    first = drill.log("lighthouse").splitlines()[0]
    assert first.startswith("lighthouse: serving at http://") and f":{drill.port} " in first
    assert seen["lighthouse_exit"] == 0


def test_a_replica_of_a_plain_loop_says_when_it_joins_heals_and_its_quorum_changes(caplog):
    from mtdao.ft import Heal, RoundStart
    from mtdao.ft.joining import JoinsAndHeals

    def quorum(heal=None, replicas=(0, 1, 2)):
        return RoundStart(replicas=list(replicas), joined=[1], left=[], quorum_id=3, seconds=0.2,
                          heal=heal)  # fmt: skip

    say = JoinsAndHeals(1)
    with caplog.at_level("WARNING", logger="mtdao.ft.joining"):
        say(quorum(Heal(source=0, bytes=2_500_000, seconds=0.4)), 32)  # a restart: both at once
        say(quorum(), 40)  # an ordinary round: nothing
        say(quorum(Heal(source=2, bytes=48_123, seconds=0.5)), 48)  # fell behind
        say(quorum(replicas=(1, 2)), 56)  # once per change of members, not per round
        say(quorum(replicas=(2, 1)), 64)
        say(quorum(replicas=(1, 3)), 72)
    assert [record.getMessage() for record in caplog.records] == [
        "replica 1: joined at step 32 with replicas 0, 1, 2, healed from replica 0 (2.5 MB in "
        "0.4 s)",
        "replica 1: healed from replica 2 at step 48 (48,123 bytes in 0.5 s)",
        "replica 1: quorum now replicas 1, 2 (replica 0 left)",
        "replica 1: quorum now replicas 1, 3 (replica 2 left, replica 3 joined)",
    ]
