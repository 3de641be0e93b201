"""Everything a training run carries from one step to the next, defined once: its trained part
(:class:`~mtdao.sync.trained_state.TrainedState`, which a healing replica receives too) and its
progress (step, data positions, RNG, clock, evaluations, extensions). Both checkpoint formats save
and restore through this object, so what is saved and what is restored cannot drift apart."""

from __future__ import annotations

from typing import Any

import torch

from mtdao.sync.trained_state import TrainedState
from mtdao.train.setup import Run
from mtdao.train.sharding import worker_of


class RunState:
    """The state of ``run`` (a built run): its ``state_dict`` and sharded form, and their loads."""

    def __init__(self, run: Run) -> None:
        self.run = run
        module = getattr(run.workers, "model", None)  # a sharded worker's FSDP2 model
        self.trained = TrainedState(run.sync, run.workers.named_parameters(), module)

    # -- the progress part ---------------------------------------------------------------------

    def progress_state_dict(self) -> dict[str, Any]:
        """Where the run is: data positions, RNG, clock, evaluations and extensions."""
        run = self.run
        return {
            "shards": [shard.state_dict() for shard in run.shards],
            "torch_rng": torch.get_rng_state(),
            "clock": run.clock.state_dict(),
            "evals": run.evals,
            "extensions": run.extensions,
        }

    def load_progress_state_dict(self, state: dict[str, Any]) -> None:
        run = self.run
        for shard, saved in zip(run.shards, state["shards"], strict=True):
            shard.load_state_dict(saved)
        torch.set_rng_state(state["torch_rng"])
        run.clock.load_state_dict(state["clock"])
        run.evals = list(state["evals"])
        run.extensions = list(state["extensions"])

    # -- plain (one file per process) ----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The step, the trained part (params, optimizer, sync) and the progress part."""
        return {"step": self.run.step, **self.trained.state_dict(), **self.progress_state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (checked to fit the run: ``fit.unfit``)."""
        self.trained.load_state_dict(state)
        self.load_progress_state_dict(state)

    # -- sharded (DCP tensors, one plain file per worker) --------------------------------------

    @property
    def worker_key(self) -> str:
        """The key of this process's worker in the DCP state dict: under it each worker saves its
        own copy (DCP would otherwise take the workers for replicas of one tensor and keep one of
        them, while between syncs, and for states never averaged, their values differ)."""
        return f"worker{worker_of(self.run.process, self.run.config.parallel.shards)}"

    def sharded_state_dict(self) -> dict[str, Any]:
        """``{"sharded": DCP state dict, "worker": the worker file}``: the trained part's tensors
        as DTensors keyed by worker and tensor name (the same whatever the number of shards), the
        rest plain. A collective over the worker's shard group."""
        sharded, engine = self.trained.sharded_state_dict()
        return {"sharded": {self.worker_key: sharded}, "worker": self.worker_state_dict(engine)}

    def worker_state_dict(self, engine: dict[str, Any]) -> dict[str, Any]:
        """What the worker file holds: ``engine`` is the engine's plain part."""
        return {"step": self.run.step, "sync": engine, **self.progress_state_dict()}

    def sharded_layout(self, engine: dict[str, Any] | None = None) -> dict[str, Any]:
        """The DCP state dict to read into, laid out from the worker file's ``engine`` (without
        it: the tensors every such run holds, e.g. to check a checkpoint's shapes)."""
        return {self.worker_key: self.trained.sharded_layout(engine)}

    @torch.no_grad()
    def load_sharded_state_dict(self, sharded: dict[str, Any], worker: dict[str, Any]) -> None:
        """Restore from the tensors DCP read into :meth:`sharded_layout` (of ``worker["sync"]``)
        and the worker file ``worker``."""
        self.trained.load_sharded_state_dict(sharded[self.worker_key], worker["sync"])
        self.load_progress_state_dict(worker)
