"""The run's secret, signed quorum claims and the heal transport, each on its own: no lighthouse,
no training. Replays are in test_ft_replay.py, the multi-process attacks in test_ft_attacks.py."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import pickle
import stat
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from dict_store import DictStore
from wait_limits import limit_s

from mtdao.ft.parity import summed_rows
from mtdao.ft.round_identity import sitting_out
from mtdao.ft.security import auth
from mtdao.ft.security.auth import TOKEN_ENV, RunKey, machine_secret, read_token, run_key
from mtdao.ft.security.proofs import Claim, claim_data, confirm_quorum, read_claim
from mtdao.sync import (
    LocalUpdateSync,
    OuterOptimizerConfig,
    desloc,
    explicit,
    gradient_averaging,
    unified,
)
from mtdao.sync.codecs.compression import SyncCodecs

pytest.importorskip("torchft")

from heal_peers import answering  # noqa: E402

from mtdao.ft.security.safe_transport import (  # noqa: E402
    HealBinding,
    HealRefused,
    Quorum,
    SignedHealTransport,
)

SECRET = b"0123456789abcdef0123"
TIMEOUT = timedelta(seconds=5)


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


def test_a_secret_is_required_off_loopback_and_on_loopback_the_accounts_own_stands_in(tmp_path):
    """Without one, replicas on loopback prove themselves with this account's secret on this
    machine, which a process of another account cannot read (it used to be an empty key that
    anyone running mtdao could sign with)."""
    key = run_key(None, "127.0.0.1", secret_dir=tmp_path / "mtdao")
    assert key.is_secret and "this account's secret" in key.origin
    assert run_key(None, "::1", secret_dir=tmp_path / "mtdao").sign("x") == key.sign("x")
    assert RunKey(b"").sign("x") != key.sign("x")
    with pytest.raises(ValueError, match="--bind-host 10.0.0.5 serves other machines"):
        run_key(None, "10.0.0.5")
    assert run_key(SECRET, "10.0.0.5").is_secret
    assert "0123" not in repr(run_key(SECRET, "10.0.0.5"))


def test_the_accounts_secret_is_private_and_made_once(tmp_path):
    directory = tmp_path / "mtdao"
    first = machine_secret(directory)
    assert machine_secret(directory) == first and len(first) >= 32
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE((directory / "loopback.secret").stat().st_mode) == 0o600
    (directory / "loopback.secret").chmod(0o644)
    with pytest.raises(ValueError, match="other accounts could read it; chmod 600"):
        machine_secret(directory)
    (directory / "loopback.secret").chmod(0o600)
    directory.chmod(0o755)
    with pytest.raises(ValueError, match="other accounts could read it; chmod 700"):
        machine_secret(directory)


def _fifo(path):
    os.mkfifo(path, 0o600)


def _directory(path):
    path.mkdir(mode=0o700)


def _not_text(path):
    path.write_bytes(b"\xff\xfe" * 20)
    path.chmod(0o600)


@pytest.mark.parametrize(
    "make, reason",
    [
        (_directory, "it is a directory; delete it"),
        (_fifo, "it is not a regular file; delete it"),
        (_not_text, "it is not UTF-8 text; delete it"),
    ],
    ids=["directory", "fifo", "not-text"],
)
def test_a_loopback_secret_that_is_no_secret_file_is_one_line_naming_it(tmp_path, make, reason):
    """Refused at once (a FIFO is never waited on), naming the file and the fix."""
    directory = tmp_path / "mtdao"
    directory.mkdir(mode=0o700)
    path = directory / "loopback.secret"
    make(path)
    outcome = []

    def read():
        try:
            machine_secret(directory)
        except ValueError as error:
            outcome.append(str(error))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "waited on the secret"
    assert outcome == [
        f"cannot read this account's secret for loopback runs from {path}: {reason}, and the "
        "next replica or lighthouse makes a new one"
    ]


def test_an_unreadable_loopback_secret_names_the_file_and_the_fix(tmp_path, monkeypatch):
    directory = tmp_path / "mtdao"
    machine_secret(directory)
    path = directory / "loopback.secret"

    def denied(path):  # what an account without read permission gets (root reads anything)
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(auth, "_read_regular_file", denied)
    with pytest.raises(ValueError) as refused:
        machine_secret(directory)
    assert str(refused.value) == (
        f"cannot read this account's secret for loopback runs from {path}: Permission denied; "
        f"chmod 600 {path}, or delete it, and the next replica or lighthouse makes a new one"
    )


def test_a_file_in_the_secret_directorys_place_is_one_line(tmp_path):
    directory = tmp_path / "mtdao"
    directory.write_text("not a directory")
    with pytest.raises(ValueError) as refused:
        machine_secret(directory)
    assert str(refused.value) == (
        f"cannot make {directory}, where replicas on loopback keep this account's secret (a file "
        "is in its place: remove it), or give the run a secret with --auth-token-file"
    )


def test_a_new_loopback_secret_is_said_once_by_the_process_that_made_it(tmp_path, caplog):
    """Deleted and made again, the secret no longer matches what running processes hold: the
    process that makes it says so, once; the ones that read it say nothing."""
    directory = tmp_path / "mtdao"
    with caplog.at_level(logging.WARNING, logger="mtdao.ft.security.auth"):
        first = machine_secret(directory)
        assert machine_secret(directory) == first
        (directory / "loopback.secret").unlink()
        assert machine_secret(directory) != first
    made = [r.getMessage() for r in caplog.records if "made this account's secret" in r.message]
    path = directory / "loopback.secret"
    assert made == 2 * [
        f"made this account's secret for loopback runs in {path} (there was none): a lighthouse "
        "or replica that started before it holds a former one and cannot run with this process: "
        "restart them"
    ]


def test_a_secret_file_that_is_not_text_or_not_a_file_names_it_and_the_fix(tmp_path):
    path = tmp_path / "token"
    path.write_bytes(b"\xff" * 40)
    with pytest.raises(ValueError, match=rf"^--auth-token-file {path} is not UTF-8 text: write"):
        read_token(str(path), {})
    with pytest.raises(ValueError) as refused:
        read_token(str(tmp_path), {})
    assert str(refused.value) == (
        f"--auth-token-file {tmp_path}: Is a directory; give a file holding the run's secret"
    )


# -- claims -------------------------------------------------------------------------------------


def claim(replica: int, commits: int = 3, step: int = 12, config: str = "c") -> Claim:
    return Claim(
        replica_id=replica,
        member=f"{replica}:uuid-{replica}",
        commits=commits,
        step=step,
        config=config,
        shards=1,
        store=f"store-{replica}:1",
        heal=("http://127.0.0.1:1/heal/",),
        nonce=f"nonce-{replica}-{commits}",
    )


def test_a_claim_signed_with_another_secret_or_naming_another_member_proves_nothing():
    key, mine = RunKey(SECRET), claim(1)
    assert read_claim(mine.member, claim_data(mine, key), key) == (mine, "")
    _, why = read_claim(mine.member, claim_data(mine, RunKey(b"another-secret-0000")), key)
    assert why == "its claim is not signed with this run's secret"
    _, why = read_claim("2:uuid-2", claim_data(mine, key), key)  # handed in under another id
    assert why.startswith("its claim was made by another member (1:uuid-1)")
    tampered = json.loads(claim_data(mine, key)["mtdao"])
    tampered["claim"] = tampered["claim"].replace('"commits": 3', '"commits": 9')
    _, why = read_claim(mine.member, {"mtdao": json.dumps(tampered)}, key)
    assert why == "its claim is not signed with this run's secret"


def test_a_signature_or_field_no_hash_expects_is_a_wrong_signature_not_an_error():
    key, mine = RunKey(SECRET), claim(1)
    assert not key.verifies("é" * 64, "claim", "x")  # compare_digest raises on non-ASCII text
    assert not key.verifies(key.sign("claim", "x"), "claim", "\ud800")  # a lone surrogate
    posted = json.loads(claim_data(mine, key)["mtdao"])
    for forged in ("é", None, 7, ["a"]):
        found, why = read_claim(mine.member, {"mtdao": json.dumps({**posted, "sig": forged})}, key)
        assert found is None and why == "its claim is not signed with this run's secret", forged


def signed_with(field: str, value) -> dict[str, str]:
    """Quorum data carrying claim(1) signed with the run's secret, ``field`` set to ``value``."""
    body = json.dumps({**json.loads(claim(1).body()), field: value})
    return {"mtdao": json.dumps({"claim": body, "sig": RunKey(SECRET).sign("claim", body)})}


@pytest.mark.parametrize(
    "field, value",
    [
        ("nonce", [1]),  # unhashable in SeenNonces
        ("member", 5),  # no len() in short_member
        ("commits", float("nan")),  # a ZeroDivisionError in every member's plan_quorum
        ("commits", "3"),
        ("commits", float("inf")),  # 1e400 reads as inf
        ("commits", True),
        ("commits", 3.0),
        ("commits", 2**70),  # past what torchft's lighthouse takes (i64)
        ("step", None),
        ("replica_id", 1.5),
        ("shards", [1]),
        ("commit_failures", "0"),
        ("config", None),
        ("store", 1),
        ("refused", [[1]]),
        ("refused", "1:a"),  # a string is no list of them
        ("heal", "http://h:1"),
        ("heal", [5]),
        ("heal", ["http://h:99999"]),  # ValueError in every member's ProvenManager._peers
        ("heal", ["http://[::1"]),
        ("heal", ["http://h:abc"]),
    ],
)
def test_a_signed_claim_with_a_field_of_another_type_is_refused_naming_it(field, value):
    found, why = read_claim(claim(1).member, signed_with(field, value), RunKey(SECRET))
    assert found is None and why.startswith("its claim is not readable") and field in why


@pytest.mark.parametrize(
    "field, value",
    [("step", -1), ("heal", []), ("heal", ["http://[::1]:5", "http://host-0:200/heal/"])],
)
def test_what_an_honest_replica_claims_is_read(field, value):
    found, why = read_claim(claim(1).member, signed_with(field, value), RunKey(SECRET))
    assert why == "" and getattr(found, field) == (tuple(value) if field == "heal" else value)


def test_a_peer_that_sends_no_claim_is_refused_at_once():
    for data in (None, {}, {"mtdao": "not json"}, {"other": "x"}):
        found, why = read_claim("7:rogue", data, RunKey(SECRET))
        assert found is None and why, data


def test_a_member_confirms_the_quorum_in_its_store_and_reads_everyone_elses():
    key = RunKey(SECRET)
    members = [claim(r) for r in range(3)]
    stores = {c.store: DictStore() for c in members}
    for c in members[1:]:  # the others confirm the quorum in their own stores
        confirm_quorum(stores.__getitem__, key, "digest", c, members, 0.1)
    assert confirm_quorum(stores.__getitem__, key, "digest", members[0], members, 0.1) == {}
    # a member that confirms another quorum (or nothing) is not confirmed in this one
    for store in stores.values():
        store.values.clear()
    confirm_quorum(stores.__getitem__, key, "another digest", members[1], members, 0.1)
    unconfirmed = confirm_quorum(stores.__getitem__, key, "digest", members[0], members, 0.1)
    assert set(unconfirmed) == {members[1].member, members[2].member}
    assert "did not confirm this quorum within 0.1 s" in unconfirmed[members[2].member]


def test_members_that_prove_different_sets_form_separate_groups():
    """Two members with the run's secret and one with another, in one quorum: the two sum over
    each other only, the third over itself (members that prove different sets meet under
    different rendezvous keys: with one they overwrote each other's gloo addresses)."""
    script = Path(__file__).with_name("membership_members.py")
    limit = limit_s()  # one process's start: its members are threads, taking no step
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=limit
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

    positions = summed_rows(sum_over_three, 1, 3, [12, 2**59])
    assert positions == [[12, 2**59], [12, 2**59], [8, 2**59]]


# -- the heal transport -------------------------------------------------------------------------


BINDING = HealBinding("digest", "0:source", "1:receiver", 0, 7)


def transports(receiver_secret=SECRET):
    sender = SignedHealTransport(RunKey(SECRET), "127.0.0.1", TIMEOUT)
    receiver = SignedHealTransport(RunKey(receiver_secret), "127.0.0.1", TIMEOUT)
    sender.open(Quorum("digest", "0:source", 0, frozenset({"1:receiver"})))
    return sender, receiver


def test_a_state_travels_as_tensors_and_plain_data():
    sender, receiver = transports()
    state = {"user": {"w": torch.arange(4.0), "betas": (0.9, 0.95), "n": {1: None}}}
    try:
        sender.serve(7, state)
        received = receiver.fetch(sender.metadata(), BINDING, "replica 0")
    finally:
        sender.shutdown(), receiver.shutdown()
    assert torch.equal(received["user"]["w"], state["user"]["w"])
    assert received["user"]["betas"] == (0.9, 0.95) and received["user"]["n"] == {1: None}
    assert receiver.received_bytes > 0


def test_a_peer_with_another_secret_neither_fetches_nor_serves_a_state(monkeypatch):
    monkeypatch.setattr("mtdao.ft.security.safe_transport.QUORUM_SKEW_S", 0.1)
    sender, receiver = transports(receiver_secret=b"another-secret-0000")
    try:
        sender.serve(7, {"user": {"w": torch.ones(2)}})
        with pytest.raises(
            HealRefused, match="replica 0 at .* did not send its state: PERMISSION_DENIED"
        ):
            receiver.fetch(sender.metadata(), BINDING, "replica 0")
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

    server = answering(b"0" * 64, buffer.getvalue())
    _, receiver = transports()
    try:
        with pytest.raises(HealRefused, match="nothing of it was read"):
            receiver.fetch(f"http://127.0.0.1:{server.port}", BINDING, "replica 0")
        with pytest.raises(HealRefused, match="is no URL"):
            receiver.fetch("file:///etc/passwd", BINDING, "replica 0")
    finally:
        server.shutdown(), receiver.shutdown()
    assert not marker.exists()


def test_an_answer_is_read_no_further_than_the_size_its_sender_signed():
    """A source signs its state's size before the state: an answer past it (a process that took a
    dead member's heal port, streaming) is refused there, not read into memory to the timeout."""
    key, fields = RunKey(SECRET), BINDING.fields()
    header = {"bytes": 10, "size_sig": key.sign("heal-size", *fields, 10), "sig": "0" * 64}
    server = answering(json.dumps(header).encode(), *[b"x" * 1000] * 5)
    _, receiver = transports()
    try:
        with pytest.raises(HealRefused, match="sent more than the 10 bytes it signed"):
            receiver.fetch(f"http://127.0.0.1:{server.port}", BINDING, "replica 0")
    finally:
        server.shutdown(), receiver.shutdown()


def test_a_signed_state_that_does_not_load_is_refused_in_one_line():
    """A faulty member's state, signed yet cut short: refused in one line (the replicas used to
    stand still until the collective timeout)."""
    sender, receiver = transports()
    try:
        sender.serve(7, {"user": {"w": torch.ones(2)}})
        step, payload, _ = sender._served
        cut = payload[: len(payload) // 2]
        sender._served = (step, cut, hashlib.sha256(cut).hexdigest())
        with pytest.raises(HealRefused, match="replica 0 sent a state that does not load: "):
            receiver.fetch(sender.metadata(), BINDING, "replica 0")
    finally:
        sender.shutdown(), receiver.shutdown()


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
    from mtdao.ft.healing import HealedState
    from mtdao.sync.trained_state import TrainedState

    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4, generator=gen)) for _ in range(2)]
    sync = LocalUpdateSync(MTAdam(params, lr=1e-2), **ENGINES[name]())
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        sync.step()
    state = HealedState(TrainedState(sync)).state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    HealedState(TrainedState(sync)).load_state_dict(loaded)  # and it loads back
    assert loaded["sync"]["step"] == 3
