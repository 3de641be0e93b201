"""Saving a whole run to a checkpoint and restoring it exactly (``--resume``).

A checkpoint holds, per process, the run's state as :class:`~mtdao.train.checkpoint.run_state.RunState`
defines it: the workers' parameters, the optimizer and sync-engine state (anchors, outer
momentum, traffic account, every round), the data positions, the RNG state, the clock, the
evaluations so far and the record of extensions. The store (:mod:`checkpoint`) writes it
atomically, keeps the newest ``--keep-checkpoints``, and refuses a state holding NaN/inf, so that
a diverged run never replaces its last good checkpoint. A run of sharded workers (``--shards`` >
1) writes DCP checkpoints instead: each function here hands it to :mod:`.sharded_snapshot`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mtdao.train.checkpoint import fit as checkpoint_fit
from mtdao.train.checkpoint import sharded_snapshot
from mtdao.train.checkpoint import store as ckpt
from mtdao.train.checkpoint.agreement import ProcessGroupCollective
from mtdao.train.checkpoint.run_state import RunState
from mtdao.train.config import TrainConfig, resolve
from mtdao.train.distributed import ProcessInfo
from mtdao.train.setup import Run


def checkpoint_store(config: TrainConfig, process: ProcessInfo, device: torch.device):
    """The store of a run's checkpoints, on every process (they agree through the process
    group: a failure on one process fails the save or load on all of them together)."""
    if config.shards > 1:  # DCP files, see sharded_snapshot.py
        return sharded_snapshot.checkpoint_store(config, process, device, config.keep_checkpoints)
    collective = None
    if process.distributed:
        collective = ProcessGroupCollective(device=device if device.type == "cuda" else None)
    return ckpt.CheckpointStore(
        Path(config.out),
        rank=process.rank,
        world_size=process.world_size,
        keep=config.keep_checkpoints,
        collective=collective,
    )


def save(run: Run, store: ckpt.CheckpointStore) -> Path | None:
    """Checkpoint the run (every process together); returns the directory on process 0.

    With ``--on-non-finite skip`` a worker left out of a round can hold NaN/inf until its next
    round; it is healed first (it takes the others' average of every tensor, counted as "heal"
    traffic), so the checkpoint is finite. A NaN/inf that remains is refused: the run stops with
    one line naming the step, the tensor and the last finite checkpoint, which stays on disk.
    """
    if run.config.on_non_finite == "skip":
        run.sync.heal_non_finite_workers()
    if run.config.shards > 1:
        return sharded_snapshot.save(run, store)
    return store.save(run.step, RunState(run).state_dict(), {"config": run.config.to_dict()})


def saved_config(meta: dict) -> TrainConfig:
    """The resolved config a checkpoint was written with (one written with unset fields, as
    older versions wrote them, resolves to today's defaults)."""
    try:
        return resolve(TrainConfig.from_dict(meta["config"]))
    except (KeyError, TypeError, ValueError) as error:
        raise ckpt.CheckpointError(
            f"--resume: the checkpoint's config is unusable: {error}"
        ) from None


def unfit(run: Run, loaded: ckpt.LoadedCheckpoint) -> str | None:
    """Why ``loaded`` (its files verified and read) cannot be restored into the built ``run``:
    edited or forged, or not this model's; None if it fits (see fit.py)."""
    if run.config.shards > 1:
        return sharded_snapshot.unfit(run, loaded)
    return checkpoint_fit.unfit(run, loaded.state)


@torch.no_grad()
def restore(run: Run, loaded: ckpt.LoadedCheckpoint) -> None:
    """Put the run back in the state of ``loaded`` (its config was checked when it was chosen)."""
    if run.config.shards > 1:
        return sharded_snapshot.restore(run, loaded)
    problem = unfit(run, loaded)
    if problem:  # the harness checked (and fell back); a caller that did not is refused here
        raise ckpt.CheckpointError(f"--resume: {loaded.path} does not fit this run: {problem}")
    RunState(run).load_state_dict(loaded.state)
