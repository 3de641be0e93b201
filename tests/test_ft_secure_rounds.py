"""The security of a fault-tolerant run and the round options together: two replicas sharing a
secret (signed claims, signed heals, the step and config check at every quorum) with delayed,
int8 rounds with error feedback finish, every round averaged between the two of them, and hold
the same global state after every round. Real processes on loopback (mtdao.testing.fault_drill).
"""

from __future__ import annotations

import pytest
from wait_limits import limit_s

from mtdao.testing.fault_drill import Drill

pytest.importorskip("torchft")

pytestmark = pytest.mark.slow

TOKEN_ENV = "MTDAO_AUTH_TOKEN"
SECRET = "a-secret-of-this-test-run-0123456789"
K, STEPS = 4, 16
FLAGS = dict(model="micro", batch_size=2, seq_len=16, eval_tokens=256, sync_period=K)
FLAGS.update(workers=2, steps=STEPS, sync_delay=1, sync_dtype="int8")
TIMEOUTS = ["--collective-timeout", "10", "--connect-timeout", "10", "--quorum-timeout", "60"]
RUN_S = limit_s(steps=STEPS, processes=2)  # both replicas' whole runs: no peer dies, no timeout


def flags(corpus) -> list[str]:
    argv = ["--data", str(corpus), "--no-progress", "--error-feedback", *TIMEOUTS]
    for name, value in FLAGS.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def test_replicas_with_a_secret_and_every_round_option_agree(corpus_dir, tmp_path):
    with Drill(tmp_path / "drill", flags(corpus_dir), join_timeout=20.0) as drill:
        drill.env[TOKEN_ENV] = SECRET
        drill.start_lighthouse(min_replicas=2)
        for replica in range(2):
            drill.start(f"r{replica}", replica)
        exits = {name: drill.wait_exit(name, RUN_S) for name in ("r0", "r1")}
        assert exits == {"r0": 0, "r1": 0}, drill.tails()
        for name in ("r0", "r1"):
            assert not drill.events(name, "discarded"), drill.tails()
            committed = drill.events(name, "committed")
            assert {tuple(e["replicas"]) for e in committed} == {(0, 1)}, drill.tails()
            assert "refused" not in drill.log(name) and "sitting" not in drill.log(name)
        globals_0, globals_1 = drill.global_rounds("r0"), drill.global_rounds("r1")
        assert len(globals_0) >= STEPS // K - 1, drill.tails()
        assert globals_0 == globals_1, drill.tails()
