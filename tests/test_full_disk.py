"""A full disk at any write of a run: one line naming ENOSPC and the file, nothing half-written left
behind (no temporary file, no empty config, no torn metrics line), every checkpoint intact, and the
run resumes to the same end as if the disk had never filled.

The disk is simulated in-process: every file opened for writing inside the run directory shares a
byte budget, and the write that crosses it writes what fits and raises ENOSPC, as a real full
disk does.
"""

from __future__ import annotations

import builtins
import errno
import json
from pathlib import Path

import pytest
from test_train_cli import assert_one_line_error, tiny_args
from test_train_resume import assert_runs_equal

from mtdao.cli import main
from mtdao.train.checkpoint import store as ckpt
from mtdao.train.metrics import read_records

pytestmark = pytest.mark.usefixtures("one_thread")
FLAGS = ("--steps", "12", "--checkpoint-every", "4", "--log-every", "1", "--eval-every", "4")


class Disk:
    """The run directory's disk. It fills up in the middle of the first write to a path holding
    ``target`` (made after a write to a path holding ``after``): that write stores half of its
    bytes and raises ENOSPC, and so does every write after it. ``target`` None: never full."""

    def __init__(self, root: Path, target: str | None = None, after: str | None = None) -> None:
        self.root, self.target, self.after = str(root), target, after
        self.full = False

    def open(self, real_open):
        def open_on_disk(file, mode="r", *args, **kwargs):
            handle = real_open(file, mode, *args, **kwargs)
            writing = any(flag in mode for flag in "wax+")
            if writing and str(file).startswith(self.root):
                return DiskFile(self, str(file), handle)
            return handle

        return open_on_disk

    def fills_up_at(self, path: str) -> bool:
        if self.after is not None and self.after in path:
            self.after = None
        if self.target is not None and self.after is None and self.target in path:
            self.full = True
        return self.full


class DiskFile:
    def __init__(self, disk: Disk, path: str, handle) -> None:
        self.disk, self.path, self.handle = disk, path, handle

    def write(self, data) -> int:
        if not self.disk.fills_up_at(self.path):
            return self.handle.write(data)
        data = data if isinstance(data, str) else memoryview(data).cast("B")
        self.handle.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.handle.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_dir):
    """A run that never met a full disk."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert main(tiny_args(out, corpus_dir, *FLAGS)) == 0
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.parametrize(
    "target, after",
    [
        ("config.json", None),
        ("metrics.jsonl", "step-00000004.partial"),  # a metrics line after the first checkpoint
        ("step-00000008.partial/rank0.pt", None),  # the second checkpoint
        ("results.json", None),
    ],
)
def test_full_disk_loses_nothing(
    tmp_path, corpus_dir, capsys, monkeypatch, reference, target, after
):
    reference_dir, reference_results = reference
    out = tmp_path / "run"
    disk = Disk(out, target, after)
    with monkeypatch.context() as patch:
        patch.setattr(builtins, "open", disk.open(builtins.open))
        args = tiny_args(out, corpus_dir, *FLAGS)
        assert_one_line_error(capsys, args, f"{target}: no space left on device (ENOSPC)")

    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp") or ".partial" in p.name]
    config = out / "config.json"
    assert not config.exists() or json.loads(config.read_text())["steps"] == 12
    if (out / "metrics.jsonl").exists():
        assert read_records(out / "metrics.jsonl")[1] is None  # no torn line
    for info in ckpt.list_checkpoints(out):
        assert ckpt.verify_files(info) is None

    # disk space is back: the same command with --resume finishes the run, as if nothing happened
    assert main(tiny_args(out, corpus_dir, *FLAGS, "--resume")) == 0
    resumed = json.loads((out / "results.json").read_text())
    assert_runs_equal(reference_dir, out, reference_results, resumed)
