"""Checkpoints: everything needed to continue a run exactly, written atomically.

Layout inside the run directory::

    checkpoint/
        meta.json       step, world size, config (human-readable)
        rank0.pt ...    one file per process: its workers' parameters, optimizer and sync state,
                        data positions, RNG state

A checkpoint is first written to a temporary directory and renamed into place, so a crash while
writing leaves the previous checkpoint intact. Files are loaded with ``weights_only=True``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_DIR = "checkpoint"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or belongs to a different run."""


def checkpoint_path(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def save_checkpoint(
    run_dir: Path,
    rank: int,
    world_size: int,
    state: dict[str, Any],
    meta: dict[str, Any],
    barrier=lambda: None,
) -> Path:
    """Write this rank's ``state``; rank 0 also writes ``meta`` and swaps the directory in."""
    final = checkpoint_path(run_dir)
    staging = final.with_name(f"{CHECKPOINT_DIR}.partial")
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier()
    _atomic_torch_save(state, staging / f"rank{rank}.pt")
    barrier()
    if rank == 0:
        (staging / "meta.json").write_text(json.dumps({**meta, "world_size": world_size}, indent=2))
        previous = final.with_name(f"{CHECKPOINT_DIR}.previous")
        shutil.rmtree(previous, ignore_errors=True)
        if final.exists():
            os.replace(final, previous)
        os.replace(staging, final)
        shutil.rmtree(previous, ignore_errors=True)
    barrier()
    return final


def _atomic_torch_save(obj: Any, path: Path) -> None:
    partial = path.with_suffix(".tmp")
    with open(partial, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)


def load_meta(run_dir: Path) -> dict[str, Any]:
    path = checkpoint_path(run_dir) / "meta.json"
    if not path.is_file():
        raise CheckpointError(f"no checkpoint to resume from: {path} does not exist")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"checkpoint metadata {path} is unreadable: {error}") from None


def load_checkpoint(run_dir: Path, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's saved state; refuses a checkpoint written with another world size."""
    meta = load_meta(run_dir)
    if meta.get("world_size") != world_size:
        raise CheckpointError(
            f"checkpoint in {run_dir} was written by {meta.get('world_size')} process(es), "
            f"this run has {world_size}"
        )
    path = checkpoint_path(run_dir) / f"rank{rank}.pt"
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many types for truncated/corrupted files
        raise CheckpointError(
            f"checkpoint file {path} is corrupted or incomplete ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else 'no detail'})"
        ) from None


def has_checkpoint(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a checkpoint (complete or not)."""
    return checkpoint_path(run_dir).exists()
