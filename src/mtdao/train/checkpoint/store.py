"""Checkpoints of a run: the newest few kept, each either complete or invisible, every file checked.

Layout inside the run directory::

    checkpoints/
        step-00000120/           a complete checkpoint (it only ever appears by one rename)
            meta.json            step, world size, save sequence, every file's size and checksum,
                                 the run's config (human-readable)
            rank0.pt ...         one file per process: its workers' whole run state
        step-00000240.partial/   being written, or left by a crash (the next save removes it)
        step-00000060.damaged/   failed its check on a load: kept for inspection, never loaded

What a save and a load guarantee: docs/training.md ("Checkpoints and resuming"). Loads go newest
first by save sequence, so a run resumed from an older checkpoint overtakes a damaged newer one."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mtdao.state_files import first_unsavable, read_state_file
from mtdao.train.checkpoint.agreement import BarrierOnly, Collective, SingleProcess
from mtdao.train.checkpoint.index import (
    CHECKPOINTS_DIR,
    FORMAT,
    CheckpointError,
    CheckpointInfo,
    checkpoint_path,
    has_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_meta,
    scan_checkpoints,
    verify_files,
)
from mtdao.train.durable import (
    CHECKSUM,
    fsync_directory,
    write_atomic,
    write_json_atomic,
)

logger = logging.getLogger(__name__)

# The runs whose checkpoints each backend writes ("backend" in meta.json; absent: "torch").
BACKEND_RUNS = {
    "torch": "unsharded workers (--shards 1)",
    "dcp": "sharded workers (--shards > 1, torch.distributed.checkpoint)",
}
_LEFTOVER_SUFFIXES = (".partial", ".trash", ".tmp")


class UnsavableStateError(CheckpointError):
    """The state holds NaN/inf or an unreadable object; nothing was written."""


class CheckpointWriteError(CheckpointError):
    """Writing failed (full disk, permissions, another process failed); the message is one line
    and the checkpoints saved before are intact."""


@dataclass
class LoadedCheckpoint:
    path: Path
    meta: dict[str, Any]
    state: Any
    skipped: list[str]
    """'path: reason' for every newer checkpoint that was damaged and passed over."""

    @property
    def step(self) -> int:
        return int(self.meta["step"])


# -- the store -------------------------------------------------------------------------------------


class CheckpointStore:
    """Save and load the checkpoints of one run directory, from every process of the run.

    collective: how processes agree (every process calls ``save``/``load`` together). None: a
    single process; with several, ``load`` then has each process check every rank's checksums
    itself, and ``save`` is refused (it cannot fail on all processes at once without one).
    """

    backend = "torch"
    """How the files are written: one ``torch.save`` per process (see BACKEND_RUNS)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        rank: int = 0,
        world_size: int = 1,
        keep: int = 2,
        collective: Collective | None = None,
    ) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive integer, got {keep!r}")
        self.run_dir, self.root = Path(run_dir), Path(run_dir) / CHECKPOINTS_DIR
        self.rank, self.world_size, self.keep = rank, world_size, keep
        self._check_every_rank = collective is None and world_size > 1
        self.collective = collective or SingleProcess()

    # -- saving --------------------------------------------------------------------------------

    def save(
        self, step: int, state: Any, meta: dict[str, Any] | None = None, check_finite: bool = True
    ) -> Path | None:
        """Write this process's ``state``; returns the committed directory on process 0.

        Raises UnsavableStateError (nothing written) or CheckpointWriteError (nothing left behind)
        on every process when any process fails.
        """
        if self._check_every_rank:
            raise ValueError("saving from several processes needs a collective to agree through")
        problem = first_unsavable(state, finite=check_finite)
        if not self.collective.all_true(problem is None):
            raise UnsavableStateError(self._refusal(step, problem))
        # recorded, so that a refusal can name the last finite checkpoint
        finite = check_finite or self.collective.all_true(first_unsavable(state) is None)
        staging = self.root / f"step-{step:08d}.partial"
        error = self._attempt(step, self._prepare, staging) if self.rank == 0 else None
        self._agree_or_raise(error, f"process 0 could not create {staging}", step)
        files, error = {}, None
        try:
            files = self._write_rank_file(staging, state)
            if self.rank != 0:  # for process 0 to collect into meta.json (durable only there)
                write_json_atomic(staging / f"rank{self.rank}.files.json", files, sync=False)
        except OSError as failure:
            error = self._write_error(step, failure)
        if not self.collective.all_true(error is None):
            if self.rank == 0:
                _remove_tree(staging)
            raise error or self._write_error(step, f"another process could not write to {staging}")
        final = None
        if self.rank == 0:
            try:
                final = self._commit(staging, step, {**(meta or {}), "finite": finite}, files)
            except (OSError, CheckpointError) as failure:
                _remove_tree(staging)
                error = self._write_error(step, failure)
        self._agree_or_raise(error, f"process 0 could not commit {staging}", step)
        if final is not None:
            self._prune()
        return final

    def _refusal(self, step: int, problem: str | None) -> str:
        finite = [info for info in list_checkpoints(self.run_dir) if info.meta.get("finite")]
        last = (
            f"the last finite checkpoint is {finite[0].path} (step {finite[0].step})"
            if finite
            else "there is no finite checkpoint on disk"
        )
        what = problem or "another process's state holds NaN/inf or an unreadable object"
        return f"checkpoint at step {step} refused, nothing written: {what}; {last}"

    def _attempt(self, step: int, action, *args) -> CheckpointError | None:
        try:
            action(*args)
        except CheckpointError as error:
            return error
        except OSError as error:
            return self._write_error(step, error)
        return None

    def _agree_or_raise(self, error: CheckpointError | None, elsewhere: str, step: int) -> None:
        if not self.collective.all_true(error is None):
            raise error or self._write_error(step, elsewhere)

    @staticmethod
    def _write_error(step: int, cause: object) -> CheckpointWriteError:
        return CheckpointWriteError(
            f"checkpoint at step {step} not written: {cause}; earlier checkpoints are intact"
        )

    def _prepare(self, staging: Path) -> None:
        """Process 0: a fresh staging directory; leftovers of crashed saves removed."""
        if not self.root.is_dir():
            self.root.mkdir(parents=True, exist_ok=True)
            fsync_directory(self.run_dir)
        for leftover in self.root.iterdir():
            if leftover.name.endswith(_LEFTOVER_SUFFIXES):
                _remove_tree(leftover)
        staging.mkdir()

    def _write_rank_file(self, staging: Path, state: Any) -> dict[str, Any]:
        """This process's files in ``staging``: {file name: size and checksum}."""
        name = f"rank{self.rank}.pt"
        return {name: write_checksummed(staging / name, state)}

    def _collect_files(self, staging: Path, files: dict) -> dict[str, dict]:
        """Process 0: {file name: size and checksum} of every process's files in ``staging``."""
        files = dict(files)
        for rank in range(1, self.world_size):
            sidecar = staging / f"rank{rank}.files.json"
            if not sidecar.is_file():
                raise CheckpointError(f"process {rank} wrote no file in {staging}")
            files.update(json.loads(sidecar.read_text()))
            sidecar.unlink()
        return files

    def _commit(self, staging: Path, step: int, meta: dict, files: dict) -> Path:
        files = self._collect_files(staging, files)
        found = list_checkpoints(self.run_dir)
        meta.update(
            format=FORMAT,
            step=step,
            sequence=max((info.sequence for info in found), default=0) + 1,
            world_size=self.world_size,
            saved_at=time.time(),
            files=files,
        )
        write_json_atomic(staging / "meta.json", meta)
        fsync_directory(staging)
        final = _free_name(self.root / f"step-{step:08d}")
        os.rename(staging, final)  # the commit
        try:
            fsync_directory(self.root)
        except OSError as error:
            logger.warning("checkpoint %s saved, but not yet durable: %s", final, error)
        return final

    def _prune(self) -> None:
        """Delete the checkpoints beyond the newest ``keep``."""
        for info in list_checkpoints(self.run_dir)[self.keep :]:
            trash = info.path.with_name(f"{info.path.name}.trash")
            try:
                os.rename(info.path, trash)  # invisible at once; a crash mid-delete leaves trash
                shutil.rmtree(trash)
            except OSError as error:
                logger.warning("could not delete old checkpoint %s: %s", info.path, error)

    # -- loading -------------------------------------------------------------------------------

    def load(self) -> LoadedCheckpoint | None:
        """The newest checkpoint that verifies and loads on every process; None if there is none.

        Raises CheckpointError when it was written by another number of processes, or when
        checkpoints exist but none is usable.
        """
        found, unreadable = scan_checkpoints(self.run_dir)
        skipped = [f"{path}: {why}" for path, why in unreadable]
        for line in skipped:
            logger.warning("skipping damaged checkpoint %s", line)
        for path, _ in unreadable:
            self._set_aside(path)
        if not found and not skipped:
            return None
        problem = self._incompatibility(found[0]) if found else None
        if problem:
            raise CheckpointError(problem)
        for info in found:
            state, problem = self._try_load(info)
            if self.collective.all_true(problem is None):
                return LoadedCheckpoint(info.path, info.meta, state, skipped)
            problem = problem or "a file of another process failed its check"
            logger.warning("skipping damaged checkpoint %s: %s", info.path, problem)
            skipped.append(f"{info.path}: {problem}")
            self._set_aside(info.path)
        raise CheckpointError(f"no usable checkpoint in {self.run_dir}: " + "; ".join(skipped))

    def _incompatibility(self, info: CheckpointInfo) -> str | None:
        """Why this run cannot load ``info`` whatever its files hold; None if it can."""
        backend = info.meta.get("backend", "torch")
        if backend != self.backend:
            return (
                f"checkpoint {info.path} was written by {BACKEND_RUNS.get(backend, backend)}, this "
                f"run has {BACKEND_RUNS[self.backend]}"
            )
        if info.world_size != self.world_size:
            return (
                f"checkpoint {info.path} was written by {info.world_size} process(es), "
                f"this run has {self.world_size}"
            )
        return None

    def set_aside(self, path: Path) -> None:
        """Set a checkpoint aside as damaged (see ``_set_aside``), every process together."""
        self.collective.all_true(True)  # every process is done with it
        self._set_aside(path)

    def _set_aside(self, path: Path) -> None:
        """Process 0 renames a damaged checkpoint to ``step-N.damaged``: kept for inspection,
        never loaded, counted among the kept ones or overtaken in sequence again. Every process
        is done with it (the agreement on it has returned, or each decided alone)."""
        if self.rank != 0 or path.parent != self.root:
            return
        try:
            os.rename(path, _free_name(path.with_name(f"{path.name}.damaged")))
        except OSError as error:
            logger.warning("could not set damaged checkpoint %s aside: %s", path, error)

    def _try_load(self, info: CheckpointInfo) -> tuple[Any, str | None]:
        if info.world_size != self.world_size:
            return None, f"written by {info.world_size} process(es)"
        name = f"rank{self.rank}.pt"
        problem = verify_files(info, None if self._check_every_rank else [name])
        if problem:
            return None, problem
        try:
            return read_state_file(info.path / name), None
        except (OSError, ValueError) as error:
            problem = f"{info.path / name} is corrupted or incomplete: {error}"
            if self._check_every_rank:  # the others may have loaded it: no agreed fallback
                raise CheckpointError(problem) from None
            return None, problem


def write_checksummed(path: Path, state: Any) -> dict[str, Any]:
    """``torch.save`` into ``path`` atomically; returns its size and checksum."""
    size, checksum = write_atomic(path, lambda f: torch.save(state, f), CHECKSUM)
    return {"bytes": size, CHECKSUM: checksum}


def _free_name(path: Path) -> Path:
    """``path``, or ``path.1``, ``path.2``, ... whichever does not exist yet."""
    candidate, number = path, 0
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.name}.{number}")
    return candidate


def _remove_tree(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass
    except OSError as error:
        logger.warning("could not remove %s: %s", path, error)


# -- the functions the training harness calls ----------------------------------------------------


def save_checkpoint(
    run_dir: Path,
    rank: int,
    world_size: int,
    state: dict[str, Any],
    meta: dict[str, Any],
    barrier=lambda: None,
    keep: int = 2,
) -> Path | None:
    """Write this rank's ``state``; rank 0 also writes ``meta`` and commits (see CheckpointStore)."""
    store = CheckpointStore(
        run_dir, rank=rank, world_size=world_size, keep=keep, collective=BarrierOnly(barrier)
    )
    return store.save(int(meta.get("step", state.get("step", 0))), state, meta)


def load_checkpoint(run_dir: Path, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's state from the newest checkpoint that verifies (older ones as fallback)."""
    loaded = CheckpointStore(run_dir, rank=rank, world_size=world_size).load()
    if loaded is None:
        raise CheckpointError(f"no checkpoint to resume from: {run_dir} holds no complete one")
    return loaded.state


__all__ = [
    "CHECKPOINTS_DIR",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointStore",
    "CheckpointWriteError",
    "LoadedCheckpoint",
    "UnsavableStateError",
    "checkpoint_path",
    "has_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_meta",
    "save_checkpoint",
    "verify_files",
]
