"""A run's checkpoint in DCP (sharded workers, ``--shards`` > 1): :class:`~.run_state.RunState`'s
sharded form, layout in :mod:`.dcp`. The store chooses the checkpoint from its files before the
run is built; :meth:`DcpFormat.restore` reads the tensors into the built run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mtdao.train.checkpoint.agreement import ProcessGroupCollective
from mtdao.train.checkpoint.dcp import MODEL_DIR, ShardedCheckpointStore, load_sharded
from mtdao.train.checkpoint.dcp_metadata import read_metadata
from mtdao.train.checkpoint.fit import sharded_tensors_unfit, worker_file_unfit
from mtdao.train.checkpoint.run_state import RunState
from mtdao.train.checkpoint.store import LoadedCheckpoint
from mtdao.train.config import TrainConfig
from mtdao.train.distributed import ProcessInfo
from mtdao.train.setup import Run
from mtdao.train.sharding import launched_workers


class DcpFormat:
    """Sharded workers' checkpoints: DCP tensors and one plain file per worker."""

    def __init__(self, config: TrainConfig, process: ProcessInfo, device: torch.device) -> None:
        # every process agrees over the default process group (on NCCL through ``device``)
        self.store = ShardedCheckpointStore(
            Path(config.job.out),
            rank=process.rank,
            workers=launched_workers(config),  # a fault-tolerant replica: its own run directory
            shards=config.parallel.shards,
            keep=config.checkpoint.keep_checkpoints,
            collective=ProcessGroupCollective(device=device if device.type == "cuda" else None),
        )

    def state(self, run: Run) -> dict[str, Any]:
        return RunState(run).sharded_state_dict()

    def unfit(self, run: Run, loaded: LoadedCheckpoint) -> str | None:
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

    def restore(self, run: Run, loaded: LoadedCheckpoint) -> None:
        """The sharded tensors resharded to this run's shards (every process together)."""
        state, worker = RunState(run), loaded.state["worker"]
        sharded = state.sharded_layout(worker["sync"])
        load_sharded(loaded.path, sharded)
        state.load_sharded_state_dict(sharded, worker)
