"""A failure or a crash at any instant of a checkpoint write leaves a resumable run.

Every file-system operation a save performs (each write call, fsync, rename, mkdir, unlink, rmdir)
is counted; then, for every instant k in turn, the save is repeated with operation k failing:

- raising an OSError (the save's error handling runs), and
- killing the process outright: a forked child calls ``os._exit`` at operation k, so no handler,
  ``finally`` or buffered write runs, exactly as after a SIGKILL.

After each, the newest complete checkpoint must load (the new one if the commit rename happened,
else the previous one), no crash may leave zero checkpoints, and the next save must succeed and
clean up every leftover. Of a run of consecutive writes (torch.save makes dozens) only the first,
middle and last are tried: the ones between leave the same partial temporary file.

fsync is a no-op here: it only matters when the machine loses power, which no test in a running
process can simulate, and on this disk it takes milliseconds per call.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from wait_limits import limit_s

from mtdao.train import durable
from mtdao.train.checkpoint import store as ckpt
from mtdao.train.checkpoint.store import CheckpointStore

FILE_OPERATIONS = ("replace", "rename", "mkdir", "fsync", "unlink", "rmdir")
# a child process: one start's work at most (a forked one imports nothing, then saves once)
CHILD_S = limit_s(starts=1)


class Injector:
    """Counts file-system operations; makes operation ``fail_at`` run ``on_fail`` instead."""

    def __init__(self, fail_at: int | None = None, on_fail=None) -> None:
        self.fail_at, self.on_fail, self.operations = fail_at, on_fail, []

    def next_fails(self) -> bool:
        return len(self.operations) == self.fail_at

    def operation(self, name: str) -> None:
        failing = self.next_fails()
        self.operations.append(name)
        if failing:
            self.on_fail(name)

    def install(self, patch) -> None:
        for name in FILE_OPERATIONS:
            patch.setattr(os, name, self._counted(name, getattr(os, name)))
        real_open = open
        injector = self

        class CountedFile:
            """A file whose every write is an operation; a failing one writes half first."""

            def __init__(self, handle):
                self.handle = handle

            def write(self, data):
                if injector.next_fails():
                    self.handle.write(bytes(data)[: len(data) // 2])
                    self.handle.flush()
                injector.operation("write")
                return self.handle.write(data)

            def __getattr__(self, name):
                return getattr(self.handle, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.handle.close()

        def counted_open(path, mode="r", *args, **kwargs):
            handle = real_open(path, mode, *args, **kwargs)
            return CountedFile(handle) if "w" in mode else handle

        patch.setattr(durable, "open", counted_open, raising=False)

    def _counted(self, name, real):
        def counted(*args, **kwargs):
            self.operation(name)
            return real(*args, **kwargs)

        return counted


@pytest.fixture(autouse=True)
def no_fsync(monkeypatch):
    monkeypatch.setattr(os, "fsync", lambda descriptor: None)


def instants(operations: list[str]) -> list[int]:
    """Indices of the operations to fail: all but the inner ones of a run of writes."""
    chosen, start = [], 0
    for index in range(1, len(operations) + 1):
        if index == len(operations) or operations[index] != operations[start]:
            run = range(start, index)
            chosen += sorted({run[0], run[len(run) // 2], run[-1]})
            start = index
    return chosen


def state_at(step: int) -> dict:
    return {
        "step": step,
        "params": {"w": torch.full((64, 64), float(step))},
        "optimizer": {"state": {0: {"exp_avg_sq": torch.full((64,), float(step))}}},
    }


def prepare(run_dir, keep: int) -> None:
    store = CheckpointStore(run_dir, keep=keep)
    for step in range(1, keep + 1):
        store.save(step, state_at(step), {})


def count_operations(tmp_path, keep: int) -> list[str]:
    run_dir = tmp_path / "count"
    prepare(run_dir, keep)
    injector = Injector()
    with pytest.MonkeyPatch.context() as patch:
        injector.install(patch)
        CheckpointStore(run_dir, keep=keep).save(keep + 1, state_at(keep + 1), {})
    shutil.rmtree(run_dir)
    return injector.operations


def commit_index(operations: list[str]) -> int:
    """The commit is the only rename of a directory; renames of old ones to trash come after."""
    return operations.index("rename")


def assert_resumable(run_dir, keep: int, crashed_at: int, committed_at: int) -> None:
    new_step = keep + 1
    expected = new_step if crashed_at > committed_at else keep
    loaded = CheckpointStore(run_dir, keep=keep).load()
    assert loaded is not None, f"no checkpoint after a crash at operation {crashed_at}"
    assert loaded.step == expected, f"crash at operation {crashed_at}"
    assert torch.equal(loaded.state["params"]["w"], torch.full((64, 64), float(expected)))
    assert loaded.skipped == []  # a crash never leaves something that looks complete but is not
    # the next save succeeds, removes every leftover and keeps exactly `keep` checkpoints
    CheckpointStore(run_dir, keep=keep).save(new_step + 1, state_at(new_step + 1), {})
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    steps = [new_step + 1, new_step, keep, keep - 1][:keep]
    if expected == keep:
        steps = [new_step + 1, keep, keep - 1][:keep]
    assert names == sorted(f"step-{s:08d}" for s in steps), f"crash at operation {crashed_at}"


@pytest.mark.parametrize("keep", [1, 2])
def test_an_error_at_every_operation_keeps_a_loadable_checkpoint(tmp_path, keep):
    operations = count_operations(tmp_path, keep)
    assert operations.count("write") >= 2 and "fsync" in operations and "rmdir" in operations
    committed_at = commit_index(operations)

    def fail(name):
        raise OSError(5, f"injected failure in {name}")

    for k in instants(operations):
        run_dir = tmp_path / f"error-{k}"
        prepare(run_dir, keep)
        with pytest.MonkeyPatch.context() as patch:
            Injector(k, fail).install(patch)
            try:
                CheckpointStore(run_dir, keep=keep).save(keep + 1, state_at(keep + 1), {})
            except ckpt.CheckpointWriteError as error:
                assert k <= committed_at, f"operation {k}: failed after the commit: {error}"
                assert "\n" not in str(error) and "injected failure" in str(error)
            else:
                assert k > committed_at, f"operation {k} ({operations[k]}) failed silently"
        if k <= committed_at:  # a failed save cleans up after itself
            leftovers = [p for p in run_dir.rglob("*") if p.name.endswith((".tmp", ".partial"))]
            assert not leftovers, f"operation {k}: {leftovers}"
        assert_resumable(run_dir, keep, k, committed_at)


def crash_in_child(run_dir, keep: int, crash_at: int) -> int:
    """Fork; the child saves and dies at operation ``crash_at``; returns the child's exit code."""
    pid = os.fork()
    if pid == 0:  # the child: never returns to pytest
        code = 3
        try:
            with pytest.MonkeyPatch.context() as patch:
                Injector(crash_at, lambda name: os._exit(0)).install(patch)
                CheckpointStore(run_dir, keep=keep).save(keep + 1, state_at(keep + 1), {})
        except BaseException:
            code = 4
        os._exit(code)
    deadline = time.monotonic() + CHILD_S
    try:
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.005)
        raise AssertionError(f"the child crashing at operation {crash_at} did not finish")
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("keep", [1, 2])
def test_a_kill_at_every_operation_keeps_a_loadable_checkpoint(tmp_path, keep):
    operations = count_operations(tmp_path, keep)
    committed_at = commit_index(operations)
    for k in [*instants(operations), len(operations)]:
        run_dir = tmp_path / f"kill-{k}"
        prepare(run_dir, keep)
        code = crash_in_child(run_dir, keep, k)
        assert code == (0 if k < len(operations) else 3), f"operation {k}: exit code {code}"
        assert_resumable(run_dir, keep, k, committed_at)


def test_ctrl_c_inside_a_writer_that_fails_while_unwinding_stays_a_ctrl_c(tmp_path):
    """torch.save's zip writer, interrupted mid-record, raises its own RuntimeError on the way
    out; the user pressed Ctrl-C, so that is what the caller sees (and no partial file stays)."""

    def write(handle):
        try:
            handle.write(b"half a record")
            raise KeyboardInterrupt
        finally:
            raise RuntimeError("unexpected pos 2540544 vs 2540432")

    target = tmp_path / "state.pt"
    with pytest.raises(KeyboardInterrupt):
        durable.write_atomic(target, write)
    assert not target.exists() and not durable.temporary_path(target).exists()


def test_a_zip_writer_finished_after_an_interrupt_does_not_abort_the_process(tmp_path):
    """A zip writer left unfinished by Ctrl-C writes its trailer when it is garbage-collected,
    after the file is closed; an exception there would abort the process (SIGABRT), losing the
    interrupt's message. Run in a child, since an abort cannot be caught."""
    script = f"""
import gc, torch
from pathlib import Path
from mtdao.train import durable
kept = []
def write(handle):
    writer = torch._C.PyTorchFileWriter(handle)
    writer.write_record("a", b"x" * 100, 100)
    kept.append(writer)  # outlives the file, as a traceback's frame keeps torch.save's writer
    raise KeyboardInterrupt
try:
    durable.write_atomic(Path({str(tmp_path / "state.pt")!r}), write)
except KeyboardInterrupt:
    pass
kept.clear()
gc.collect()
print("still running")
"""
    child = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=CHILD_S
    )
    assert child.returncode == 0 and "still running" in child.stdout, child.stderr
    assert not (tmp_path / "state.pt").exists()


def test_a_failed_write_that_the_writer_swallows_still_fails_the_save(tmp_path):
    """A writer that catches the disk's error and goes on must not leave a truncated file that
    looks whole; later writes are dropped (no second error from a destructor)."""

    class FullDisk:
        closed = False

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    def write(handle):
        handle.handle = FullDisk()
        with contextlib.suppress(OSError):
            handle.write(b"a record")
        assert handle.write(b"the trailer") == len(b"the trailer")

    target = tmp_path / "state.pt"
    with pytest.raises(durable.WriteError, match="no space left on device"):
        durable.write_atomic(target, write)
    assert not target.exists() and not durable.temporary_path(target).exists()
