"""The checkpoints of one run, in one format chosen when it starts: plain files for unsharded
workers (:mod:`.snapshot`), DCP for sharded ones (:mod:`.sharded_snapshot`). Which checkpoint a
resume starts from is :mod:`mtdao.train.startup`'s."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from mtdao.train.checkpoint.agreement import Collective
from mtdao.train.checkpoint.index import CheckpointError
from mtdao.train.checkpoint.sharded_snapshot import DcpFormat
from mtdao.train.checkpoint.snapshot import PlainFormat
from mtdao.train.checkpoint.store import CheckpointStore
from mtdao.train.config import TrainConfig
from mtdao.train.distributed import ProcessInfo
from mtdao.train.setup import Run
from mtdao.train.startup import Start, fall_back


class Checkpointer:
    """Save and restore a run in its format: DCP for sharded workers (``--shards`` > 1), plain
    files otherwise. Every process of the run calls every method together."""

    def __init__(self, config: TrainConfig, process: ProcessInfo, device: torch.device) -> None:
        self.format = (DcpFormat if config.parallel.shards > 1 else PlainFormat)(
            config, process, device
        )

    @property
    def store(self) -> CheckpointStore:
        """Where the checkpoints are, and which one a resume loads (see startup.py)."""
        return self.format.store

    @property
    def collective(self) -> Collective:
        return self.store.collective

    def save(self, run: Run) -> Path | None:
        """Checkpoint the run; returns the directory on process 0.

        With ``--on-non-finite skip`` a worker left out of a round can hold NaN/inf until its
        next round; it is healed first (it takes the others' average of every tensor, counted as
        "heal" traffic), so the checkpoint is finite. A NaN/inf that remains is refused: the run
        stops with one line naming the step, the tensor and the last finite checkpoint, which
        stays on disk.
        """
        if run.config.sync.on_non_finite == "skip":
            run.sync.rounds.heal_non_finite_workers()
        meta = {"config": run.config.to_dict()}
        return self.store.save(run.step, self.format.state(run), meta)

    @torch.no_grad()
    def restore(self, run: Run, start: Start) -> Start:
        """Put the built ``run`` in the state of ``start``'s checkpoint, if it has one. A
        checkpoint that verified may still not fit the run (edited, forged, another model's): it
        is set aside and the one before it taken, checked as the first was. Returns the start the
        run goes on from; its notes are those of the fallbacks."""
        loaded, notes = start.checkpoint, []
        while loaded is not None:
            problem = self.format.unfit(run, loaded)
            if self.collective.all_true(problem is None):
                try:
                    self.format.restore(run, loaded)
                except (KeyError, IndexError, TypeError, ValueError, AttributeError) as error:
                    # a part no check above reads (clock, evaluations, the engine's record):
                    # the run is half restored, so it stops here, in one line
                    why = (str(error).strip() or "?").splitlines()[0][:200]
                    raise CheckpointError(
                        f"--resume: {loaded.path} cannot be restored into this run "
                        f"({type(error).__name__}: {why}); rename it to "
                        f"{loaded.path.name}.damaged to resume from the one before it"
                    ) from None
                break
            start = fall_back(
                run.config, self.store, loaded, problem or "see another process's warning"
            )
            loaded, notes = start.checkpoint, [*notes, *start.notes]
        return dataclasses.replace(start, notes=notes)
