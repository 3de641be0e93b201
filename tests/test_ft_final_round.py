"""One model at the end, whatever dies when: a replica killed (SIGKILL) while the final round is
in flight, its quorum formed and the survivors inside its collectives. The survivors' try is
discarded and the final round formed again among them, so both end with bit-identical
parameters: through ``mtdao train --fault-tolerant`` (the fault drill holds the replica in its
round), with replicas of one process and of two FSDP2 shards, and through the library API
(examples/fault_tolerant_loop.py under tests/steered_example.py, which holds it the same way).
No process is left behind (the drill kills what still runs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from wait_limits import limit_s, timeout_flags

from mtdao.testing.fault_drill import Drill, process_label

pytest.importorskip("torchft")

pytestmark = pytest.mark.slow

K = 4
STEPS = 2 * K + 2  # the final round is the only round at the last step: two local steps before
FLAGS = dict(model="micro", batch_size=2, seq_len=16, eval_tokens=256, sync_period=K, workers=3)
COLLECTIVE_S = 10  # a peer lost in a collective is given up within this
TIMEOUTS = ["--collective-timeout", str(COLLECTIVE_S), "--connect-timeout", "3"]
TIMEOUTS += ["--quorum-timeout", "60"]
HEARTBEAT_S = 1.0  # the drill's lighthouse drops a replica silent for this long
SURVIVORS = ("r0", "r2")
# after the kill: the lost collective, a quorum once the dead one is dropped, the final round,
# an evaluation and a checkpoint, the exit
FINISH_S = limit_s(processes=2, sat_out_s=COLLECTIVE_S + HEARTBEAT_S)


def train_flags(corpus) -> list[str]:
    argv = ["--data", str(corpus), "--no-progress", "--steps", str(STEPS), *TIMEOUTS]
    for name, value in FLAGS.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def test_a_replica_killed_in_the_final_round_leaves_the_survivors_one_model(corpus_dir, tmp_path):
    with Drill(tmp_path, train_flags(corpus_dir), heartbeat_timeout=HEARTBEAT_S) as drill:
        drill.start_lighthouse(min_replicas=2)
        drill.gate(0)  # all three ready before the first quorum (a late one would join later)
        drill.hold_round("r1", STEPS)  # its final round: the quorum formed, before its sums
        for replica, name in enumerate(("r0", "r1", "r2")):
            drill.start(name, replica)
        ready = lambda: all(drill.status(n) == ("waiting", 0) for n in ("r0", "r1", "r2"))  # noqa: E731
        drill.wait_for(ready, limit_s(starts=2, processes=3), "three replicas at 0")
        drill.gate(None)
        inside = lambda: all(drill.entered_round(n, STEPS) for n in ("r0", "r1", "r2"))  # noqa: E731
        drill.wait_for(inside, limit_s(steps=STEPS, processes=3), "all three in the final round")
        drill.kill("r1")
        for name in SURVIVORS:
            assert drill.wait_exit(name, FINISH_S) == 0, drill.tails()
            discarded = [e["step"] for e in drill.events(name, "discarded")]
            assert STEPS in discarded, drill.tails()  # the kill broke a try of the final round
        finals = {name: drill.rounds(name).get(STEPS) for name in SURVIVORS}
        assert None not in finals.values() and len(set(finals.values())) == 1, finals


SHARDS = 2
SHARDED_COLLECTIVE_S = 20  # as tests/test_ft_sharded.py


def test_a_sharded_replica_killed_in_the_final_round_leaves_the_survivors_one_model(
    corpus_dir, tmp_path
):
    """Three replicas of two FSDP2 shards each (torchrun); both processes of replica 1 held in
    the final round, its first killed (torchrun, --max-restarts 0, ends the other): process s
    of each survivor ends with the same shard."""
    # (a replica's own processes start apart on a busy machine: its group waits longer)
    timeouts = timeout_flags(dict(collective=SHARDED_COLLECTIVE_S, connect=20))
    flags = [*train_flags(corpus_dir), "--batch-size", "4", "--seq-len", "32", *timeouts]
    with Drill(tmp_path, flags, heartbeat_timeout=HEARTBEAT_S) as drill:
        drill.start_lighthouse(min_replicas=2)
        drill.gate(0)  # all three ready before the first quorum: it holds all three
        drill.hold_round("r1", STEPS)
        for replica, name in enumerate(("r0", "r1", "r2")):
            drill.start(name, replica, shards=SHARDS, max_restarts=0)
        labels = [process_label(n, r) for n in ("r0", "r1", "r2") for r in range(SHARDS)]
        ready = lambda: all(drill.status(label) == ("waiting", 0) for label in labels)  # noqa: E731
        drill.wait_for(ready, limit_s(starts=2, processes=3 * SHARDS), "six processes at 0")
        drill.gate(None)
        inside = lambda: all(drill.entered_round(label, STEPS) for label in labels)  # noqa: E731
        drill.wait_for(inside, limit_s(steps=STEPS, processes=3 * SHARDS), "the final round")
        drill.kill_process("r1", 0)
        for name in SURVIVORS:
            limit = limit_s(processes=2 * SHARDS, sat_out_s=SHARDED_COLLECTIVE_S + HEARTBEAT_S)
            assert drill.wait_exit(name, limit) == 0, drill.tails()
            assert STEPS in [e["step"] for e in drill.events(name, "discarded")], drill.tails()
        for rank in range(SHARDS):
            finals = [drill.rounds(process_label(name, rank)).get(STEPS) for name in SURVIVORS]
            assert None not in finals and finals[0] == finals[1], finals


EXAMPLE_HOLD = Path(__file__).resolve().parent / "steered_example.py"
PERIOD = 8
EXAMPLE_STEPS = 3 * PERIOD + 3


def test_a_replica_of_the_example_killed_in_the_final_round_leaves_one_model(tmp_path):
    with Drill(tmp_path, [], heartbeat_timeout=HEARTBEAT_S) as drill:
        drill.start_lighthouse(min_replicas=2)
        (tmp_path / "r1.hold-final").touch()
        (tmp_path / "start-gate").touch()  # all three in the first quorum

        def command(replica: int) -> list[str]:
            argv = [sys.executable, str(EXAMPLE_HOLD), str(tmp_path), f"r{replica}", "--"]
            argv += ["--lighthouse", drill.lighthouse, "--replica-id", str(replica)]
            argv += ["--steps", str(EXAMPLE_STEPS), "--out", str(tmp_path / f"r{replica}")]
            return argv + ["--sync-period", str(PERIOD)]

        for replica in range(3):
            drill._spawn(f"r{replica}", command(replica))
        connected = lambda: all((tmp_path / f"r{r}.connected").exists() for r in range(3))  # noqa: E731
        drill.wait_for(connected, limit_s(starts=1, processes=3), "three replicas connected")
        (tmp_path / "start-gate").unlink()
        inside = lambda: all((tmp_path / f"r{r}.entered-final").exists() for r in range(3))  # noqa: E731
        drill.wait_for(inside, limit_s(steps=EXAMPLE_STEPS, processes=3), "the final round")
        drill.kill("r1")
        for name in SURVIVORS:
            assert drill.wait_exit(name, FINISH_S) == 0, drill.tails()
    results = [json.loads((tmp_path / name / "result.json").read_text()) for name in SURVIVORS]
    assert all(r["step"] == EXAMPLE_STEPS and r["discarded_rounds"] >= 1 for r in results), results
    assert len({r["params_sha256"] for r in results}) == 1, results
