"""The fault-tolerance settings: flags, validation, the per-replica run directory, the config check
a joining replica passes, the one-line errors, and torchft staying out of plain runs."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest
from wait_limits import limit_s

import mtdao
from mtdao.cli import build_parser, main
from mtdao.train.command import config_from_args, config_to_argv
from mtdao.train.config import TrainConfig, resolve
from mtdao.train.fault_tolerance import replica as fault_tolerant

FT = dict(fault_tolerant=True, replica_id=1, lighthouse="host:29510", workers=3)


def test_the_flags_round_trip():
    config = TrainConfig.of(**FT, quorum_timeout=30.0, collective_timeout=12.5, connect_timeout=4.0)
    argv = config_to_argv(config)
    assert "--fault-tolerant" in argv and argv[argv.index("--replica-id") + 1] == "1"
    assert config_from_args(build_parser().parse_args(["train", *argv])) == config


def test_each_replica_gets_its_own_run_directory():
    config = resolve(TrainConfig.of(**FT, steps=10))
    assert config.job.out == "runs/mtdao-adam-M3-K4-seed0/replica-1"
    assert resolve(TrainConfig.of(steps=10)).job.out == "runs/mtdao-adam-M4-K4-seed0"


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(replica_id=None), "--fault-tolerant needs --replica-id and --lighthouse"),
        (dict(lighthouse=None), "--fault-tolerant needs --replica-id and --lighthouse"),
        (dict(replica_id=3), "--replica-id 3 is outside 0 .. 2 (--workers 3 replicas"),
        (dict(replica_id=-1), "--replica-id -1 is outside 0 .. 2"),
        (dict(lighthouse=" "), "--lighthouse is empty"),
        (dict(quorum_timeout=0.0), "--quorum-timeout must be a number of seconds > 0"),
        (dict(collective_timeout=float("inf")), "--collective-timeout must be a finite number > 0"),
        (dict(fault_tolerant=False), "--replica-id needs --fault-tolerant"),
        (dict(bind_host="::"), "--bind-host :: serves every address, loopback included"),
        (dict(bind_host="[::]"), "--bind-host [::] serves every address, loopback included"),
    ],
)
def test_bad_settings_are_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve(TrainConfig.of(**{**FT, **changes}))


def test_every_round_option_is_taken_by_a_fault_tolerant_replica():
    options = dict(sync_delay=2, sync_fragments=2, sync_dtype=("int8",), error_feedback=True)
    resolved = resolve(TrainConfig.of(**{**FT, **options}))
    assert (resolved.sync.sync_delay, resolved.sync.sync_fragments) == (2, 2)
    assert resolved.sync.sync_dtype == ("int8",) and resolved.sync.error_feedback


def test_a_bad_setting_is_one_line_on_the_command_line(capsys):
    argv = ["train", "--fault-tolerant", "--replica-id", "5", "--lighthouse", "h:1"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "mtdao train: error: --replica-id 5 is outside 0 .. 3 (--workers 4 replicas, one data "
        "shard each)\n"
    )
    assert main(["lighthouse", "--min-replicas", "0"]) == 2
    assert (
        capsys.readouterr().err == "mtdao lighthouse: error: --min-replicas must be >= 1, got 0\n"
    )


def test_a_sharded_replica_outside_torchrun_is_one_line(capsys, tmp_path):
    pytest.importorskip("torchft")
    argv = ["train", "--fault-tolerant", "--replica-id", "0", "--lighthouse", "h:1"]
    assert main([*argv, "--shards", "2", "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == (
        "mtdao train: error: --fault-tolerant --shards 2: each replica is its own launch of 2 "
        "processes, one per shard (torchrun --nproc-per-node 2), but this one has one\n"
    )
    assert not (tmp_path / "run").exists()  # refused before any file


def check(mine: TrainConfig, theirs: TrainConfig) -> None:
    """What a joining replica (``mine``) checks of its source's config (``theirs``)."""
    from mtdao.ft import SharedConfig

    shared = fault_tolerant.shared_config
    SharedConfig(mine.fault_tolerance.replica_id, shared(resolve(mine))).load_state_dict(
        {"replica_id": 0, "config": shared(resolve(theirs))}
    )


def test_a_joining_replica_must_share_the_quorums_config():
    pytest.importorskip("torchft")
    from mtdao import ft as torchft

    mine = TrainConfig.of(**FT, steps=100, lr=0.01, sync_period=16)
    with pytest.raises(torchft.ReplicaRefused) as refused:
        check(mine, TrainConfig.of(**{**FT, "replica_id": 0}, steps=100, sync_period=8))
    assert str(refused.value) == (
        "replica 1's config differs from the quorum's (replica 0): sync_period: 8 there, 16 "
        "here; lr: 0.008 there, 0.01 here"
    )
    # what is each replica's own may differ
    own = dict(replica_id=0, lighthouse="other:1", out="elsewhere", quorum_timeout=5.0)
    check(mine, TrainConfig.of(**{**FT, **own}, steps=100, lr=0.01, sync_period=16, progress=False))


def test_the_settings_marked_replica_local_are_the_ones_a_replica_may_have_its_own():
    pytest.importorskip("torchft")
    from mtdao import ft as torchft

    own = dict(replica_id=0, lighthouse="other:1", out="elsewhere", resume=True, progress=False)
    own |= dict(log_every=3, eval_every=5, eval_tokens=4096, checkpoint_every=7, device="cpu")
    own |= dict(connect_timeout=3.0, quorum_timeout=5.0, collective_timeout=9.0)
    own |= dict(bind_host="127.0.0.2", auth_token_file="token")
    assert set(own) == fault_tolerant.REPLICA_FIELDS  # the marks on the fields
    mine = TrainConfig.of(**FT, steps=100)
    for name, value in own.items():
        check(mine, mine.replace(**{name: value}))
    with pytest.raises(torchft.ReplicaRefused, match="seed: 1 there, 0 here"):
        check(mine, mine.replace(seed=1))


def test_without_torchft_the_error_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft now fails
    for name in [name for name in sys.modules if name.startswith("mtdao.ft")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delattr(mtdao, "ft", raising=False)
    config = resolve(TrainConfig.of(**FT, steps=2, out=str(tmp_path)))
    with pytest.raises(ValueError, match=r"--fault-tolerant needs torchft: pip install .*\[ft\]"):
        fault_tolerant.train_replica(config)
    assert main(["lighthouse"]) == 2
    assert capsys.readouterr().err.startswith(
        "mtdao lighthouse: error: the lighthouse needs torchft: pip install"
    )


@pytest.mark.slow
def test_plain_runs_do_not_import_torchft(corpus_dir, tmp_path):
    steps, workers = 2, 2
    script = textwrap.dedent(
        f"""
        import contextlib, io, sys
        from mtdao.cli import main
        for argv in (["--help"], ["train", "--help"], ["lighthouse", "--help"]):
            with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
                main(argv)
        flags = ["--model", "micro", "--steps", "{steps}", "--workers", "{workers}",
                 "--batch-size", "2", "--seq-len", "16", "--eval-tokens", "64", "--no-progress"]
        assert main(["train", *flags, "--data", {str(corpus_dir)!r}, "--out", {str(tmp_path)!r}]) == 0
        assert "torchft" not in sys.modules, "torchft was imported"
        """
    )
    limit = limit_s(steps=steps * workers)  # one process, its workers simulated in it
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=limit
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_replica_without_a_lighthouse_is_one_line(monkeypatch):
    pytest.importorskip("torchft")
    from mtdao import ft as torchft

    monkeypatch.delenv("MTDAO_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError) as refused:
        torchft.fault_tolerant_replica(torchft.ReplicaConfig(replica_id=0))
    assert str(refused.value) == (
        "no lighthouse: give ReplicaConfig(lighthouse='host:port') or set $MTDAO_LIGHTHOUSE"
    )


def test_a_replica_without_an_id_is_one_line():
    pytest.importorskip("torchft")
    from mtdao import ft

    with pytest.raises(ValueError) as refused:
        ft.fault_tolerant_replica(ft.ReplicaConfig(lighthouse="127.0.0.1:1"))
    assert (
        str(refused.value) == "no replica id: give ReplicaConfig(replica_id=...) (or --replica-id)"
    )


def test_the_harness_holds_the_library_s_replica_config_as_its_fault_tolerance_section():
    from mtdao.ft.config import ReplicaConfig

    config = TrainConfig.of(**FT)
    assert type(config.fault_tolerance) is ReplicaConfig
    assert config.fault_tolerance.replica_id == FT["replica_id"]
    assert TrainConfig.from_dict(config.to_dict()) == config  # config.json's flat names
