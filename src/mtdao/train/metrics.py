"""Run outputs: metrics as JSON lines (and TensorBoard when installed), results.json.

``metrics.jsonl`` is only appended to, one whole line per write, so a crash tears at most its last
line, which a resumed run drops with a warning; a failed write is cut back off the file."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from mtdao.train.durable import WriteError, write_json_atomic, write_text_atomic

logger = logging.getLogger(__name__)


class MetricsError(ValueError):
    """metrics.jsonl has a damaged line that is not its last; the message names it."""


class MetricsLog:
    """Appends one JSON object per line to ``metrics.jsonl``; mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, enabled: bool = True, append: bool = False) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tensorboard = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not append:
            write_text_atomic(self.path, "", sync=False)
        elif self.path.exists():
            repair_torn_tail(self.path)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        except ImportError:  # tensorboard is optional
            self._tensorboard = None

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        append_line(self.path, json.dumps(record) + "\n")
        if self._tensorboard is not None and "step" in record:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step" and math.isfinite(value):
                    self._tensorboard.add_scalar(key, value, record["step"])

    def truncate_after(self, step: int) -> None:
        """Drop records past ``step`` (a resumed run rewrites them); atomic, so a crash here
        loses nothing."""
        if not self.enabled or not self.path.exists():
            return
        records, _ = read_records(self.path)
        kept = [record for record in records if record.get("step", 0) <= step]
        write_text_atomic(self.path, "".join(json.dumps(record) + "\n" for record in kept))

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()


def append_line(path: Path, line: str) -> None:
    """Append ``line`` in one write (a crash tears only this line); if the write fails, cut the
    file back to its size before and raise :class:`WriteError` (one line, ENOSPC named)."""
    data = memoryview(line.encode("utf-8"))
    with open(path, "ab", buffering=0) as handle:  # unbuffered: nothing left to flush on close
        size = handle.seek(0, os.SEEK_END)
        try:
            while data:
                data = data[handle.write(data) :]  # a full disk may first write part of it
        except OSError as error:
            with contextlib.suppress(OSError):  # else the next resume drops the torn line
                os.truncate(path, size)
            raise WriteError(path, error) from None


def read_records(path: Path) -> tuple[list[dict[str, Any]], int | None]:
    """(every complete record, the line number of a torn last line or None).

    Raises MetricsError for a damaged line before the last: a crash cannot cause that.
    """
    lines = Path(path).read_bytes().split(b"\n")
    records, torn = [], None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not an object")
        except ValueError:
            if any(rest.strip() for rest in lines[number:]):
                raise MetricsError(
                    f"{path} line {number} is not a JSON record (fix or delete that line)"
                ) from None
            torn = number
            continue
        records.append(record)
    return records, torn


def repair_torn_tail(path: Path) -> int | None:
    """Cut a torn last line off ``path`` (warning names the file and line); its line number."""
    data = Path(path).read_bytes()
    _, torn = read_records(path)
    if torn is None:
        if data and not data.endswith(b"\n"):  # a complete record that lost only its newline
            with open(path, "ab") as handle:
                handle.write(b"\n")
        return None
    start = data.rstrip(b"\n").rfind(b"\n") + 1  # the torn line is the last non-empty one
    os.truncate(path, start)
    logger.warning(
        "%s: dropped line %d, a record torn by an interrupted run (%d bytes)",
        path,
        torn,
        len(data) - start,
    )
    return torn


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every complete record of a run's ``metrics.jsonl`` (a torn last line is ignored)."""
    return read_records(Path(run_dir) / "metrics.jsonl")[0]


def write_json(path: Path, value: Any) -> None:
    """Write atomically; on failure (e.g. a full disk) nothing is left behind and a
    :class:`~mtdao.train.durable.WriteError` says so in one line."""
    write_json_atomic(Path(path), value)
