"""metrics.jsonl after a crash: a torn last line is dropped with a warning naming the file and
line, every complete record is kept; results/config writes are atomic and report a full disk."""

from __future__ import annotations

import errno
import json
import logging
import os

import pytest

from mtdao.train import durable
from mtdao.train.metrics import MetricsError, MetricsLog, read_metrics, write_json


def write_log(run_dir, lines: list[str]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(lines))


RECORDS = [json.dumps({"step": step, "train_loss": 5.0 - step}) + "\n" for step in (1, 2, 3)]


def test_torn_last_line_is_dropped_on_resume_with_a_warning(tmp_path, caplog):
    write_log(tmp_path, [*RECORDS, '{"step": 4, "train_lo'])
    with caplog.at_level(logging.WARNING, logger="mtdao.train.metrics"):
        log = MetricsLog(tmp_path, append=True)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert str(tmp_path / "metrics.jsonl") in warning and "dropped line 4" in warning
    log.write({"step": 4, "train_loss": 1.0})
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
    assert (tmp_path / "metrics.jsonl").read_text().endswith('"train_loss": 1.0}\n')


def test_complete_last_record_without_its_newline_is_kept(tmp_path, caplog):
    write_log(tmp_path, [*RECORDS, json.dumps({"step": 4})])
    with caplog.at_level(logging.WARNING, logger="mtdao.train.metrics"):
        MetricsLog(tmp_path, append=True).write({"step": 5})
    assert caplog.records == []
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]


def test_reading_ignores_a_torn_last_line(tmp_path):
    write_log(tmp_path, [*RECORDS, '{"step": 4, "val'])
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


def test_damaged_line_before_the_last_is_named_and_nothing_is_changed(tmp_path):
    lines = [RECORDS[0], "garbage\n", *RECORDS[1:]]
    write_log(tmp_path, lines)
    path = tmp_path / "metrics.jsonl"
    with pytest.raises(MetricsError, match=f"{path} line 2 is not a JSON record"):
        MetricsLog(tmp_path, append=True)
    assert path.read_text() == "".join(lines)


def test_truncate_after_keeps_records_up_to_the_step(tmp_path):
    write_log(tmp_path, [*RECORDS, '{"step": 4, "tr'])
    log = MetricsLog(tmp_path, append=True)
    log.truncate_after(2)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert not list(tmp_path.glob("*.tmp"))


def test_write_json_on_a_full_disk_leaves_the_previous_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    write_json(path, {"final_val_loss": 3.5})

    def full_fsync(descriptor):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full_fsync)
    with pytest.raises(durable.WriteError) as raised:
        write_json(path, {"final_val_loss": 3.4})
    assert str(raised.value) == f"cannot write {path}: no space left on device (ENOSPC)"
    assert json.loads(path.read_text()) == {"final_val_loss": 3.5}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
