"""``--min-replicas N`` on the lighthouse: no round is averaged among fewer than N replicas, even
when a member the lighthouse counted drops out before it proves itself. Here a holder of the run's
secret asks for every quorum (so the lighthouse, --min-replicas 2, forms each one with replica 0)
but never confirms one: replica 0 alone proves its claim, so it averages nothing and says why. It
used to train and commit its rounds alone, in a proven quorum of one."""

from __future__ import annotations

import contextlib
import socket
import threading
from datetime import timedelta

import pytest
from wait_limits import limit_s

from mtdao.ft.security.auth import read_token, run_key
from mtdao.ft.security.proofs import Claim, claim_data, new_nonce
from mtdao.testing.fault_drill import Drill

pytest.importorskip("torchft")

from torchft._torchft import LighthouseClient  # noqa: E402

pytestmark = pytest.mark.slow

K = 4
FLAGS = ["--model", "micro", "--batch-size", "2", "--seq-len", "16", "--eval-tokens", "256"]
FLAGS += ["--sync-period", str(K), "--workers", "2", "--steps", str(4 * K), "--no-progress"]
FLAGS += ["--connect-timeout", "3", "--quorum-timeout", "60"]
CONFIRM_S = 3.0  # a member's wait for another's confirmation: --connect-timeout here
LINE = "1 replica proved its claim (replica 0), the lighthouse's --min-replicas is 2"


def silent_member(lighthouse: str, key, stop: threading.Event) -> None:
    """Ask for quorums as replica 1, with claims signed with the run's secret that name a store
    nobody serves, so no confirmation of this member is ever found."""
    with socket.create_server(("127.0.0.1", 0)) as closed:
        nowhere = f"127.0.0.1:{closed.getsockname()[1]}"
    client = LighthouseClient(f"http://{lighthouse}", timedelta(seconds=5))
    member = "1:silent"
    while not stop.is_set():
        heal = ("http://127.0.0.1:1/heal/",)
        claim = Claim(1, member, 0, 0, "c", 1, nowhere, heal, nonce=new_nonce())
        with contextlib.suppress(Exception):  # refused or timed out: ask again
            client.quorum(
                replica_id=member, timeout=timedelta(seconds=5), data=claim_data(claim, key)
            )
        with contextlib.suppress(Exception):  # alive for the lighthouse between its requests
            client.heartbeat(member)


def test_a_proven_quorum_below_min_replicas_averages_nothing(corpus_dir, tmp_path):
    token = tmp_path / "run.token"
    token.write_text("0123456789abcdef0123456789abcdef\n")
    key = run_key(read_token(str(token)), "127.0.0.1")
    secret = ["--auth-token-file", str(token)]
    flags = ["--data", str(corpus_dir), *FLAGS, *secret]
    stop = threading.Event()
    with Drill(tmp_path / "drill", flags, heartbeat_timeout=5.0, join_timeout=5.0) as drill:
        drill.start_lighthouse(min_replicas=2, flags=secret)
        serving = lambda: "serving at" in drill.log("lighthouse")  # noqa: E731
        drill.wait_for(serving, limit_s(), "the lighthouse")
        asker = threading.Thread(target=silent_member, args=(drill.lighthouse, key, stop))
        asker.start()
        try:
            drill.start("r0", 0)
            said = lambda: LINE in drill.log("r0")  # noqa: E731
            drill.wait_for(said, limit_s(sat_out_s=3 * CONFIRM_S + 5.0), "the discard line")
            # it asks again at once, and again: each quorum is discarded, the line said once a
            # minute (a joiner asks until its first quorum stands)
            more = lambda: len(drill.events("r0", "discarded")) >= 3  # noqa: E731
            drill.wait_for(more, limit_s(sat_out_s=6 * CONFIRM_S + 5.0), "three discards")
            assert drill.returncode("r0") is None, drill.tails()
            assert drill.events("r0", "committed") == [], drill.tails()
            assert drill.log("r0").count(LINE) < len(drill.events("r0", "discarded")), drill.tails()
        finally:
            stop.set()
            asker.join()
