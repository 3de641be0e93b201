"""A run's checkpoint as plain files: :class:`~.run_state.RunState`, one ``torch.save`` per process
(unsharded workers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mtdao.train.checkpoint import fit as checkpoint_fit
from mtdao.train.checkpoint.agreement import ProcessGroupCollective
from mtdao.train.checkpoint.run_state import RunState
from mtdao.train.checkpoint.store import CheckpointStore, LoadedCheckpoint
from mtdao.train.config import TrainConfig
from mtdao.train.distributed import ProcessInfo
from mtdao.train.setup import Run


class PlainFormat:
    """Unsharded workers' checkpoints: :meth:`RunState.state_dict`, one file per process."""

    def __init__(self, config: TrainConfig, process: ProcessInfo, device: torch.device) -> None:
        collective = None
        if process.distributed:  # the processes agree through the process group
            collective = ProcessGroupCollective(device=device if device.type == "cuda" else None)
        self.store = CheckpointStore(
            Path(config.job.out),
            rank=process.rank,
            world_size=process.world_size,
            keep=config.checkpoint.keep_checkpoints,
            collective=collective,
        )

    def state(self, run: Run) -> dict[str, Any]:
        return RunState(run).state_dict()

    def unfit(self, run: Run, loaded: LoadedCheckpoint) -> str | None:
        """Why ``loaded`` (its files verified and read) cannot be restored into the built
        ``run``: edited or forged, or not this model's; None if it fits (see fit.py)."""
        return checkpoint_fit.unfit(run, loaded.state)

    def restore(self, run: Run, loaded: LoadedCheckpoint) -> None:
        RunState(run).load_state_dict(loaded.state)
