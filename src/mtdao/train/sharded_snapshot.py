"""Saving and restoring a run of sharded workers (``--shards`` > 1) through DCP checkpoints.

What is sharded (parameters, optimizer states, the engine's anchors and outer momentum) goes to
DCP, under each worker's key and the parameter names; what belongs to a worker (its data position,
the RNG, the engine's step and record of rounds, clocks, evaluations) goes to one file per worker.
See :mod:`mtdao.train.checkpoint_dcp` for the layout and what may change between save and load.
The store only reads files, so it chooses the checkpoint before the run is built (as the
unsharded one does); the sharded tensors are read into the built run by :func:`restore`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from mtdao.sync.dtensors import shard_like
from mtdao.train import checkpoint as ckpt
from mtdao.train import sharded_rounds
from mtdao.train.checkpoint_dcp import ShardedCheckpointStore, load_sharded
from mtdao.train.checkpoint_state import ProcessGroupCollective
from mtdao.train.config import TrainConfig
from mtdao.train.distributed import ProcessInfo
from mtdao.train.setup import Run
from mtdao.train.sharding import launched_workers, process_share, worker_of

# The engine's state that is sharded like the parameters; the rest of it belongs to the worker.
ENGINE_SHARDED_KEYS = ("anchors", "outer")


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


def sharded_state(run: Run) -> dict[str, Any]:
    """The DCP state dict of this process's worker: model, optimizer and the engine's global
    tensors, DTensors keyed by worker and parameter name (the same whatever the number of
    shards). Under its own key each worker saves its own copy: DCP would otherwise take the
    workers for replicas of one tensor and keep one of them, while between syncs (and for states
    that are never averaged) their values differ."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = run.workers.model
    model_state, optimizer_state = get_state_dict(model, run.optimizer)
    params, sync = run.sync.params, run.sync
    names = [sync.param_names[id(p)] for p in params]
    engine: dict[str, Any] = {
        "anchors": {n: shard_like(p, a) for n, p, a in zip(names, params, sync.anchors)},
    }
    if sync.outer is not None:
        buffers = sync.outer.momentum_buffers
        engine["outer_momentum"] = {n: shard_like(p, b) for n, p, b in zip(names, params, buffers)}
    worker = worker_of(run.process, run.config.shards)
    return {
        f"worker{worker}": {"model": model_state, "optimizer": optimizer_state, "engine": engine}
    }


def worker_state(run: Run, engine: dict[str, Any]) -> dict[str, Any]:
    """What the worker file holds: ``engine`` is the engine's state without its sharded part."""
    return {
        "step": run.step,
        "sync": engine,
        "shards": [shard.state_dict() for shard in run.shards],
        "torch_rng": torch.get_rng_state(),
        "clock": run.clock.state_dict(),
        "evals": run.evals,
        "extensions": run.extensions,
    }


def save(run: Run, store: ShardedCheckpointStore) -> Path | None:
    """Checkpoint the run (every process together); returns the directory on process 0."""
    engine = run.sync.state_dict()
    for key in ENGINE_SHARDED_KEYS:
        engine.pop(key)
    sharded = sharded_state(run)
    worker_key = f"worker{worker_of(run.process, run.config.shards)}"
    sharded[worker_key]["engine"].update(sharded_rounds.split(run.sync, engine))
    engine["traffic"]["process_bytes"] = sharded_rounds.gather_process_bytes(run.sync)
    state = {"sharded": sharded, "worker": worker_state(run, engine)}
    return store.save(run.step, state, {"config": run.config.to_dict()})


def unfit(run: Run, loaded: ckpt.LoadedCheckpoint) -> str | None:
    """Why ``loaded`` cannot be restored into the built run: its worker file lacks a part of
    the worker's state, or its DCP metadata a tensor of the model (or shapes it otherwise)."""
    from mtdao.train.checkpoint_dcp import MODEL_DIR
    from mtdao.train.checkpoint_fit import sharded_tensors_unfit, worker_file_unfit
    from mtdao.train.dcp_metadata import read_metadata

    problem = worker_file_unfit(run, loaded.state.get("worker"))
    if problem:
        return problem
    try:
        metadata = read_metadata(loaded.path / MODEL_DIR / ".metadata")
    except (OSError, ValueError) as error:
        return str(error)
    return sharded_tensors_unfit(sharded_state(run), metadata)


@torch.no_grad()
def restore(run: Run, loaded: ckpt.LoadedCheckpoint) -> None:
    """Put the built run in the state of ``loaded``, its sharded tensors resharded to this run's
    shards (every process together)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from mtdao.train.snapshot import restore_progress

    worker = loaded.state["worker"]
    engine = copy.deepcopy(worker["sync"])
    everything = sharded_state(run)  # (before the rounds: it makes the optimizer's states)
    sharded = everything[f"worker{worker_of(run.process, run.config.shards)}"]
    sharded["engine"].update(sharded_rounds.layout(run.sync, engine))
    load_sharded(loaded.path, everything)
    set_state_dict(
        run.workers.model,
        run.optimizer,
        model_state_dict=sharded["model"],
        optim_state_dict=sharded["optimizer"],
    )
    sharded_rounds.join(run.sync, engine, sharded["engine"])
    traffic, share = engine["traffic"], process_share(run.sync.params)
    traffic["process_bytes"] = sharded_rounds.process_bytes_of(
        traffic.get("process_bytes"), traffic["bytes"], run.sync.layout, share
    )
    names = [run.sync.param_names[id(p)] for p in run.sync.params]
    engine["anchors"] = [sharded["engine"]["anchors"][n].to_local() for n in names]
    engine["outer"] = None
    if run.sync.outer is not None:
        momentum = sharded["engine"]["outer_momentum"]
        engine["outer"] = {"momentum_buffers": [momentum[n].to_local() for n in names]}
    run.sync.load_state_dict(engine)
    restore_progress(run, worker)
