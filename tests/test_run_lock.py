"""One run per directory: the lock refuses a second holder naming the first's pid, dies with its
process (even on SIGKILL), and a directory holding a run is recognised and never replaced."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from sessions import kill
from wait_limits import first_line, limit_s

from mtdao.testing.fault_drill import EXIT_AFTER_SIGNAL_S
from mtdao.train import run_lock
from mtdao.train.run_lock import RunDirError, RunLock, RunLockedError

pytestmark = pytest.mark.skipif(run_lock.fcntl is None, reason="flock is POSIX only")
PROBE_S = limit_s(starts=1)  # a Python start without torch, refused at once

# The holder process loads run_lock.py by path: no torch import, so it starts in milliseconds.
HOLDER = textwrap.dedent(
    """
    import importlib.util, sys, time
    spec = importlib.util.spec_from_file_location("run_lock", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.RunLock(sys.argv[2]).acquire()
    print("locked", flush=True)
    time.sleep(60)
    """
)


def start_holder(run_dir) -> subprocess.Popen:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, run_lock.__file__, str(run_dir)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert first_line(holder, limit_s()).strip() == "locked"
    return holder


def test_second_holder_is_refused_with_the_pid_of_the_first(tmp_path):
    run_dir = tmp_path / "run"
    with RunLock(run_dir) as lock:
        assert lock.held and (run_dir / "run.lock").read_text().split()[0] == str(os.getpid())
        with pytest.raises(RunLockedError) as raised:
            RunLock(run_dir).acquire()
    message = str(raised.value)
    assert message == (
        f"{run_dir} is in use by another run (pid {os.getpid()}); "
        "wait for it to end or choose another --out"
    )
    with RunLock(run_dir):  # released at the end of the block
        pass


def test_lock_is_released_when_its_process_is_killed(tmp_path):
    run_dir = tmp_path / "run"
    holder = start_holder(run_dir)
    try:
        with pytest.raises(RunLockedError, match=rf"\(pid {holder.pid}\)"):
            RunLock(run_dir).acquire()
        os.kill(holder.pid, signal.SIGKILL)  # no handler, no cleanup runs
        holder.wait(timeout=EXIT_AFTER_SIGNAL_S)
        assert holder.returncode == -signal.SIGKILL
        with RunLock(run_dir) as lock:
            assert lock.held
    finally:
        kill(holder)


def test_lock_in_another_process_refuses_this_one(tmp_path):
    run_dir = tmp_path / "run"
    with RunLock(run_dir):
        probe = subprocess.run(
            [sys.executable, "-c", HOLDER, run_lock.__file__, str(run_dir)],
            capture_output=True,
            text=True,
            timeout=PROBE_S,
        )
    assert probe.returncode != 0
    assert f"RunLockedError: {run_dir} is in use by another run (pid {os.getpid()})" in probe.stderr


def test_holder_on_another_host_is_named(tmp_path):
    (tmp_path / "run.lock").write_text("4242 gpu-node-7\n")
    assert run_lock.describe_holder(tmp_path / "run.lock") == "pid 4242 on gpu-node-7"
    (tmp_path / "run.lock").write_text("")
    assert run_lock.describe_holder(tmp_path / "run.lock", attempts=2) == "pid unknown"


def test_out_naming_an_existing_file_is_one_line(tmp_path):
    not_a_dir = tmp_path / "results.txt"
    not_a_dir.write_text("mine")
    message = f"run directory {not_a_dir} is an existing file, not a directory"
    with pytest.raises(RunDirError, match=message):
        RunLock(not_a_dir).acquire()
    with pytest.raises(RunDirError, match=message):
        run_lock.refuse_to_replace_a_run(not_a_dir)
    assert not_a_dir.read_text() == "mine"


@pytest.mark.parametrize("entry", ["metrics.jsonl", "config.json", "checkpoints", "checkpoint"])
def test_a_directory_holding_a_run_is_recognised_and_refused(tmp_path, entry):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert not run_lock.holds_run(run_dir) and not run_lock.holds_run(tmp_path / "missing")
    (run_dir / "notes.txt").write_text("the user's own file")
    assert not run_lock.holds_run(run_dir)
    with RunLock(run_dir):  # its own lock file is not a run
        assert not run_lock.holds_run(run_dir)
    (run_dir / entry).mkdir() if entry.startswith("checkpoint") else (run_dir / entry).write_text(
        ""
    )
    assert run_lock.holds_run(run_dir) and run_lock.run_files(run_dir) == [entry]
    with pytest.raises(RunDirError, match=f"already holds a run \\({entry}\\); pass --resume"):
        run_lock.refuse_to_replace_a_run(run_dir)


def test_overwrite_deletes_only_what_a_run_wrote(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step-00000010").mkdir(parents=True)
    for name in ("metrics.jsonl", "config.json", "results.json", "loss.png", "notes.txt"):
        (run_dir / name).write_text("x")
    with RunLock(run_dir):
        deleted = run_lock.clear_run_files(run_dir)
    assert sorted(deleted) == ["checkpoints", "config.json", "loss.png", "metrics.jsonl"] + [
        "results.json"
    ]
    # no run left in it: the lock file it made goes too
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]


def test_a_lock_that_guarded_no_run_removes_what_it_made(tmp_path):
    made = tmp_path / "a" / "b"
    RunLock(made).acquire().release()
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "run.lock").write_text("")  # not its own: kept
    RunLock(tmp_path / "mine").acquire().release()
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["run.lock"]


def test_a_lock_that_guarded_a_run_is_left_with_it(tmp_path):
    with RunLock(tmp_path / "run") as lock:
        (lock.run_dir / "metrics.jsonl").write_text("{}\n")
    assert sorted(p.name for p in lock.run_dir.iterdir()) == ["metrics.jsonl", "run.lock"]


def test_a_lock_file_removed_while_opened_is_not_taken(tmp_path, monkeypatch):
    """A start that opened the lock file just before a failed start removed it locks a file
    nobody else can find: it opens the new one instead."""
    lock, opened = RunLock(tmp_path / "run"), []
    real_open = lock._open

    def open_then_lose_the_race():
        descriptor = real_open()
        if not opened:  # the releasing start unlinks the file this one opened
            lock.path.unlink()
        opened.append(descriptor)
        return descriptor

    monkeypatch.setattr(lock, "_open", open_then_lose_the_race)
    with lock:
        assert len(opened) == 2 and os.path.samestat(os.fstat(opened[1]), os.stat(lock.path))
