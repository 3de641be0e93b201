"""One run per directory, and never a run's files deleted by accident.

A run holds an exclusive ``flock`` on ``<run dir>/run.lock`` for its whole life; the kernel drops
it when the process ends, however it ends, so no stale lock is left to clean up. The file holds
the holder's pid and host for the refusal message only. Under torchrun only process 0 takes it. A
start that fails before the run writes anything leaves the directory as it found it."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock; runs are not guarded there
    fcntl = None

LOCK_FILE = "run.lock"
RUN_FILES = (
    "config.json",
    "metrics.jsonl",
    "results.json",
    "checkpoints",
    "checkpoint",
    "checkpoint.previous",
    "checkpoint.partial",
    "tensorboard",
    "loss.png",
    "replicas.jsonl",
)
"""What a run writes into its directory: any of them means the directory holds (part of) a run."""


class RunDirError(ValueError):
    """The run directory cannot be used as asked; the message is one line."""


class RunLockedError(RunDirError):
    """Another process holds the run directory's lock."""


def check_run_dir(run_dir: Path) -> Path:
    """``run_dir`` as a Path; refuses a path that exists and is not a directory."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run directory {run_dir} is an existing file, not a directory")
    return run_dir


def run_files(run_dir: Path) -> list[str]:
    """The entries of ``run_dir`` that belong to a run (empty when it holds none)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return [name for name in RUN_FILES if (run_dir / name).exists()]


def holds_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a run's metrics, config, results or checkpoints."""
    return bool(run_files(run_dir))


def refuse_to_replace_a_run(run_dir: Path) -> None:
    """For a fresh run: refuse a directory that holds a run (the caller decides about
    ``--resume``/``--overwrite`` before calling this)."""
    found = run_files(check_run_dir(run_dir))
    if found:
        raise RunDirError(
            f"{run_dir} already holds a run ({', '.join(found)}); pass --resume to continue it, "
            "--overwrite to replace it, or choose another --out"
        )


def clear_run_files(run_dir: Path) -> list[str]:
    """Delete what a run wrote into ``run_dir`` (for ``--overwrite``; hold its lock first). Other
    files in the directory are left alone. Returns the names deleted."""
    found = run_files(run_dir)
    for name in found:
        path = Path(run_dir) / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return found


class RunLock:
    """``with RunLock(run_dir):`` — creates the directory and holds its lock until the block ends
    (or the process does)."""

    ATTEMPTS = 5
    """Tries to take the lock while a failed start's release removes the file or directory."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._descriptor: int | None = None
        self._made_file = False
        self._made_dirs: list[Path] = []  # innermost first

    @property
    def held(self) -> bool:
        return self._descriptor is not None

    def acquire(self) -> RunLock:
        """Take the lock or raise RunLockedError naming the holder's pid."""
        if self.held:
            return self
        for attempt in range(self.ATTEMPTS):
            try:
                descriptor = self._open()
            except FileNotFoundError:  # another start removed the directory it had made
                if attempt + 1 == self.ATTEMPTS:
                    raise
                continue
            try:
                if fcntl is not None:
                    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                os.close(descriptor)
                if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise RunLockedError(
                    f"{self.run_dir} is in use by another run ({describe_holder(self.path)}); "
                    "wait for it to end or choose another --out"
                ) from None
            if self._still_linked(descriptor) or attempt + 1 == self.ATTEMPTS:
                break
            os.close(descriptor)  # locked a file a releasing start had just removed: again
        os.ftruncate(descriptor, 0)
        os.write(descriptor, f"{os.getpid()} {socket.gethostname()}\n".encode())
        self._descriptor = descriptor
        return self

    def _open(self) -> int:
        """The lock file's descriptor, making it (and the directory) if missing; remembers what
        it made, for :meth:`release`."""
        missing = [self.run_dir, *self.run_dir.parents]
        missing = missing[: next(i for i, path in enumerate(missing) if path.exists())]
        check_run_dir(self.run_dir).mkdir(parents=True, exist_ok=True)
        self._made_dirs = missing
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
        try:
            descriptor = os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o644)
            self._made_file = True
        except FileExistsError:
            descriptor = os.open(self.path, flags)
            self._made_file = False
        return descriptor

    def _still_linked(self, descriptor: int) -> bool:
        try:
            return os.path.samestat(os.fstat(descriptor), os.stat(self.path))
        except FileNotFoundError:
            return False

    def release(self) -> None:
        if self._descriptor is None:
            return
        descriptor, self._descriptor = self._descriptor, None
        with contextlib.suppress(OSError):
            os.ftruncate(descriptor, 0)  # no pid left behind that looks like a holder
            if not holds_run(self.run_dir):  # a failed start: leave what it found
                self._remove_what_it_made()
        os.close(descriptor)  # closing the last descriptor releases the flock

    def _remove_what_it_made(self) -> None:
        """The lock file and the directories this lock made, while they are empty (removed
        while the flock is held; a start that opened the old file sees it unlinked and retries)."""
        if self._made_file:
            self.path.unlink()
        for directory in self._made_dirs:
            directory.rmdir()  # OSError (not empty: something else is in it) ends it

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def describe_holder(lock_path: Path, attempts: int = 20) -> str:
    """'pid N' (and the host when it is another one) of the lock's holder, as written in it."""
    for _ in range(attempts):  # the holder writes its pid just after taking the lock
        try:
            fields = Path(lock_path).read_text().split()
        except OSError:
            fields = []
        if fields:
            pid, host = fields[0], fields[1] if len(fields) > 1 else ""
            elsewhere = host and host != socket.gethostname()
            return f"pid {pid} on {host}" if elsewhere else f"pid {pid}"
        time.sleep(0.01)
    return "pid unknown"
