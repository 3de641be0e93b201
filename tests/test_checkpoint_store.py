"""The checkpoint store: keeps the newest N, refuses NaN/inf states, detects damaged files and
falls back to the previous good checkpoint, reports a full disk in one line, and agrees across
processes (simulated here by threads sharing one collective)."""

from __future__ import annotations

import errno
import json
import logging
import threading

import pytest
import torch

from mtdao.state_files import explain_load_error
from mtdao.train.checkpoint import store as ckpt
from mtdao.train.checkpoint.store import CheckpointError, CheckpointStore
from mtdao.train.durable import file_checksum


def state_at(step: int, rank: int = 0) -> dict:
    """A checkpoint-shaped state whose values identify the step and the rank."""
    value = float(step * 10 + rank)
    return {
        "step": step,
        "params": {"layers.0.attn.qkv.weight": torch.full((4, 4), value)},
        "optimizer": {
            "state": {3: {"exp_avg": torch.full((4,), value), "exp_avg_sq": torch.ones(4)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [3]}],
        },
        "rng": torch.get_rng_state(),
        "evals": [(step, 3.5)],
    }


def saved_steps(run_dir) -> list[int]:
    return [info.step for info in ckpt.list_checkpoints(run_dir)]


def entries(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def flip_byte(path, offset_fraction: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * offset_fraction)] ^= 0x01
    path.write_bytes(bytes(data))


def save_steps(run_dir, steps, keep: int = 2) -> CheckpointStore:
    store = CheckpointStore(run_dir, keep=keep)
    for step in steps:
        store.save(step, state_at(step), {"config": {"lr": 0.1}})
    return store


# -- keeping the newest N -------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_keeps_the_newest_n_checkpoints(tmp_path, keep):
    save_steps(tmp_path, [10, 20, 30, 40], keep=keep)
    assert saved_steps(tmp_path) == [40, 30, 20][:keep]
    assert entries(tmp_path) == [f"step-{s:08d}" for s in (20, 30, 40)[3 - keep :]]
    loaded = CheckpointStore(tmp_path).load()
    assert loaded.step == 40 and loaded.skipped == []
    assert torch.equal(
        loaded.state["params"]["layers.0.attn.qkv.weight"], torch.full((4, 4), 400.0)
    )
    assert loaded.state["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert loaded.meta["config"] == {"lr": 0.1} and loaded.meta["world_size"] == 1


def test_metadata_records_size_and_checksum_of_every_file(tmp_path):
    save_steps(tmp_path, [5])
    (info,) = ckpt.list_checkpoints(tmp_path)
    ((name, record),) = info.files.items()
    assert name == "rank0.pt" and record["bytes"] == (info.path / name).stat().st_size
    assert record["xxh3_128"] == file_checksum(info.path / name, "xxh3_128")
    assert ckpt.verify_files(info) is None and ckpt.has_checkpoint(tmp_path)


def test_saving_the_same_step_twice_keeps_both_under_distinct_names(tmp_path):
    """E.g. a periodic checkpoint at the last step, then the final one: no directory swap."""
    store = save_steps(tmp_path, [8])
    store.save(8, state_at(9), {})
    assert entries(tmp_path) == ["step-00000008", "step-00000008.1"]
    assert torch.equal(
        store.load().state["optimizer"]["state"][3]["exp_avg"], torch.full((4,), 90.0)
    )


def test_keep_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep must be a positive integer, got 0"):
        CheckpointStore(tmp_path, keep=0)


def test_no_checkpoint_yet(tmp_path):
    assert CheckpointStore(tmp_path / "new").load() is None
    assert not ckpt.has_checkpoint(tmp_path / "new")
    with pytest.raises(CheckpointError, match="no checkpoint to resume from"):
        ckpt.load_meta(tmp_path / "new")


# -- a diverged state never replaces a good checkpoint -------------------------------------------


@pytest.mark.parametrize(
    "where, path",
    [
        (lambda s: s["optimizer"]["state"][3]["exp_avg_sq"], "optimizer.state.3.exp_avg_sq"),
        (lambda s: s["params"]["layers.0.attn.qkv.weight"], "params.layers.0.attn.qkv.weight"),
    ],
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_state_is_refused_before_anything_is_written(tmp_path, where, path, bad):
    save_steps(tmp_path, [10, 20])
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "checkpoints").rglob("*")}
    state = state_at(30)
    where(state)[1] = bad
    with pytest.raises(ckpt.UnsavableStateError) as raised:
        CheckpointStore(tmp_path).save(30, state, {})
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("checkpoint at step 30 refused, nothing written: ")
    assert f"{path} holds NaN/inf" in message
    assert f"last finite checkpoint is {tmp_path / 'checkpoints' / 'step-00000020'} (step 20)" in (
        message
    )
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "checkpoints").rglob("*")} == before


def test_non_finite_refusal_without_any_checkpoint(tmp_path):
    state = state_at(1)
    state["optimizer"]["state"][3]["exp_avg"][0] = float("nan")
    with pytest.raises(ckpt.UnsavableStateError, match="there is no finite checkpoint on disk"):
        CheckpointStore(tmp_path).save(1, state, {})
    assert not (tmp_path / "checkpoints").exists()


def test_non_finite_check_can_be_turned_off(tmp_path):
    """A run that deliberately leaves a diverged worker out (and heals it later) may save it."""
    state = state_at(1)
    state["params"]["layers.0.attn.qkv.weight"][0, 0] = float("nan")
    CheckpointStore(tmp_path).save(1, state, {}, check_finite=False)
    assert saved_steps(tmp_path) == [1]
    assert ckpt.latest_checkpoint(tmp_path).meta["finite"] is False
    state["params"]["layers.0.attn.qkv.weight"][0, 0] = 1.0
    CheckpointStore(tmp_path).save(2, state, {}, check_finite=False)
    state["params"]["layers.0.attn.qkv.weight"][0, 0] = float("inf")
    with pytest.raises(ckpt.UnsavableStateError, match="last finite checkpoint is .*\\(step 2\\)"):
        CheckpointStore(tmp_path).save(3, state, {})


# -- damaged files: detected, skipped with a warning, fallback ------------------------------------


def damage_newest(run_dir, how: str) -> str:
    newest = ckpt.list_checkpoints(run_dir)[0].path
    weights = newest / "rank0.pt"
    if how == "flip":
        flip_byte(weights)
    elif how == "truncate":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif how == "delete":
        weights.unlink()
    elif how == "meta":
        (newest / "meta.json").write_text('{"step": 3')
        return str(newest / "meta.json")
    return str(weights)


@pytest.mark.parametrize("how", ["flip", "truncate", "delete", "meta"])
def test_damaged_newest_checkpoint_falls_back_with_a_warning(tmp_path, caplog, how):
    save_steps(tmp_path, [10, 20])
    named = damage_newest(tmp_path, how)
    with caplog.at_level(logging.WARNING, logger="mtdao.train.checkpoint.store"):
        loaded = CheckpointStore(tmp_path).load()
    assert loaded.step == 10 and loaded.state["step"] == 10
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith("skipping damaged checkpoint") and named in warning
    assert len(loaded.skipped) == 1 and named in loaded.skipped[0]
    assert ckpt.has_checkpoint(tmp_path)


def renamed_checksum(name: str):
    def edit(meta: dict) -> None:
        entry = meta["files"]["rank0.pt"]
        entry[name] = entry.pop("xxh3_128")

    return edit


@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda meta: meta.update(step=float("inf")), "its step is not an integer"),
        (lambda meta: meta.update(world_size="1"), "its world_size is not an integer"),
        (lambda meta: meta.update(backend=["torch"]), "its backend is not text"),
        (lambda meta: meta.update(files=list(meta["files"].items())), "its files are not an"),
        (lambda meta: meta["files"].update({"rank0.pt": 7}), "is not {bytes, checksum}"),
        (renamed_checksum("md6"), "names the checksum 'md6'"),
        (renamed_checksum("shake_128"), "names the checksum 'shake_128'"),
    ],
    ids=[
        "step-infinity",
        "world-size-text",
        "backend-list",
        "files-list",
        "entry-number",
        "checksum-unknown",
        "checksum-shake",
    ],
)
def test_a_meta_json_edited_out_of_shape_is_set_aside_in_one_line(tmp_path, caplog, edit, problem):
    """meta.json is read before any checksum: a value no save writes (Infinity, text where a
    number goes, an entry that is no {bytes, checksum}, a checksum with no plain hex digest)
    would end the resume in a traceback, or refuse it whole, instead of the one before."""
    save_steps(tmp_path, [10, 20])
    newest = ckpt.list_checkpoints(tmp_path)[0].path
    meta = json.loads((newest / "meta.json").read_text())
    edit(meta)
    (newest / "meta.json").write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING, logger="mtdao.train.checkpoint.store"):
        loaded = CheckpointStore(tmp_path).load()
    assert loaded.step == 10 and loaded.state["step"] == 10
    (warning,) = [r.getMessage() for r in caplog.records]
    assert f"{newest / 'meta.json'} is unreadable (" in warning and problem in warning
    assert "\n" not in warning
    assert newest.with_name(f"{newest.name}.damaged").is_dir()


def test_a_flipped_byte_is_caught_by_the_checksum(tmp_path):
    """Today's torch loads a file with one flipped data byte without complaint: the checksum
    is what catches it."""
    save_steps(tmp_path, [10])
    weights = ckpt.list_checkpoints(tmp_path)[0].path / "rank0.pt"
    flip_byte(weights, 0.6)
    torch.load(weights, weights_only=True)  # no error from torch itself
    with pytest.raises(CheckpointError, match="rank0.pt is corrupted or incomplete .*checksum"):
        ckpt.load_checkpoint(tmp_path, 0, 1)


def test_every_checkpoint_damaged_is_one_line_naming_each(tmp_path):
    save_steps(tmp_path, [10, 20])
    for info in ckpt.list_checkpoints(tmp_path):
        flip_byte(info.path / "rank0.pt")
    with pytest.raises(CheckpointError) as raised:
        CheckpointStore(tmp_path).load()
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"no usable checkpoint in {tmp_path}: ")
    assert "step-00000020/rank0.pt is corrupted" in message
    assert "step-00000010/rank0.pt is corrupted" in message
    assert not ckpt.has_checkpoint(tmp_path)


def test_damaged_checkpoint_is_set_aside_and_overtaken(tmp_path):
    """Resumed from step 10 past a damaged 20: the damaged one is kept for inspection but never
    loaded or counted among the kept ones again, and the next saves are newer than it."""
    save_steps(tmp_path, [10, 20])
    damage_newest(tmp_path, "flip")
    store = CheckpointStore(tmp_path, keep=2)
    assert store.load().step == 10
    assert entries(tmp_path) == ["step-00000010", "step-00000020.damaged"]
    store.save(15, state_at(15), {})
    assert entries(tmp_path) == ["step-00000010", "step-00000015", "step-00000020.damaged"]
    store.save(20, state_at(20), {})
    assert entries(tmp_path) == ["step-00000015", "step-00000020", "step-00000020.damaged"]
    assert CheckpointStore(tmp_path).load().step == 20


def test_newest_means_most_recently_saved_not_highest_step(tmp_path):
    save_steps(tmp_path, [10, 20], keep=3)
    CheckpointStore(tmp_path, keep=3).save(15, state_at(15), {})
    assert saved_steps(tmp_path) == [15, 20, 10]
    assert CheckpointStore(tmp_path).load().step == 15


def test_a_file_the_safe_loader_refuses_never_suggests_weights_only_false(tmp_path, caplog):
    """A file with a foreign object (and a matching checksum) is refused with a clean line."""
    save_steps(tmp_path, [10, 20])
    newest = ckpt.list_checkpoints(tmp_path)[0]
    torch.save({"payload": threading.Lock}, newest.path / "rank0.pt")
    meta = json.loads((newest.path / "meta.json").read_text())
    meta["files"]["rank0.pt"] = {"bytes": (newest.path / "rank0.pt").stat().st_size}
    (newest.path / "meta.json").write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING, logger="mtdao.train.checkpoint.store"):
        assert CheckpointStore(tmp_path).load().step == 10
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "holds an object the safe loader refuses (Unsupported global" in warning
    assert "weights_only" not in warning and "will likely succeed" not in warning


def test_load_error_text_keeps_the_reason_and_drops_the_advice(tmp_path):
    torch.save({"x": threading.Lock}, tmp_path / "foreign.pt")
    with pytest.raises(Exception) as raised:
        torch.load(tmp_path / "foreign.pt", weights_only=True)
    assert "will likely succeed" in str(raised.value)  # what torch says ...
    text = explain_load_error(raised.value)  # ... and what the user sees
    assert "will likely succeed" not in text and "weights_only" not in text
    assert "Unsupported global" in text and "\n" not in text


def test_world_size_mismatch_is_refused(tmp_path):
    save_steps(tmp_path, [10])
    with pytest.raises(CheckpointError, match="written by 1 process\\(es\\), this run has 4"):
        CheckpointStore(tmp_path, world_size=4).load()


def test_a_checkpoint_of_the_single_directory_layout_before_0_2_is_not_read(tmp_path):
    legacy = tmp_path / "checkpoint"
    legacy.mkdir()
    torch.save(state_at(6), legacy / "rank0.pt")
    (legacy / "meta.json").write_text(json.dumps({"step": 6, "world_size": 1, "config": {}}))
    assert CheckpointStore(tmp_path).load() is None
    save_steps(tmp_path, [7])
    assert saved_steps(tmp_path) == [7] and legacy.is_dir()  # left alone


# -- a full disk ----------------------------------------------------------------------------------


@pytest.mark.parametrize("victim", ["rank0.pt", "meta.json"])
def test_full_disk_is_one_line_and_leaves_nothing_behind(tmp_path, monkeypatch, victim):
    save_steps(tmp_path, [10, 20])
    real_open = open

    class FullDisk:
        def __init__(self, handle):
            self.handle = handle

        def write(self, data):
            self.handle.write(bytes(data)[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.handle, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

    def filling_open(path, mode="r", *args, **kwargs):
        handle = real_open(path, mode, *args, **kwargs)
        return FullDisk(handle) if str(path).endswith(f"{victim}.tmp") else handle

    from mtdao.train import durable

    monkeypatch.setattr(durable, "open", filling_open, raising=False)
    with pytest.raises(ckpt.CheckpointWriteError) as raised:
        CheckpointStore(tmp_path).save(30, state_at(30), {})
    monkeypatch.undo()
    message = str(raised.value)
    staging = tmp_path / "checkpoints" / "step-00000030.partial"
    assert "\n" not in message and "no space left on device (ENOSPC)" in message
    assert f"cannot write {staging / victim}" in message
    assert entries(tmp_path) == ["step-00000010", "step-00000020"]  # no partial directory
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith((".tmp", ".partial"))]
    assert CheckpointStore(tmp_path).load().step == 20
