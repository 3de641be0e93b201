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

from mtdao.train import checkpoint as ckpt
from mtdao.train.checkpoint import CheckpointError, CheckpointStore
from mtdao.train.checkpoint_state import ProcessGroupCollective, explain_load_error


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
    assert record["xxh3_128"] == ckpt.file_checksum(info.path / name, "xxh3_128")
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
    with caplog.at_level(logging.WARNING, logger="mtdao.train.checkpoint"):
        loaded = CheckpointStore(tmp_path).load()
    assert loaded.step == 10 and loaded.state["step"] == 10
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith("skipping damaged checkpoint") and named in warning
    assert len(loaded.skipped) == 1 and named in loaded.skipped[0]
    assert ckpt.has_checkpoint(tmp_path)


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
    with caplog.at_level(logging.WARNING, logger="mtdao.train.checkpoint"):
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


def test_checkpoint_of_the_older_single_directory_layout_still_loads(tmp_path):
    legacy = tmp_path / "checkpoint"
    legacy.mkdir()
    torch.save(state_at(6), legacy / "rank0.pt")
    (legacy / "meta.json").write_text(json.dumps({"step": 6, "world_size": 1, "config": {}}))
    assert CheckpointStore(tmp_path).load().step == 6
    save_steps(tmp_path, [7])
    assert saved_steps(tmp_path) == [7, 6] and legacy.is_dir()  # newer layout first; old kept


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


# -- several processes ----------------------------------------------------------------------------


class ThreadGroup:
    """Processes of one run simulated by threads: ``all_true`` is a real barrier between them."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=30)
        self.flags = [True] * world_size

    def member(self, rank: int):
        group = self

        class Member:
            def all_true(self, flag: bool) -> bool:
                group.flags[rank] = flag
                group.barrier.wait()
                verdict = all(group.flags)
                group.barrier.wait()  # everyone has read before the next round writes
                return verdict

        return Member()

    def run(self, action) -> list:
        """action(rank, collective) on every rank at once; each rank's result or exception."""
        results: list = [None] * self.world_size

        def target(rank):
            try:
                results[rank] = action(rank, self.member(rank))
            except Exception as error:  # returned for the test to inspect
                results[rank] = error

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.world_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads)
        return results


def multi_rank_save(run_dir, step, world_size=3, state=state_at, keep=2):
    def save(rank, collective):
        store = CheckpointStore(
            run_dir, rank=rank, world_size=world_size, keep=keep, collective=collective
        )
        return store.save(step, state(step, rank), {"config": {}})

    return ThreadGroup(world_size).run(save)


def multi_rank_load(run_dir, world_size=3, agree=True):
    def load(rank, collective):
        store = CheckpointStore(
            run_dir, rank=rank, world_size=world_size, collective=collective if agree else None
        )
        return store.load()

    return ThreadGroup(world_size).run(load)


def test_every_rank_writes_its_file_and_rank_zero_commits(tmp_path):
    results = multi_rank_save(tmp_path, 10)
    assert results[0] == tmp_path / "checkpoints" / "step-00000010" and results[1:] == [None, None]
    (info,) = ckpt.list_checkpoints(tmp_path)
    assert sorted(info.files) == ["rank0.pt", "rank1.pt", "rank2.pt"] and info.world_size == 3
    assert ckpt.verify_files(info) is None
    for rank, loaded in enumerate(multi_rank_load(tmp_path)):
        assert loaded.step == 10 and loaded.state["params"]["layers.0.attn.qkv.weight"][0, 0] == (
            100 + rank
        )


@pytest.mark.parametrize("agree", [True, False], ids=["collective", "each-checks-all"])
def test_one_damaged_rank_file_makes_every_rank_fall_back_together(tmp_path, agree):
    multi_rank_save(tmp_path, 10)
    multi_rank_save(tmp_path, 20)
    flip_byte(ckpt.list_checkpoints(tmp_path)[0].path / "rank1.pt")
    loaded = multi_rank_load(tmp_path, agree=agree)
    assert [result.step for result in loaded] == [10, 10, 10]
    assert [result.state["step"] for result in loaded] == [10, 10, 10]


def test_one_rank_with_a_full_disk_fails_every_rank_and_writes_nothing(tmp_path, monkeypatch):
    multi_rank_save(tmp_path, 10)
    real_save = torch.save

    def save(obj, handle):
        if obj["params"]["layers.0.attn.qkv.weight"][0, 0] == 201:  # rank 1 at step 20
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, handle)

    monkeypatch.setattr(torch, "save", save)
    results = multi_rank_save(tmp_path, 20)
    assert all(isinstance(r, ckpt.CheckpointWriteError) for r in results)
    assert "no space left on device" in str(results[1]) and "rank1.pt" in str(results[1])
    assert "another process could not write" in str(results[0])
    assert entries(tmp_path) == ["step-00000010"]
    assert [r.step for r in multi_rank_load(tmp_path)] == [10, 10, 10]


def test_one_rank_with_a_nan_makes_every_rank_refuse(tmp_path):
    multi_rank_save(tmp_path, 10)

    def state(step, rank):
        values = state_at(step, rank)
        if rank == 2:
            values["optimizer"]["state"][3]["exp_avg_sq"][1] = float("nan")
        return values

    results = multi_rank_save(tmp_path, 20, state=state)
    assert all(isinstance(r, ckpt.UnsavableStateError) for r in results)
    assert "optimizer.state.3.exp_avg_sq holds NaN/inf" in str(results[2])
    assert "another process's state" in str(results[0])
    assert "last finite checkpoint is" in str(results[0]) and entries(tmp_path) == ["step-00000010"]


def test_commit_requires_every_rank_file(tmp_path):
    """Even without agreement (only a barrier), rank 0 never commits a checkpoint that lacks a
    rank's file: the other ranks' checksums are the proof their files are complete."""
    results = ThreadGroup(1).run(
        lambda rank, collective: CheckpointStore(tmp_path, rank=0, world_size=2).save(
            5, state_at(5), {}
        )
    )
    assert isinstance(results[0], ckpt.CheckpointWriteError)
    assert "process 1 wrote no file" in str(results[0])
    assert not (tmp_path / "checkpoints").exists() or entries(tmp_path) == []


def test_process_group_collective_on_a_one_process_group(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        collective = ProcessGroupCollective()
        assert collective.all_true(True) and not collective.all_true(False)
        CheckpointStore(tmp_path, collective=collective).save(1, state_at(1), {})
        assert CheckpointStore(tmp_path, collective=collective).load().step == 1
    finally:
        dist.destroy_process_group()
