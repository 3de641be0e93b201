"""Every round option under --fault-tolerant, as on real machines: replicas (of one process, or of
2 FSDP2 shards under torchrun) with delayed (D = 2), fragmented (P = 2), int8 rounds with error
feedback. One replica is killed with SIGKILL while a round is in flight (opened at the gate's
step, its exchange's second stage still to come), then started again: the survivors all discard
that round, the new one heals from a live peer, and every replica then holds the same global
state (step, anchors, rounds and their averages) after every round, to the end. (With a delay,
each replica also keeps its own progress of the last D steps: the delay rule, not a
difference.) One drill (mtdao.testing.fault_drill) per layout; the tests read its record.
"""

from __future__ import annotations

import pytest
from wait_limits import limit_s, timeout_flags

from mtdao.testing.fault_drill import Drill, process_label

pytest.importorskip("torchft")

pytestmark = pytest.mark.slow

K, STEPS, KILLED_AT = 4, 32, 8  # rounds open at every even step and land 2 steps later
FLAGS = dict(workers=3, model="micro", batch_size=4, seq_len=32, eval_tokens=1024)
FLAGS.update(steps=STEPS, sync_period=K, sync_delay=2, sync_fragments=2)
OPTIONS = ["--sync-dtype", "int8", "--error-feedback"]
TIMEOUTS_S = dict(collective=20, connect=20, quorum=60)
TIMEOUTS = timeout_flags(TIMEOUTS_S)
HEARTBEAT_S = 1.0
LAYOUTS = {"one process": (1, ["r0", "r1", "r2"]), "2 shards": (2, ["r0", "r1"])}


def train_flags(corpus) -> list[str]:
    flags = ["--data", str(corpus), "--no-progress", *TIMEOUTS, *OPTIONS]
    for name, value in FLAGS.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def at_gate(drill: Drill, name: str, step: int, shards: int) -> bool:
    return all(drill.status(process_label(name, r)) == ("waiting", step) for r in range(shards))


def limits(shards: int, replicas: int) -> dict[str, float]:
    """How long each phase of the drill may take (wait_limits): torchrun counts a start before
    its workers', the run's end (evaluation, checkpoint) one too."""
    processes, launch = shards * replicas, 1 if shards == 1 else 2
    # the survivors' exchange with the killed one fails (at the latest at the collective timeout);
    # their next round goes on without it once the lighthouse misses its heartbeats
    dropped_s = TIMEOUTS_S["collective"] + HEARTBEAT_S
    return dict(
        # launch to the round in flight (a start ends with the first step, past gate 0)
        start=limit_s(starts=launch, steps=KILLED_AT, processes=processes),
        killed=limit_s(starts=0, steps=2 * K, processes=processes, sat_out_s=dropped_s),
        restart=limit_s(processes=shards),  # its processes start again, the others at the gate
        # the restarted one's first step (the end of its start, a heal in it), the rest, the end
        end=limit_s(steps=STEPS, processes=processes),
    )


def run_to(drill: Drill, gate: int, names, shards: int, limit: float) -> None:
    drill.gate(gate)
    drill.wait_for(
        lambda: all(at_gate(drill, n, gate, shards) for n in names), limit, f"{names} at {gate}"
    )


@pytest.fixture(scope="module", params=list(LAYOUTS))
def drill(request, corpus_dir, tmp_path_factory):
    shards, names = LAYOUTS[request.param]
    limit = limits(shards, len(names))
    root = tmp_path_factory.mktemp("drill-options")
    with Drill(root, train_flags(corpus_dir), heartbeat_timeout=HEARTBEAT_S) as drill:
        drill.start_lighthouse(min_replicas=len(names) - 1)  # the survivors go on without it
        drill.gate(0)  # every replica ready before the first quorum: it then holds them all
        for replica_id, name in enumerate(names):
            if shards == 1:
                drill.start(name, replica_id)
            else:  # torchrun restarts the killed one (--resume: the same command line)
                drill.start(name, replica_id, ["--resume"], shards=shards, max_restarts=1)
        run_to(drill, 0, names, shards, limit["start"])
        run_to(drill, KILLED_AT, names, shards, limit["start"])  # the round opened at 8: in flight
        killed = names[1]
        for rank in range(shards):
            drill.kill_process(killed, rank)
        survivors = [n for n in names if n != killed]
        run_to(drill, KILLED_AT + 2 * K, survivors, shards, limit["killed"])
        rejoined = "r1b" if shards == 1 else killed  # torchrun restarts a sharded one itself
        if shards == 1:
            drill.start(rejoined, 1)
        asking = lambda: all(  # noqa: E731  (at its first quorum, until the others come)
            drill.status(process_label(rejoined, r)) == ("running", 0) for r in range(shards)
        )
        drill.wait_for(asking, limit["restart"], f"{rejoined} to start again")
        replicas = [*survivors, rejoined]
        drill.gate(None)  # the survivors' next round opens with it, and heals it
        exits = {name: drill.wait_exit(name, limit["end"]) for name in replicas}
        drill.stop("lighthouse")
        yield drill, dict(shards=shards, survivors=survivors, rejoined=rejoined, exits=exits)


def test_the_survivors_all_discard_the_round_in_flight(drill):
    drill, seen = drill
    assert set(seen["exits"].values()) == {0}, drill.tails()
    discarded_at = set()
    for name in seen["survivors"]:
        discarded = drill.events(name, "discarded")
        assert discarded, f"{name} discarded nothing\n{drill.tails()}"
        discarded_at.add(discarded[0]["step"])
        assert KILLED_AT < discarded[0]["step"] <= KILLED_AT + 2
        committed = [e["step"] for e in drill.events(name, "committed")]
        assert KILLED_AT not in committed and KILLED_AT - 2 in committed
    assert len(discarded_at) == 1  # at the same point on every survivor


def test_the_restarted_replica_heals_and_every_replica_holds_the_same_global_state(drill):
    drill, seen = drill
    rejoined, survivors = seen["rejoined"], seen["survivors"]
    heals = [e for e in drill.events(rejoined, "quorum") if e.get("heal") and e["step"] > 0]
    assert heals and heals[0]["heal"]["bytes"] > 0
    healed_at = heals[0]["step"]
    for rank in range(seen["shards"]):
        digests = [drill.global_rounds(process_label(n, rank)) for n in [*survivors, rejoined]]
        after = [step for step in digests[-1] if step > healed_at]
        assert after and STEPS - 2 in after
        for step in after:  # the rounds after the heal: one global state everywhere
            assert len({d.get(step) for d in digests}) == 1, f"step {step}, shard {rank}"
        before = [s for s in digests[0] if s < KILLED_AT and all(s in d for d in digests[:-1])]
        for step in before:  # and among the survivors before the failure too
            assert len({d[step] for d in digests[:-1]}) == 1
