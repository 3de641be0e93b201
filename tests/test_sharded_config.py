"""``--shards``: what is refused, in one line each, before any process group or data is touched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mtdao import cli
from mtdao.model import Llama, model_config
from mtdao.sync.dtensors import process_share
from mtdao.sync.shard_mesh import check_shardable
from mtdao.train.command import config_to_argv
from mtdao.train.config import TrainConfig, resolve
from mtdao.train.distributed import ProcessInfo
from mtdao.train.sharding import check_topology, worker_of


def test_shards_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="--shards must be a positive integer, got 0"):
        resolve(TrainConfig.of(shards=0))


def test_each_process_of_a_worker_takes_an_equal_part_of_its_batch():
    with pytest.raises(ValueError, match="--batch-size 16 does not split over --shards 3"):
        resolve(TrainConfig.of(shards=3, batch_size=16))
    assert resolve(TrainConfig.of(shards=4, batch_size=16)).parallel.shards == 4


@pytest.mark.parametrize(
    ("workers", "shards", "world_size", "message"),
    [
        (2, 2, 1, "--shards 2: sharded workers need one process per shard; launch with "
         "torchrun --nproc-per-node 4 (--workers 2 x --shards 2)"),
        (2, 4, 6, "--shards 4: torchrun started 6 processes, which do not divide into groups "
         "of 4"),
        (2, 2, 6, "--workers 2 x --shards 2 needs 4 processes, but torchrun started 6 (3 groups "
         "of 2)"),
        (4, 1, 2, "--workers 4 but torchrun started 2 processes; they must match"),
    ],
)  # fmt: skip
def test_a_launch_that_does_not_make_workers_times_shards_is_refused(
    workers, shards, world_size, message
):
    config = TrainConfig.of(workers=workers, shards=shards)
    with pytest.raises(ValueError) as error:
        check_topology(config, ProcessInfo(rank=0, world_size=world_size))
    assert str(error.value).startswith(message)
    assert "\n" not in str(error.value)


def test_launches_that_make_workers_times_shards_pass():
    check_topology(TrainConfig.of(workers=2, shards=2), ProcessInfo(rank=3, world_size=4))
    check_topology(TrainConfig.of(workers=2, shards=1), ProcessInfo(rank=1, world_size=2))
    check_topology(TrainConfig.of(workers=4, shards=1), ProcessInfo())  # simulated
    assert [worker_of(ProcessInfo(rank, 6), 3) for rank in range(6)] == [0, 0, 0, 1, 1, 1]


def test_shards_without_torchrun_is_one_line_from_the_command_line(capsys, tmp_path):
    argv = ["train", "--workers", "2", "--shards", "2", "--out", str(tmp_path / "run")]
    assert cli.main([*argv, "--no-progress"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("mtdao train: error: --shards 2: sharded workers need one process")
    assert "\n" not in error
    assert not (tmp_path / "run").exists()


def test_a_model_that_does_not_shard_is_refused():
    model = Llama(model_config("micro", vocab_size=256, max_seq_len=32))
    check_shardable(model, 2)
    check_shardable(model, 32)  # every parameter: at least one row per process
    with pytest.raises(ValueError) as error:
        check_shardable(model, 65)
    assert str(error.value) == (
        "`shards` 65: the model does not shard: parameter embed.weight (256, 64) has 256 rows "
        "along dim 0, which leaves process 64 of every worker none of it; use fewer shards"
    )


@pytest.mark.parametrize(
    ("rows", "shards", "shards_ok"),
    [(5, 2, True), (5, 4, False), (3, 3, True), (6, 4, False), (7, 4, True)],
)
def test_does_not_shard_means_a_process_would_hold_none_of_a_parameter(rows, shards, shards_ok):
    """FSDP2 cuts dim 0 into chunks of ceil(rows / shards): 5 rows over 4 is 2, 2, 1, 0."""
    model = nn.Linear(3, rows)
    if shards_ok:
        check_shardable(model, shards)
    else:
        with pytest.raises(ValueError, match="does not shard: parameter weight"):
            check_shardable(model, shards)


def test_a_scalar_parameter_does_not_shard():
    model = nn.Module()
    model.scale = nn.Parameter(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"parameter scale \(\) has 0 rows"):
        check_shardable(model, 2)


def test_shards_travel_with_the_config():
    config = resolve(TrainConfig.of(workers=2, shards=2, batch_size=4))
    assert "--shards" in config_to_argv(config)
    assert config.run_name() == "mtdao-adam-M2-S2-K4-seed0"
    assert resolve(TrainConfig.of(workers=2)).run_name() == "mtdao-adam-M2-K4-seed0"
    # a sharded checkpoint reshards: a resume may change the shards per worker, not the workers
    assert resolve(TrainConfig.of(shards=2)).differences(resolve(TrainConfig.of(shards=4))) == []
    assert resolve(TrainConfig.of(workers=2)).differences(resolve(TrainConfig.of(workers=4)))


def test_an_unsharded_process_holds_and_sends_every_tensor_whole():
    assert process_share(list(nn.Linear(3, 4).parameters())) == 1.0


@pytest.mark.parametrize(
    "changes", [dict(sync_delay=2), dict(sync_fragments=2), dict(sync_dtype=("int8",))]
)
def test_sync_options_are_accepted_with_shards_and_by_fault_tolerant_replicas(changes):
    expected = (changes.get("sync_delay", 0), changes.get("sync_fragments", 1))
    config = resolve(TrainConfig.of(shards=2, batch_size=4, **changes))
    assert (config.sync.sync_delay, config.sync.sync_fragments) == expected
    ft = TrainConfig.of(shards=2, batch_size=4, workers=2, fault_tolerant=True, **changes)
    ft = resolve(ft.replace(replica_id=0, lighthouse="localhost:29510"))
    assert (ft.sync.sync_delay, ft.sync.sync_fragments) == expected
