"""A partition during a delayed round ends in a discarded round and local training within
seconds. Real processes, each in a network namespace of its own on a link this test makes
(mtdao.testing.network.netem; needs root and namespace support, skips otherwise): the lighthouse and
two replicas with ``--sync-delay 2 --sync-dtype int8 --error-feedback``; replica 1 is held inside
the round that replica 0 then waits in, cut off, then let go. Replica 0 used to stand still in
that collective until ``--collective-timeout`` without a word; once it gave the round up, its
next quorum's group stood still as long, leaving the group the lost collective was pending on."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from wait_limits import limit_s

from mtdao.testing.fault_drill import Drill
from mtdao.testing.ports import unused_port

pytest.importorskip("torchft")

pytestmark = pytest.mark.slow

SECRET = "a-secret-of-this-test-run-0123456789"
K, STEPS, HELD_AT = 4, 32, 8  # replica 1 is held where the round opened at step 6 lands
COLLECTIVE_TIMEOUT_S, CONNECT_S, HEARTBEAT_S = 120, 10, 1
# the collective watch gives a lost peer up after 5 s, then 3 missed probes a second apart, each
# timing out after 1 s (mtdao.ft.collective_watch)
PEER_GIVE_UP_S = 5.0 + 3 * (1.0 + 1.0)
# what the test claims, not a guess at a wait: the round is discarded within seconds (the watch's
# give-up time; 10 s measured on a busy machine), not at --collective-timeout
BOUND_S = 30.0
IP_S = 30  # ip(8) sets a link up or down in milliseconds: longer is a hang
FLAGS = dict(model="micro", batch_size=2, seq_len=16, eval_tokens=256, sync_period=K)
FLAGS.update(workers=2, steps=STEPS, sync_delay=2, sync_dtype="int8")


@pytest.fixture
def link():
    from mtdao.testing.network.netem import LinkUnavailable, emulated_link

    try:
        with emulated_link(3, 1000.0, prefix="mtdaopart") as made:
            yield made
    except LinkUnavailable as error:
        pytest.skip(str(error))


def flags(corpus) -> list[str]:
    argv = ["--data", str(corpus), "--no-progress", "--error-feedback"]
    argv += ["--collective-timeout", str(COLLECTIVE_TIMEOUT_S), "--connect-timeout", str(CONNECT_S)]
    argv += ["--quorum-timeout", "60"]
    for name, value in FLAGS.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def set_port(link, host: int, state: str) -> None:
    subprocess.run(
        ["ip", "-n", link.hub, "link", "set", f"port{host}", state], check=True, timeout=IP_S
    )


def test_a_partition_during_a_delayed_round_is_discarded_within_seconds(link, corpus_dir, tmp_path):
    with Drill(tmp_path / "drill", flags(corpus_dir)) as drill:
        drill.env["MTDAO_AUTH_TOKEN"] = SECRET
        port = unused_port()
        drill.lighthouse = f"{link.addresses[0]}:{port}"
        inside = lambda host: ["ip", "netns", "exec", link.hosts[host], sys.executable]  # noqa: E731
        drill._spawn("lighthouse", [
            *inside(0), "-m", "mtdao", "lighthouse", "--bind-host", link.addresses[0],
            "--port", str(port), "--min-replicas", "1", "--heartbeat-timeout", str(HEARTBEAT_S),
            "--join-timeout", "20",
        ])  # fmt: skip
        drill.hold_round("r1", HELD_AT)
        drill.gate(0)  # both start before either trains on alone
        for replica in (0, 1):
            name = f"r{replica}"
            drill._spawn(name, [
                *inside(replica + 1), "-m", "mtdao.testing.fault_drill", str(drill.root), name,
                "--", "--fault-tolerant", "--replica-id", str(replica), "--lighthouse",
                drill.lighthouse, "--out", str(drill.root / name), "--bind-host",
                link.addresses[replica + 1], *drill.train_flags,
            ])  # fmt: skip
        at_gate = lambda: all(drill.status(n) == ("waiting", 0) for n in ("r0", "r1"))  # noqa: E731
        drill.wait_for(at_gate, limit_s(processes=2), "both replicas at the gate")
        drill.gate(None)
        # the rest of their start (the first quorum, its process group) and HELD_AT steps
        held_s = limit_s(steps=HELD_AT, processes=2)
        drill.wait_for(lambda: drill.entered_round("r1", HELD_AT), held_s, "r1 held")
        time.sleep(1.0)  # replica 0 is in the round's collective, waiting for replica 1
        set_port(link, 2, "down")  # replica 1 is cut off
        cut = time.time()
        drill.release_round("r1", HELD_AT)
        discarded = lambda: any(  # noqa: E731
            e["step"] >= HELD_AT for e in drill.events("r0", "discarded")
        )
        took = drill.wait_for(discarded, BOUND_S, "replica 0 to discard the round")
        trains_on = lambda: drill.status("r0")[1] >= HELD_AT + K  # noqa: E731
        # K steps and a quorum without replica 1, which the lighthouse no longer hears from
        trains_on_s = limit_s(starts=0, steps=K, processes=2, sat_out_s=HEARTBEAT_S)
        drill.wait_for(trains_on, trains_on_s, "replica 0 to train on locally")
        set_port(link, 2, "up")
        # replica 1 gives replica 0 up as replica 0 gave it up; its lighthouse probe sent while
        # it was cut off waits out --connect-timeout; then it starts a new manager and rejoins
        rest_s = limit_s(steps=STEPS - HELD_AT, processes=2, sat_out_s=PEER_GIVE_UP_S + CONNECT_S)
        for name in ("r0", "r1"):
            assert drill.wait_exit(name, rest_s) == 0, drill.tails()
        log = drill.log("r0")
        assert "waiting 5 s for the round of the quorum at step" in log, drill.tails()
        assert "with replicas 1; probing them" in log, drill.tails()
        assert "replica 1 (" in log and "stopped answering" in log, drill.tails()
        print(f"\npartition during a delayed round: replica 0 discarded it {took:.1f} s after "
              f"the cut (collective timeout {COLLECTIVE_TIMEOUT_S} s), cut at {cut:.0f}")  # fmt: skip
