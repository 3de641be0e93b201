"""Where a fault-tolerant run listens, and what it does when its lighthouse goes away: real
processes on loopback (mtdao lighthouse and mtdao train --fault-tolerant replicas).

* every listener of a replica and of the lighthouse is on the --bind-host it was given (read from
  /proc/net/tcp*, by socket inode of the process), but for torchft's own servers, each on
  loopback behind its front; the replica says where it serves; in the same run, torchft's
  dashboard (``GET /status``, ``POST /replica/<id>/kill``) is not served, over HTTP/1 or HTTP/2,
  and a replica stopped on purpose (SIGTERM) exits with one line, its peer going on;
* a lighthouse killed with SIGKILL and restarted on the same address 10 s later: the replicas
  train on locally meanwhile, saying so, rejoin it, and finish with the same state;
* a lighthouse killed while a replica's quorum waits in it: the quorum fails within seconds,
  not after --quorum-timeout, and, the lighthouse staying away, no try of the final round
  commits: the replica says so in one line and exits non-zero;
* a replica whose last round is discarded (--no-final-round) still evaluates its last step.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from grpc_calls import grpc_status, http2_request
from wait_limits import limit_s

from mtdao.ft.connection import WATCH_EVERY_S, WATCH_GRACE_S, WATCH_MISSES
from mtdao.sync.engine import FINAL_ROUND_TRIES
from mtdao.testing.fault_drill import EXIT_AFTER_SIGNAL_S, Drill

pytest.importorskip("torchft")

pytestmark = pytest.mark.slow

K = 4
FLAGS = dict(model="micro", batch_size=2, seq_len=16, eval_tokens=256, sync_period=K, workers=2)
CONNECT_S = 3
TIMEOUTS = ["--collective-timeout", "10", "--connect-timeout", str(CONNECT_S)]
TIMEOUTS += ["--quorum-timeout", "60"]
LIGHTHOUSE_AWAY_S = 10.0  # the shortest outage the issue reproduced
# A replica's quorum gives a dead lighthouse up after a grace and WATCH_MISSES probes a second
# apart, each failing within the connect timeout (at once on loopback)
LIGHTHOUSE_GIVE_UP_S = WATCH_GRACE_S + WATCH_MISSES * (WATCH_EVERY_S + CONNECT_S)
REQUEST_S = 10  # the lighthouse on loopback answers in milliseconds: longer is a hang
# A wait counts a start (wait_limits) when it takes in a launch or, after the last step, an
# evaluation, a checkpoint and the exit. A lighthouse that is gone refuses connections at once.


def flags(corpus, steps: int) -> list[str]:
    argv = ["--data", str(corpus), "--no-progress", "--steps", str(steps), *TIMEOUTS]
    for name, value in FLAGS.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def listening(pid: int) -> set[str]:
    """The local addresses (host:port) of the TCP sockets process ``pid`` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.add(decode_address(fields[1], family))
    return found


def decode_address(text: str, family: int) -> str:
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    # /proc/net writes each 32-bit word in host (little-endian) order
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    address = socket.inet_ntop(family, raw).removeprefix("::ffff:")
    return f"{address}:{int(port, 16)}"


def hosts(addresses: set[str]) -> set[str]:
    return {address.rsplit(":", 1)[0] for address in addresses}


def both_at(drill: Drill, step: int) -> bool:
    return all(drill.status(name) == ("waiting", step) for name in ("r0", "r1"))


def test_listeners_on_the_bind_host_no_dashboard_and_a_clean_stop(corpus_dir, tmp_path):
    steps = 8 * K
    with Drill(tmp_path / "drill", flags(corpus_dir, steps), join_timeout=10.0) as drill:
        # one replica may go on alone once the other is stopped
        drill.start_lighthouse(min_replicas=1, bind_host="127.0.0.4")
        drill.gate(0)  # both connected before the first quorum: it holds both
        drill.start("r0", 0, ["--bind-host", "127.0.0.2"])
        drill.start("r1", 1, ["--bind-host", "127.0.0.3"])
        drill.wait_for(lambda: both_at(drill, 0), limit_s(processes=2), "both replicas at 0")
        drill.gate(K)  # both wait after the first round: gloo's sockets are open then
        first_round_s = limit_s(steps=K, processes=2)
        drill.wait_for(lambda: both_at(drill, K), first_round_s, "both after their first round")
        seen = {name: listening(drill.processes[name].pid) for name in ("lighthouse", "r0", "r1")}
        url = f"http://{drill.lighthouse}"
        for request in (
            urllib.request.Request(f"{url}/status"),
            urllib.request.Request(f"{url}/replica/0/kill", method="POST"),
        ):
            with pytest.raises((http.client.HTTPException, OSError)):  # HTTP/1: no answer
                urllib.request.urlopen(request, timeout=REQUEST_S)
        for path in ("/replica/0/kill", "/status", "/"):  # gRPC's protocol, the dashboard's paths
            assert grpc_status(http2_request(drill.lighthouse, "POST", path)) is None
        time.sleep(1.0)
        assert drill.returncode("r0") is None and drill.returncode("r1") is None, drill.tails()
        drill.gate(steps - 2 * K)  # neither may finish before r1 is asked to stop
        running = lambda: all(drill.status(n)[1] > K for n in ("r0", "r1"))  # noqa: E731
        drill.wait_for(running, limit_s(steps=K, processes=2), "both training on")
        assert drill.stop("r1") == 130, drill.tails()  # SIGTERM: as Ctrl-C, no crash
        assert "mtdao train: interrupted" in drill.log("r1")
        drill.gate(None)
        # r0's rest alone; its next quorum waits until the lighthouse stops counting r1
        rest_s = limit_s(steps=steps, processes=1, sat_out_s=drill.heartbeat_timeout)
        assert drill.wait_exit("r0", rest_s) == 0, drill.tails()
        assert "replica 1 left" in drill.log("r0"), drill.tails()
    # the lighthouse: its front on the bind host, torchft's own server behind it on loopback
    front = {a for a in seen["lighthouse"] if not a.startswith("127.0.0.1:")}
    assert front == {f"127.0.0.4:{drill.port}"} and len(seen["lighthouse"]) == 2, seen
    # a replica: everything on its bind host but torchft's manager server, which sits behind
    # the manager's front on loopback
    for name, host in (("r0", "127.0.0.2"), ("r1", "127.0.0.3")):
        assert re.search(rf"serving on {host}: manager {host}:\d+ ", drill.log(name)), drill.log(
            name
        )
        behind = re.search(r"torchft's server behind it on (127\.0\.0\.1:\d+)", drill.log(name))
        assert behind, drill.log(name)
        assert behind[1] in seen[name] and hosts(seen[name] - {behind[1]}) == {host}, seen
        assert len(seen[name]) >= 5, seen  # manager and its front, store, heal server, gloo
    assert "serving at http://127.0.0.4:" in drill.log("lighthouse")


def kill_the_lighthouse_when_both_replicas_reach(drill: Drill, step: int) -> None:
    """Start a lighthouse and replicas r0 and r1, hold both at ``step`` and SIGKILL the
    lighthouse there; the replicas stay held (move the gate to go on)."""
    drill.start_lighthouse(min_replicas=2)
    drill.gate(step)
    drill.start("r0", 0)
    drill.start("r1", 1)
    at_gate_s = limit_s(steps=step, processes=2)
    drill.wait_for(lambda: both_at(drill, step), at_gate_s, "both replicas at the gate")
    drill.processes["lighthouse"].send_signal(signal.SIGKILL)
    drill.processes["lighthouse"].wait(timeout=EXIT_AFTER_SIGNAL_S)


def test_replicas_train_on_while_the_lighthouse_is_away_and_rejoin_it(corpus_dir, tmp_path):
    steps = 8 * K
    with Drill(tmp_path / "drill", flags(corpus_dir, steps), join_timeout=10.0) as drill:
        kill_the_lighthouse_when_both_replicas_reach(drill, 2 * K)
        away_since = time.time()
        drill.gate(4 * K)  # two rounds without a lighthouse
        outage_s = limit_s(starts=0, steps=2 * K, processes=2)  # no round waits for it
        drill.wait_for(lambda: both_at(drill, 4 * K), outage_s, "both replicas past the outage")
        time.sleep(max(0.0, LIGHTHOUSE_AWAY_S - (time.time() - away_since)))
        drill.start_lighthouse(min_replicas=2)  # the same address
        serving = lambda: "serving at" in drill.log("lighthouse")  # noqa: E731
        drill.wait_for(serving, limit_s(), "the restarted lighthouse")  # the replicas are held
        drill.gate(None)
        for name in ("r0", "r1"):  # the rest: a new manager each and the first quorum
            assert drill.wait_exit(name, limit_s(steps=4 * K, processes=2)) == 0, drill.tails()
        for name in ("r0", "r1"):
            log = drill.log(name)
            away = "unreachable; training on locally until it is back"
            discarded = [e for e in drill.events(name, "discarded") if away in e["reason"]]
            assert len(discarded) >= 2 and log.count(away) == 1, drill.tails()  # once a minute
            assert "the lighthouse is back; averaging over replicas 0, 1" in log, drill.tails()
            steps_committed = [e["step"] for e in drill.events(name, "committed")]
            assert steps_committed[-1] == steps and 3 * K not in steps_committed, steps_committed
        assert drill.rounds("r0")[steps] == drill.rounds("r1")[steps], drill.tails()


def test_a_quorum_waiting_on_a_lighthouse_that_dies_fails_at_once_and_so_does_the_run(
    corpus_dir, tmp_path
):
    """torchft's manager, its call to a dead lighthouse failed, leaves the replica's quorum
    waiting out --quorum-timeout (60 s here); the replica's watch ends it within seconds. The
    lighthouse stays away: no try of the final round commits, which ends the run in one line."""
    steps = 4 * K
    with Drill(tmp_path / "drill", flags(corpus_dir, steps), join_timeout=10.0) as drill:
        drill.start_lighthouse(min_replicas=2)
        drill.gate(K)
        drill.start("r0", 0)
        drill.start("r1", 1)
        first_round_s = limit_s(steps=K, processes=2)
        drill.wait_for(lambda: both_at(drill, K), first_round_s, "both replicas at the gate")
        drill.kill("r1")  # r0's next quorum waits for a second replica that never comes
        drill.gate(None)
        at_round = lambda: drill.status("r0")[1] >= 2 * K - 1  # noqa: E731
        at_round_s = limit_s(starts=0, steps=K - 1, processes=1)  # r0 alone
        drill.wait_for(at_round, at_round_s, "r0 at its second round's quorum")
        time.sleep(3.0)  # the quorum is waiting in the lighthouse
        drill.processes["lighthouse"].send_signal(signal.SIGKILL)
        drill.processes["lighthouse"].wait(timeout=EXIT_AFTER_SIGNAL_S)
        # the watch gives the lighthouse up; r0 says so at the step it trains on
        away_s = limit_s(starts=0, steps=1, processes=1, sat_out_s=LIGHTHOUSE_GIVE_UP_S)
        away = lambda: "unreachable; training on locally" in drill.log("r0")  # noqa: E731
        waited = drill.wait_for(away, away_s, "r0 to give the quorum up")
        assert waited < 20.0, drill.tails()  # --quorum-timeout is 60 s
        # the lighthouse stays away for the last round and the final round: each of the final
        # round's FINAL_ROUND_TRIES tries (a second apart) is discarded, and r0, which does not
        # hold the run's one model, says so in one line and exits non-zero
        limit = limit_s(steps=2 * K, processes=1, sat_out_s=FINAL_ROUND_TRIES)
        assert drill.wait_exit("r0", limit) == 2, drill.tails()
        discarded = [e["step"] for e in drill.events("r0", "discarded")]
        assert discarded[-1 - FINAL_ROUND_TRIES :] == [steps] * (1 + FINAL_ROUND_TRIES), discarded
        errors = [line for line in drill.log("r0").splitlines() if "error" in line]
        assert len(errors) == 1, drill.tails()
        assert errors[0].startswith(
            f"mtdao train: error: the final round was discarded {FINAL_ROUND_TRIES} times"
        ), errors
        assert "the lighthouse at http://" in errors[0], errors


def test_a_replica_whose_last_round_is_discarded_still_evaluates_its_last_step(
    corpus_dir, tmp_path
):
    steps = 3 * K
    with Drill(tmp_path / "drill", flags(corpus_dir, steps), join_timeout=10.0) as drill:
        drill.train_flags.append("--no-final-round")
        kill_the_lighthouse_when_both_replicas_reach(drill, 2 * K)  # gone for the last round
        drill.gate(None)
        for name in ("r0", "r1"):  # the last K steps, the end
            assert drill.wait_exit(name, limit_s(steps=K, processes=2)) == 0, drill.tails()
            assert [e["step"] for e in drill.events(name, "discarded")] == [steps], drill.tails()
            records = [json.loads(line) for line in (drill.root / name / "metrics.jsonl").open()]
            evaluations = [r for r in records if "val_loss" in r]
            results = json.loads((drill.root / name / "results.json").read_text())
            assert evaluations[-1]["step"] == steps, evaluations
            assert results["final_val_loss"] == evaluations[-1]["val_loss"]
