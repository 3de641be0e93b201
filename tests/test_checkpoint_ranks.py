"""The checkpoint store across processes (simulated by threads sharing one collective): every
rank writes its file and rank 0 commits; a failure or NaN on one rank fails the save on all; a
damaged file on one rank makes all fall back to the same checkpoint."""

from __future__ import annotations

import errno
import threading

import pytest
import torch

from mtdao.train.checkpoint import store as ckpt
from mtdao.train.checkpoint.agreement import BarrierOnly, ProcessGroupCollective
from mtdao.train.checkpoint.store import CheckpointStore


def state_at(step: int, rank: int = 0) -> dict:
    value = float(step * 10 + rank)
    return {
        "step": step,
        "params": {"layers.0.attn.qkv.weight": torch.full((4, 4), value)},
        "optimizer": {"state": {3: {"exp_avg_sq": torch.ones(4)}}},
    }


def entries(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def flip_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


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
        lambda rank, collective: CheckpointStore(
            tmp_path, rank=0, world_size=2, collective=BarrierOnly(lambda: None)
        ).save(5, state_at(5), {})
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


def test_saving_from_several_processes_needs_a_collective(tmp_path):
    with pytest.raises(ValueError, match="needs a collective"):
        CheckpointStore(tmp_path, rank=1, world_size=2).save(1, state_at(1), {})
