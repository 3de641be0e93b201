"""The run's secret, signed quorum claims and the heal transport, each on its own: no lighthouse,
no training. The multi-process attacks are in test_ft_attacks.py."""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from mtdao.sync import (
    LocalUpdateSync,
    OuterOptimizerConfig,
    desloc,
    explicit,
    gradient_averaging,
    unified,
)
from mtdao.sync.compression import SyncCodecs
from mtdao.sync.torchft.auth import TOKEN_ENV, RunKey, read_token, run_key
from mtdao.sync.torchft.proofs import Claim, exchange_claims
from mtdao.sync.torchft.round_identity import exchange_positions, sitting_out

pytest.importorskip("torchft")

from mtdao.sync.torchft.safe_transport import HealRefused, SignedHealTransport  # noqa: E402

SECRET = b"0123456789abcdef0123"
TIMEOUT = timedelta(seconds=5)


class DictStore:
    """The part of a c10d store the claim exchange uses."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.values[key]

    def wait(self, keys, timeout) -> None:
        missing = [k for k in keys if k not in self.values]
        if missing:
            raise TimeoutError(f"{missing} not set")


# -- the secret ---------------------------------------------------------------------------------


def test_the_secret_comes_from_the_file_first_then_the_environment(tmp_path):
    path = tmp_path / "token"
    path.write_text("from-the-file-0123456\n")
    environ = {TOKEN_ENV: "from-the-environment-0123"}
    assert read_token(str(path), environ) == b"from-the-file-0123456"
    assert read_token(None, environ) == b"from-the-environment-0123"
    assert read_token(None, {}) is None


def test_a_short_or_missing_secret_file_is_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="at least 16"):
        read_token(None, {TOKEN_ENV: "short"})
    with pytest.raises(ValueError, match="--auth-token-file .*nope"):
        read_token(str(tmp_path / "nope"), {})


def test_a_secret_is_required_unless_every_listener_is_on_loopback():
    assert not run_key(None, "127.0.0.1").is_secret
    assert not run_key(None, "::1").is_secret
    with pytest.raises(ValueError, match="--bind-host 10.0.0.5 serves other machines"):
        run_key(None, "10.0.0.5")
    assert run_key(SECRET, "10.0.0.5").is_secret
    assert "0123" not in repr(run_key(SECRET, "10.0.0.5"))


# -- claims -------------------------------------------------------------------------------------


def claim(replica: int, commits: int = 3, step: int = 12, config: str = "c") -> Claim:
    return Claim(replica, commits, step, config)


def test_a_claim_signed_with_another_secret_or_replayed_elsewhere_is_not_proven():
    store, key = DictStore(), RunKey(SECRET)
    exchange_claims(store, RunKey(b"another-secret-0000"), "q1", 1, 2, claim(1), 0.1)
    claims = exchange_claims(store, key, "q1", 0, 2, claim(0), 0.1)
    assert claims == [claim(0), None]
    # a claim copied to another quorum (or another rank) does not verify there
    replayed = DictStore()
    replayed.values["claim/1"] = store.values["claim/0"]
    assert exchange_claims(replayed, key, "q1", 0, 2, claim(0), 0.1)[1] is None
    assert exchange_claims(DictStore(), key, "q2", 0, 1, claim(0), 0.1) == [claim(0)]


def test_a_member_that_never_posts_is_not_proven():
    claims = exchange_claims(DictStore(), RunKey(SECRET), "q", 0, 3, claim(0), 0.05)
    assert claims == [claim(0), None, None]


def test_members_that_prove_different_sets_form_separate_groups():
    """Two members with the run's secret and one with another, in one quorum: the two sum over
    each other only, the third over itself (they used to overwrite each other's gloo addresses
    in the quorum's store, and no group formed)."""
    script = Path(__file__).with_name("membership_members.py")
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"0": 3.0, "1": 3.0, "2": 10.0}


def test_members_away_from_the_common_step_or_config_sit_the_round_out():
    assert sitting_out([(12, 5), (12, 5), (8, 5)]) == {2: "it is at step 8, the quorum at step 12"}
    assert sitting_out([(12, 5), (12, 6), (12, 5)]) == {1: "its config differs from the quorum's"}
    assert sitting_out([(4, 5), (8, 5)]) == {0: "it is at step 4, the quorum at step 8"}  # a tie
    assert sitting_out([(8, 5)]) == {}


def test_every_member_reads_every_members_step_from_one_sum():
    def sum_over_three(table):  # what the other two members add to the all-reduce
        others = torch.zeros(3, 2, dtype=torch.int64)
        others[0], others[2] = torch.tensor([12, 2**59]), torch.tensor([8, 2**59])
        return table + others.reshape(-1)

    positions = exchange_positions(sum_over_three, 1, 3, 12, 2**59)
    assert positions == [(12, 2**59), (12, 2**59), (8, 2**59)]


# -- the heal transport -------------------------------------------------------------------------


def transports(judge=lambda rank: ("take", f"replica {rank}"), receiver_secret=SECRET):
    sender = SignedHealTransport(RunKey(SECRET), "127.0.0.1", TIMEOUT, judge)
    receiver = SignedHealTransport(RunKey(receiver_secret), "127.0.0.1", TIMEOUT, judge)
    return sender, receiver


def test_a_state_travels_as_tensors_and_plain_data():
    sender, receiver = transports()
    state = {"user": {"w": torch.arange(4.0), "betas": (0.9, 0.95), "n": {1: None}}}
    try:
        sender.send_checkpoint([1], 7, state, TIMEOUT)
        received = receiver.recv_checkpoint(0, sender.metadata(), 7, TIMEOUT)
    finally:
        sender.shutdown(), receiver.shutdown()
    assert torch.equal(received["user"]["w"], state["user"]["w"])
    assert received["user"]["betas"] == (0.9, 0.95) and received["user"]["n"] == {1: None}
    assert receiver.received_bytes > 0


def test_a_peer_with_another_secret_neither_fetches_nor_serves_a_state():
    sender, receiver = transports(receiver_secret=b"another-secret-0000")
    try:
        sender.send_checkpoint([1], 7, {"user": {"w": torch.ones(2)}}, TIMEOUT)
        with pytest.raises(HealRefused, match="replica 0 at .* not signed with this run's secret"):
            receiver.recv_checkpoint(0, sender.metadata(), 7, TIMEOUT)
    finally:
        sender.shutdown(), receiver.shutdown()


class Payload:
    marker = ""

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_from_a_peer_is_refused_before_a_byte_of_it_is_read(tmp_path):
    """What torchft's own transport would have unpickled, served by a peer without the secret."""
    marker = tmp_path / "payload-ran"
    Payload.marker = str(marker)
    buffer = io.BytesIO()
    torch.save({"user": Payload()}, buffer, pickle_module=pickle)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("X-Mtdao-Signature", "0" * 64)
            self.end_headers()
            self.wfile.write(buffer.getvalue())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _, receiver = transports()
    url = f"http://127.0.0.1:{server.server_address[1]}/heal/"
    try:
        with pytest.raises(HealRefused, match="nothing of it was read"):
            receiver.recv_checkpoint(0, url, 7, TIMEOUT)
        with pytest.raises(HealRefused, match="is no URL"):
            receiver.recv_checkpoint(0, "file:///etc/passwd", 7, TIMEOUT)
    finally:
        server.shutdown(), receiver.shutdown()
    assert not marker.exists()


def test_a_source_the_judge_rejects_is_never_contacted():
    def judge(rank):
        return ("keep", "x") if rank == 0 else ("refuse", "the peer claiming replica id 9")

    _, receiver = transports(judge=judge)
    try:
        kept = receiver.recv_checkpoint(0, "http://unreachable.invalid:1/heal/", 7, TIMEOUT)
        with pytest.raises(HealRefused, match="not healing from the peer claiming replica id 9"):
            receiver.recv_checkpoint(1, "http://unreachable.invalid:1/heal/", 7, TIMEOUT)
    finally:
        receiver.shutdown()
    assert kept["torchft"] == {"step": 0, "batches_committed": 0}
    assert kept["user"]["engine"] is kept["user"]


ENGINES = {
    "unified": lambda: dict(policy=unified(2)),
    "diloco, nesterov": lambda: dict(policy=explicit(2, outer=OuterOptimizerConfig())),
    "desloc": lambda: dict(policy=desloc(2)),
    "ddp": lambda: dict(policy=gradient_averaging()),
    "int8 with error feedback": lambda: dict(
        policy=unified(2), codecs=SyncCodecs.parse(["int8"], error_feedback=True)
    ),
}


@pytest.mark.parametrize("name", ENGINES)
def test_every_engines_heal_state_loads_with_the_safe_loader(name):
    """What a healing replica receives is tensors and plain data only, for every policy."""
    from mtdao import MTAdam
    from mtdao.sync.torchft import engine_state

    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4, generator=gen)) for _ in range(2)]
    sync = LocalUpdateSync(MTAdam(params, lr=1e-2), **ENGINES[name]())
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        sync.step()
    state = engine_state(sync)[0]()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    engine_state(sync)[1](loaded)  # and it loads back
    assert loaded["sync"]["step"] == 3
