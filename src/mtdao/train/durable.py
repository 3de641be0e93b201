"""Files that are either wholly written or not there at all, with their checksums: a temporary
file, fsync, rename. Checksums are XXH3-128: fast enough to compute while writing and ample to
catch flipped or truncated bytes, which is all they are for."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

CHECKSUM = "xxh3_128"
"""The checksum algorithm recorded with new checkpoint files."""

_CHUNK = 1 << 20


class WriteError(OSError):
    """A file could not be written (full disk, no permission, ...); the message is one line."""

    def __init__(self, path: Path, error: OSError) -> None:
        super().__init__(error.errno, error.strerror, str(path))
        self.message = f"cannot write {path}: {describe_os_error(error)}"

    def __str__(self) -> str:
        return self.message


def describe_os_error(error: OSError) -> str:
    """One line for an OSError; a full disk is always called "no space left on device"."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on device ({errno.errorcode[error.errno]})"
    reason = error.strerror or str(error) or type(error).__name__
    code = errno.errorcode.get(error.errno) if error.errno else None
    return f"{reason} ({code})" if code else reason


CHECKSUMS = frozenset(
    {CHECKSUM, *(name for name in hashlib.algorithms_guaranteed if not name.startswith("shake_"))}
)
"""The algorithms a checkpoint may record: hashlib's shake_* have no plain ``hexdigest()``."""


def new_hasher(algorithm: str):
    """A streaming hasher (``update``/``hexdigest``) for a recorded algorithm name."""
    if algorithm not in CHECKSUMS:
        raise ValueError(f"unknown checksum algorithm {algorithm!r}")
    return xxhash.xxh3_128() if algorithm == CHECKSUM else hashlib.new(algorithm)


def file_checksum(path: Path, algorithm: str = CHECKSUM) -> str:
    hasher = new_hasher(algorithm)
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()


class _Writer:
    """A write-only file wrapper that checksums the bytes on their way to disk (no second read)
    and remembers a failed write: torch.save hides it behind its own error when it ends.

    Once a write has failed or the file is closed, further writes are dropped: torch's zip writer,
    left unfinished by an interrupt or a full disk, writes its trailer from its destructor, where an
    exception aborts the whole process; the temporary file is discarded by then anyway."""

    def __init__(self, handle: BinaryIO, algorithm: str | None) -> None:
        self.handle = handle
        self.hasher = new_hasher(algorithm) if algorithm else None
        self.size = 0
        self.error: OSError | None = None

    def write(self, data) -> int:
        if self.handle.closed or self.error is not None:
            return len(data)
        try:
            written = self.handle.write(data)
        except OSError as error:
            self.error = error
            raise
        if self.hasher is not None:
            self.hasher.update(data)
        self.size += len(data)
        return written

    def flush(self) -> None:
        if not self.handle.closed:
            self.handle.flush()


def temporary_path(path: Path) -> Path:
    return path.with_name(f"{path.name}.tmp")


def write_atomic(
    path: Path, write: Callable[[Any], None], algorithm: str | None = None, sync: bool = True
) -> tuple[int, str | None]:
    """Call ``write(handle)`` into a temporary file, then rename it to ``path``.

    Returns (bytes written, checksum or None). Raises :class:`WriteError` and removes the
    temporary file when anything fails; ``path`` is then as it was before.
    """
    path = Path(path)
    partial = temporary_path(path)
    target = None
    try:
        with open(partial, "wb") as handle:
            target = _Writer(handle, algorithm)
            write(target)
            if target.error is not None:  # a failed write that the writer swallowed
                raise target.error
            handle.flush()
            if sync:
                os.fsync(handle.fileno())
        os.replace(partial, path)
    except OSError as error:
        _remove_quietly(partial)
        raise WriteError(path, error) from None
    except BaseException as error:
        _remove_quietly(partial)
        if target is not None and target.error is not None:
            raise WriteError(path, target.error) from None
        interrupt = _interrupt_behind(error)
        if interrupt is not None and interrupt is not error:
            # Ctrl-C inside a writer that fails while unwinding (torch.save's zip writer): the
            # user's interrupt, not the writer's complaint about the half-written file
            raise interrupt from None
        raise
    return target.size, target.hasher.hexdigest() if target.hasher else None


def _interrupt_behind(error: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt ``error`` is, or was raised while handling, if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return error
        seen.add(id(error))
        error = error.__context__
    return None


def write_text_atomic(path: Path, text: str, sync: bool = True) -> None:
    write_atomic(path, lambda handle: handle.write(text.encode("utf-8")), sync=sync)


def write_json_atomic(path: Path, value: Any, sync: bool = True) -> None:
    write_text_atomic(path, json.dumps(value, indent=2), sync=sync)


def fsync_directory(path: Path) -> None:
    """Make renames and new entries in ``path`` durable (a no-op where directories cannot be
    opened, e.g. on Windows)."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _remove_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
