"""Fault-tolerant replicas of several processes: two replicas of 2 FSDP2 shards each, every one
launched with torchrun, on loopback. Replica 1's processes are killed with SIGKILL between two
syncs; torchrun (``--max-restarts 1``) starts them again, and they heal shard by shard from
replica 0. A replica of another --shards then tries to join and is refused. One drill
(mtdao.testing.fault_drill) runs it all; the tests read its record.

``OMP_NUM_THREADS=1 python -m pytest -s tests/test_ft_sharded.py`` prints the timings that
section 10 of the results notebook quoted (`git show 1bbf067:BENCHMARKS.md`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from wait_limits import limit_s, timeout_flags

from mtdao.testing.fault_drill import Drill, process_label

pytest.importorskip("torchft")

pytestmark = pytest.mark.slow

K, STEPS, SHARDS = 4, 32, 2
FLAGS = dict(workers=3, model="micro", batch_size=4, seq_len=32, eval_tokens=1024)
FLAGS.update(steps=STEPS, sync_period=K)
TIMEOUTS_S = dict(collective=20, connect=20, quorum=60)
TIMEOUTS = timeout_flags(TIMEOUTS_S)
HEARTBEAT_S = 1.0
RANKS = range(SHARDS)
PROCESSES = 2 * SHARDS  # the two replicas'
# How long each phase may take (wait_limits): torchrun counts a start before its workers', a held
# replica ends its start once released, the run's end (evaluation, checkpoint) counts one too.
# Launch to gate 2K, the held one-shard replica starting beside them (a start ends with the first
# step, past gate 0):
START_LIMIT_S = limit_s(starts=2, steps=2 * K, processes=PROCESSES + 1)
# From the kill on: torchrun starts replica 1's workers again while replica 0 takes 2K steps alone
# (once the lighthouse misses replica 1's heartbeats); replica 1 then heals at its first step:
RESTART_LIMIT_S = limit_s(steps=2 * K, processes=PROCESSES, sat_out_s=HEARTBEAT_S)
# The one-shard replica released, to its exit: refused at its first quorum, the next sync
ONE_SHARD_LIMIT_S = limit_s(steps=K, processes=PROCESSES + 1)
END_LIMIT_S = limit_s(steps=STEPS, processes=PROCESSES)  # the steps left and the end


def train_flags(corpus) -> list[str]:
    flags = ["--data", str(corpus), "--no-progress", *TIMEOUTS]
    for name, value in FLAGS.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def at_gate(drill: Drill, name: str, step: int) -> bool:
    """Every process of replica ``name`` waits at the gate before ``step + 1``."""
    return all(drill.status(process_label(name, r)) == ("waiting", step) for r in RANKS)


def run_to(drill: Drill, gate: int, names, limit: float) -> None:
    drill.gate(gate)
    drill.wait_for(lambda: all(at_gate(drill, n, gate) for n in names), limit, f"{names} at {gate}")


@pytest.fixture(scope="module")
def drill(corpus_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("drill-sharded")
    seen: dict = {}
    with Drill(root, train_flags(corpus_dir), heartbeat_timeout=HEARTBEAT_S) as drill:
        drill.start_lighthouse(min_replicas=1)
        drill.gate(0)  # both replicas ready before the first quorum: it then holds both
        drill.start("r0", 0, shards=SHARDS, max_restarts=0)
        drill.start("r1", 1, ["--resume"], shards=SHARDS, max_restarts=1)
        drill.start("one-shard", 2, hold=True)
        run_to(drill, 0, ["r0", "r1"], START_LIMIT_S)
        run_to(drill, 2 * K, ["r0", "r1"], START_LIMIT_S)

        killed = {r: drill.pid(process_label("r1", r)) for r in RANKS}
        for rank in RANKS:  # between two syncs: the whole replica dies
            drill.kill_process("r1", rank)
        seen["killed"] = killed
        run_to(drill, 4 * K, ["r0"], RESTART_LIMIT_S)  # replica 0 goes on alone
        restarted = lambda: all(  # noqa: E731
            drill.pid(process_label("r1", r)) != killed[r]
            and drill.status(process_label("r1", r))[0] == "running"
            for r in RANKS
        )
        drill.wait_for(restarted, RESTART_LIMIT_S, "torchrun to restart replica 1")
        # replica 1 joins at the next sync and heals
        run_to(drill, 6 * K, ["r0", "r1"], RESTART_LIMIT_S)

        drill.release("one-shard")  # it asks to join the next sync, and is refused there
        running = lambda: drill.status("one-shard")[0] == "running"  # noqa: E731
        drill.wait_for(running, ONE_SHARD_LIMIT_S, "the one-shard replica to connect")
        drill.gate(None)
        drill.wait_exit("one-shard", ONE_SHARD_LIMIT_S)
        seen["exits"] = {name: drill.wait_exit(name, END_LIMIT_S) for name in ("r0", "r1")}
        seen["pids"] = [drill.pid(process_label(n, r)) for n in ("r0", "r1") for r in RANKS]
        seen["lighthouse_exit"] = drill.stop("lighthouse")
        yield drill, seen


def test_a_killed_sharded_replica_restarts_heals_and_matches_its_peer_shard_by_shard(drill):
    drill, seen = drill
    assert seen["exits"] == {"r0": 0, "r1": 0}, drill.tails()
    # the run has no secret: the replica says so once, not once per process
    assert drill.log("r0").count("prove themselves with this account's secret") == 1
    left = [e for e in drill.events("r0", "quorum") if 1 in e["left"]]
    assert left, "replica 0 never saw replica 1 leave"
    detected = left[0]["time"] - drill.killed_at[process_label("r1", 0)]
    assert 0 < detected < 10 * HEARTBEAT_S
    heals = [e for e in drill.events("r1", "quorum") if e.get("heal") and e["step"] > 2 * K]
    assert heals and heals[0]["heal"]["source"] == 0 and heals[0]["heal"]["bytes"] > 0
    healed_at = heals[0]["step"]
    assert f"[replica 1] healed from replica 0: continuing at step {healed_at}" in drill.log("r1")
    for rank in RANKS:  # process r of the restarted replica holds exactly r's shards of replica 0
        mine, peer = (
            drill.rounds(process_label("r1", rank)),
            drill.rounds(process_label("r0", rank)),
        )
        first = min(step for step in mine if step > healed_at)
        assert mine[first] == peer[first]
        assert mine[STEPS] == peer[STEPS]  # and so at the end
    assert drill.rounds("r0")[STEPS] != drill.rounds("r0.r1")[STEPS]  # two shards, not copies
    connected = [e for e in drill.events("r1", "connect")][-1]["time"]
    heal = heals[0]["heal"]
    print(
        f"\nsharded replica ({SHARDS} shards), heartbeat timeout {HEARTBEAT_S:g} s: failure "
        f"detected after {detected:.2f} s; restarted processes ready to join "
        f"{connected - drill.killed_at[process_label('r1', 0)]:.1f} s after the kill; heal "
        f"{heal['bytes']:,} bytes over {SHARDS} processes, quorum with heal {heal['seconds']:.2f} s"
    )


def test_a_replica_with_other_shards_is_refused_and_the_others_lose_one_round(drill):
    drill, _ = drill
    assert drill.returncode("one-shard") == 2
    lines = [line for line in drill.log("one-shard").splitlines() if "error" in line]
    assert lines == [
        "mtdao train: error: this replica has --shards 1, but replica 0 has --shards 2, replica 1 "
        "has --shards 2 in the quorum: the processes of replicas pair up shard by shard, so every "
        "replica needs the same --shards"
    ]
    for name in ("r0", "r1"):
        discarded = drill.events(name, "discarded")
        assert [e["reason"] for e in discarded] == [
            "round discarded (replica 2 has --shards 1, this replica 2)"
        ]
        step = discarded[0]["step"]
        committed = [e for e in drill.events(name, "committed") if e["step"] >= step]
        if step < STEPS:  # no average that round; the next one goes on without it
            assert step not in drill.rounds(name)
            committed = [e for e in committed if e["step"] > step]
        # on a loaded machine the refusal can fall on the run's last round, formed again without it
        assert committed and committed[0]["replicas"] == [0, 1]


def test_nothing_is_left_running(drill):
    drill, seen = drill
    assert seen["lighthouse_exit"] == 0
    for pid in [*seen["pids"], *seen["killed"].values()]:
        assert not _alive(pid), f"process {pid} is still running"


def _alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        state = next(line for line in status.read_text().splitlines() if line.startswith("State"))
    except (FileNotFoundError, StopIteration):
        return False
    return "zombie" not in state and os.path.exists(f"/proc/{pid}")


def test_a_joiner_is_measured_against_most_replicas_at_the_newest_step():
    from mtdao.ft.quorum_plan import plan_quorum, reference_shard_count
    from mtdao.ft.security.proofs import Claim

    def claims(*replicas):  # (--shards, commits) of each replica
        return [
            Claim(r, f"{r}:m", commits, 0, "c", shards, f"store{r}:1", ("http://x/heal/",))
            for r, (shards, commits) in enumerate(replicas)
        ]

    # the shard counts of the replicas at the newest step
    assert reference_shard_count([2]) == 2 and reference_shard_count([1, 2, 2]) == 2
    assert reference_shard_count([2, 1]) is None  # no majority
    # a joiner with 1 among replicas at the newest step with 2 is refused; with 2, it is the
    # replica with 1 that fails its round (it is not joining)
    joiner = plan_quorum(claims((2, 12), (2, 0), (1, 0)), "2:m", 0, "p")
    assert "this replica has --shards 1, but replica 0 has --shards 2" in joiner.refusal
    running = plan_quorum(claims((1, 12), (2, 0), (2, 12)), "0:m", 0, "p")
    assert running.refusal is None and running.failure.endswith("this replica 1")
    assert plan_quorum(claims((2, 0), (1, 0)), "1:m", 0, "p").refusal  # no majority to join
