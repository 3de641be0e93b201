"""Saving and restoring a run of sharded workers (``--shards`` > 1) through DCP checkpoints.

What the run carries is :class:`~mtdao.train.checkpoint.run_state.RunState`'s; its sharded form puts what is
sharded (parameters, optimizer states, the engine's anchors, outer momentum, rounds in flight and
residuals) in DCP, under each worker's key and the tensors' names, and what belongs to a worker
(its data position, the RNG, the engine's step and record of rounds, clocks, evaluations) in one
file per worker. See :mod:`mtdao.train.checkpoint.dcp` for the layout and what may change between
save and load. The store only reads files, so it chooses the checkpoint before the run is built
(as the unsharded one does); the sharded tensors are read into the built run by :func:`restore`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mtdao.train.checkpoint import store as ckpt
from mtdao.train.checkpoint.agreement import ProcessGroupCollective
from mtdao.train.checkpoint.dcp import MODEL_DIR, ShardedCheckpointStore, load_sharded
from mtdao.train.checkpoint.dcp_metadata import read_metadata
from mtdao.train.checkpoint.fit import sharded_tensors_unfit, worker_file_unfit
from mtdao.train.checkpoint.run_state import RunState
from mtdao.train.config import TrainConfig
from mtdao.train.distributed import ProcessInfo
from mtdao.train.setup import Run
from mtdao.train.sharding import launched_workers


def checkpoint_store(
    config: TrainConfig, process: ProcessInfo, device: torch.device, keep: int = 2
) -> ShardedCheckpointStore:
    """The store of a sharded run's checkpoints, on every process (they agree over the default
    process group; on NCCL through ``device``)."""
    return ShardedCheckpointStore(
        Path(config.out),
        rank=process.rank,
        workers=launched_workers(config),  # a fault-tolerant replica: its own run directory
        shards=config.shards,
        keep=keep,
        collective=ProcessGroupCollective(device=device if device.type == "cuda" else None),
    )


def save(run: Run, store: ShardedCheckpointStore) -> Path | None:
    """Checkpoint the run (every process together); returns the directory on process 0."""
    state = RunState(run).sharded_state_dict()
    return store.save(run.step, state, {"config": run.config.to_dict()})


def unfit(run: Run, loaded: ckpt.LoadedCheckpoint) -> str | None:
    """Why ``loaded`` cannot be restored into the built run: its worker file lacks a part of
    the worker's state, or its DCP metadata a tensor of the model (or shapes it otherwise)."""
    problem = worker_file_unfit(run, loaded.state.get("worker"))
    if problem:
        return problem
    try:
        metadata = read_metadata(loaded.path / MODEL_DIR / ".metadata")
    except (OSError, ValueError) as error:
        return str(error)
    return sharded_tensors_unfit(RunState(run).sharded_layout(), metadata)


@torch.no_grad()
def restore(run: Run, loaded: ckpt.LoadedCheckpoint) -> None:
    """Put the built run in the state of ``loaded``, its sharded tensors resharded to this run's
    shards (every process together)."""
    state, worker = RunState(run), loaded.state["worker"]
    sharded = state.sharded_layout(worker["sync"])
    load_sharded(loaded.path, sharded)
    state.load_sharded_state_dict(sharded, worker)
