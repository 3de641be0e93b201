"""The part of a trainer's checkpoint that is each worker's own.

A trainer saves process 0's model and optimizer, which is the whole run only when every process
holds the same values (DDP). With local updates the workers differ between syncs, so each process
adds one file: the engine's state and, with more than one worker, its own parameters and
optimizer state. Resuming loads the trainer's files, then this one on top."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mtdao.integrations.local_updates import LocalRun
from mtdao.state_files import first_unsavable, read_state_file

FORMAT = 1


def worker_state_path(checkpoint_dir: str | Path, rank: int, world_size: int) -> Path:
    return Path(checkpoint_dir) / f"mtdao-rank{rank}-of-{world_size}.pt"


def save_worker_state(
    checkpoint_dir: str | Path, run: LocalRun, model: torch.nn.Module, rank: int, world_size: int
) -> Path:
    """Write this process's file into ``checkpoint_dir``; returns its path."""
    state: dict[str, Any] = {"format": FORMAT, "engine": run.sync.state_dict()}
    if world_size > 1:  # process 0's model and optimizer in the Trainer's files are not ours
        state["params"] = {name: p.detach().clone() for name, p in model.named_parameters()}
        state["optimizer"] = run.optimizer.state_dict()
    problem = first_unsavable(state, finite=False)
    if problem is not None:
        raise ValueError(f"cannot checkpoint the mtdao state: {problem}")
    path = worker_state_path(checkpoint_dir, rank, world_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(".tmp")
    torch.save(state, staging)
    staging.replace(path)
    return path


@torch.no_grad()
def load_worker_state(
    checkpoint_dir: str | Path, run: LocalRun, model: torch.nn.Module, rank: int, world_size: int
) -> None:
    """Restore what :func:`save_worker_state` wrote (after the Trainer loaded its own files)."""
    path = worker_state_path(checkpoint_dir, rank, world_size)
    if not path.is_file():
        found = sorted(p.name for p in Path(checkpoint_dir).glob("mtdao-rank*.pt"))
        raise FileNotFoundError(
            f"{path} is missing: resume with the world size the checkpoint was saved with "
            f"({', '.join(found) or 'it has no mtdao state: not saved by an mtdao integration'})"
        )
    try:
        state = read_state_file(path)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    if state.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown format {state.get('format')!r} (expected {FORMAT})")
    if "params" in state:
        named = dict(model.named_parameters())
        if set(named) != set(state["params"]):
            missing = sorted(set(named) ^ set(state["params"]))[:3]
            raise ValueError(f"{path}: saved for another model (parameters differ: {missing})")
        for name, saved in state["params"].items():
            named[name].copy_(saved)
        run.optimizer.load_state_dict(state["optimizer"])
    run.sync.load_state_dict(state["engine"])
