"""Forged checkpoint files run no code and are never resumed from.

A sharded checkpoint's DCP ``.metadata`` is a pickle; whoever can write to the run directory can
replace it with one that calls any function, and rewrite its checksum in ``meta.json`` to match.
Here a one-process sharded store (DCP works without a process group) saves two checkpoints; the
newest one's metadata is forged with a payload that writes a marker file, and its checksum fixed
up: loading refuses it in one line, falls back to the checkpoint before, and the marker never
appears. The plain checkpoints' ``rank<r>.pt`` are read by ``torch.load(weights_only=True)``:
a forged one is refused too.
"""

from __future__ import annotations

import json
import logging
import pickle
import traceback
from pathlib import Path

import pytest
import torch

from mtdao.train.checkpoint import store as ckpt
from mtdao.train.checkpoint.dcp import MODEL_DIR, ShardedCheckpointStore, load_sharded
from mtdao.train.checkpoint.dcp_metadata import read_metadata
from mtdao.train.durable import CHECKSUM, file_checksum

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP: "no process group"


class Payload:
    """Unpickled, it writes ``marker``: what an attacker's code would do first."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def sharded_state(value: float) -> dict:
    return {
        "sharded": {"worker0": {"model": {"w": torch.full((4, 3), value)}, "step": 1}},
        "worker": {"step": int(value), "torch_rng": torch.get_rng_state()},
    }


@pytest.fixture
def two_checkpoints(tmp_path) -> tuple[ShardedCheckpointStore, list[Path]]:
    store = ShardedCheckpointStore(tmp_path, rank=0, workers=1, shards=1)
    paths = [store.save(step, sharded_state(step), {"config": {}}) for step in (3, 6)]
    return store, paths


def forge(path: Path, name: str, content: bytes) -> None:
    """Replace file ``name`` of checkpoint ``path`` and fix its size and checksum in meta.json,
    as an attacker who can write to the run directory would."""
    (path / name).write_bytes(content)
    meta = json.loads((path / "meta.json").read_text())
    meta["files"][name] = {"bytes": len(content), CHECKSUM: file_checksum(path / name)}
    (path / "meta.json").write_text(json.dumps(meta))


def test_a_real_metadata_reads_back_as_dcp_reads_it(two_checkpoints):
    _, paths = two_checkpoints
    path = paths[-1] / MODEL_DIR / ".metadata"
    with open(path, "rb") as file:
        expected = pickle.load(file)  # our own file, just written
    assert read_metadata(path, {"__0_0.distcp"}) == expected


def test_a_forged_metadata_runs_nothing_and_the_checkpoint_before_is_used(
    two_checkpoints, tmp_path, caplog
):
    store, (older, newest) = two_checkpoints
    marker = tmp_path / "payload-ran"
    forge(newest, f"{MODEL_DIR}/.metadata", pickle.dumps(Payload(marker)))
    assert ckpt.verify_files(ckpt.latest_checkpoint(tmp_path)) is None  # checksums pass

    with caplog.at_level(logging.WARNING):
        loaded = store.load()
    assert not marker.exists()
    assert loaded.path == older and loaded.state["worker"]["step"] == 3
    (warning,) = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert "builtins.exec, which is not DCP metadata" in warning and "\n" not in warning
    assert newest.with_name(f"{newest.name}.damaged").is_dir()  # set aside for inspection
    target = {"worker0": {"model": {"w": torch.zeros(4, 3)}, "step": 0}}
    load_sharded(loaded.path, target)
    assert torch.equal(target["worker0"]["model"]["w"], torch.full((4, 3), 3.0))


def test_reading_a_forged_metadata_directly_is_refused(two_checkpoints, tmp_path):
    """The reader DCP is given refuses it too (a checkpoint chosen, then replaced)."""
    _, (_, newest) = two_checkpoints
    marker = tmp_path / "payload-ran"
    forge(newest, f"{MODEL_DIR}/.metadata", pickle.dumps(Payload(marker)))
    target = {"worker0": {"model": {"w": torch.zeros(4, 3)}, "step": 0}}
    with pytest.raises(ckpt.CheckpointError, match="not DCP metadata"):
        load_sharded(newest, target)
    assert not marker.exists()


def test_a_metadata_pointing_at_another_file_is_refused(two_checkpoints):
    """Only built from DCP's classes, but its slices lie outside the checkpoint's files."""
    store, (older, newest) = two_checkpoints
    path = newest / MODEL_DIR / ".metadata"
    with open(path, "rb") as file:
        metadata = pickle.load(file)
    for where in metadata.storage_data.values():
        where.relative_path = "../../../elsewhere.distcp"
    forge(newest, f"{MODEL_DIR}/.metadata", pickle.dumps(metadata))
    with pytest.raises(ValueError, match="not a file of this checkpoint"):
        read_metadata(path, {"__0_0.distcp"})
    assert store.load().path == older


def test_a_metadata_pointing_past_the_end_of_its_data_file_falls_back(two_checkpoints, caplog):
    """Built from DCP's classes and naming the checkpoint's own file, but a slice's offset lies
    past its end (the resume used to end in an EOFError traceback, and every later one too)."""
    store, (older, newest) = two_checkpoints
    path = newest / MODEL_DIR / ".metadata"
    with open(path, "rb") as file:
        metadata = pickle.load(file)
    size = (newest / MODEL_DIR / "__0_0.distcp").stat().st_size
    for where in metadata.storage_data.values():
        where.offset = size + 1000
    forge(newest, f"{MODEL_DIR}/.metadata", pickle.dumps(metadata))
    with pytest.raises(ValueError, match="past the end of __0_0.distcp"):
        read_metadata(path, {"__0_0.distcp"})
    with caplog.at_level(logging.WARNING):
        loaded = store.load()
    assert loaded.path == older and loaded.state["worker"]["step"] == 3
    (warning,) = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert "past the end" in warning and "\n" not in warning
    target = {"worker0": {"model": {"w": torch.zeros(4, 3)}, "step": 0}}
    load_sharded(loaded.path, target)
    assert torch.equal(target["worker0"]["model"]["w"], torch.full((4, 3), 3.0))


def test_a_forged_plain_checkpoint_runs_nothing_and_the_one_before_is_used(tmp_path, caplog):
    store = ckpt.CheckpointStore(tmp_path)
    older = store.save(3, {"step": 3, "w": torch.ones(2)}, {"config": {}})
    newest = store.save(6, {"step": 6, "w": torch.ones(2)}, {"config": {}})
    marker = tmp_path / "payload-ran"
    for content in (pickle.dumps(Payload(marker)), _torch_saved(Payload(marker))):
        forge(newest, "rank0.pt", content)
        with caplog.at_level(logging.WARNING):
            reason = store._try_load(ckpt.latest_checkpoint(tmp_path))[1]
        assert not marker.exists()
        assert "the safe loader refuses (" in reason and "()" not in reason, reason
    loaded = store.load()
    assert loaded.path == older and not marker.exists()


def _torch_saved(value) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def test_a_metadata_naming_a_stream_transform_falls_back_in_one_line(two_checkpoints, caplog):
    """Built from DCP's classes, but a slice names a stream transform (mtdao writes none): DCP
    would stop every resume in a traceback looking it up (its CheckpointException is no
    Exception)."""
    store, (older, newest) = two_checkpoints
    path = newest / MODEL_DIR / ".metadata"
    with open(path, "rb") as file:
        metadata = pickle.load(file)
    for where in metadata.storage_data.values():
        where.transform_descriptors = ["zstd"]
    forge(newest, f"{MODEL_DIR}/.metadata", pickle.dumps(metadata))
    target = {"worker0": {"model": {"w": torch.zeros(4, 3)}, "step": 0}}
    with pytest.raises(ckpt.CheckpointError) as refused:
        load_sharded(newest, target)
    assert str(path) in str(refused.value) and "\n" not in str(refused.value)
    assert "stream transforms ['zstd']" in str(refused.value)
    assert "resume from an earlier checkpoint" in str(refused.value)
    with caplog.at_level(logging.WARNING):
        loaded = store.load()
    assert loaded.path == older and loaded.state["worker"]["step"] == 3
    (warning,) = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert "stream transforms" in warning and "\n" not in warning


def test_a_failure_dcp_reports_as_its_checkpoint_exception_is_one_line(
    two_checkpoints, monkeypatch
):
    """DCP's CheckpointException derives from BaseException: it is caught all the same."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    def failing(*args, **kwargs):
        failure = ValueError("Unknown extension name='zstd'")
        raise CheckpointException("load failed", {0: (failure, traceback.StackSummary())})

    monkeypatch.setattr(dcp, "load", failing)
    _, (_, newest) = two_checkpoints
    target = {"worker0": {"model": {"w": torch.zeros(4, 3)}, "step": 0}}
    with pytest.raises(ckpt.CheckpointError, match="could not be read") as refused:
        load_sharded(newest, target)
    assert str(refused.value).endswith("could not be read: Unknown extension name='zstd'")
