"""Opening the run directory: one run per directory, no run replaced by accident, and the
checkpoint a resumed run starts from (the rules: docs/training.md, "Checkpoints and resuming").

Every process calls these together, before the run is built, and the processes agree before going
on, so they all stop together with the same one-line error. Process 0 holds the directory's lock
for the whole job."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtdao.train.checkpoint import store as ckpt
from mtdao.train.checkpoint.agreement import Collective
from mtdao.train.checkpoint.index import set_aside_checkpoints
from mtdao.train.config import TrainConfig, resolve
from mtdao.train.distributed import ProcessInfo
from mtdao.train.durable import describe_os_error
from mtdao.train.run_lock import (
    LOCK_FILE,
    RunDirError,
    RunLock,
    check_run_dir,
    clear_run_files,
    holds_run,
    refuse_to_replace_a_run,
)
from mtdao.train.schedule import steps_change

logger = logging.getLogger(__name__)


@dataclass
class Start:
    """How a run starts: from scratch, or from a checkpoint (possibly re-planned)."""

    checkpoint: ckpt.LoadedCheckpoint | None = None
    notes: list[str] = field(default_factory=list)
    """Lines for the person at the terminal (what was decided, and why)."""
    extension: dict[str, Any] | None = None
    """The record of a re-planned length (``--extend``), kept with the run."""


def agree(collective: Collective, error: Exception | None, elsewhere: str) -> None:
    """Raise on every process when any failed (its own error, or one naming ``elsewhere``)."""
    if not collective.all_true(error is None):
        raise error or RunDirError(elsewhere)


def lock_run_dir(config: TrainConfig, process: ProcessInfo, collective: Collective) -> RunLock:
    """Process 0 takes the run directory's lock (a second run on it is refused, naming the
    holder's pid); returns the lock (held on process 0 only) once every process agrees."""
    run_dir, lock, error = Path(config.job.out), RunLock(Path(config.job.out)), None
    try:
        check_run_dir(run_dir)
        if process.rank == 0:
            lock.acquire()
    except RunDirError as refused:
        error = refused
    except OSError as failure:
        error = RunDirError(
            f"cannot use {run_dir} as the run directory: {describe_os_error(failure)}"
        )
    try:
        agree(collective, error, f"process 0 could not take the lock of {run_dir} (see its error)")
    except BaseException:
        lock.release()
        raise
    return lock


def choose_start(config: TrainConfig, process: ProcessInfo, store: ckpt.CheckpointStore) -> Start:
    """Decide how the run in ``config.out`` starts (the lock is held), by the rules of docs/training.md."""
    run_dir, collective = Path(config.job.out), store.collective
    if config.job.resume:
        loaded = store.load()
        if loaded is not None:
            return _resumed(config, loaded)
        error = None
        try:
            _check_fresh_resume(run_dir, config)
        except ValueError as refused:
            error = refused
        agree(collective, error, f"--resume: process 0 refused to start in {run_dir}")
        return Start(notes=[f"--resume: no checkpoint in {run_dir} yet; starting fresh"])
    error, removed = None, []
    try:
        if config.job.overwrite:
            if process.rank == 0:
                removed = clear_run_files(run_dir)
        else:
            refuse_to_replace_a_run(run_dir)
    except RunDirError as refused:
        error = refused
    except OSError as failure:
        error = RunDirError(f"--overwrite: cannot delete the run in {run_dir}: {failure}")
    agree(collective, error, f"process 0 refused to start a run in {run_dir} (see its error)")
    if removed:
        return Start(notes=[f"--overwrite: deleted {', '.join(removed)} from {run_dir}"])
    return Start()


def fall_back(
    config: TrainConfig, store: ckpt.CheckpointStore, loaded: ckpt.LoadedCheckpoint, problem: str
) -> Start:
    """``loaded`` verified and read, but does not fit the built run (``problem``: edited,
    forged, another model's): set it aside as damaged and start from the checkpoint before it,
    checked as the first was; with none left, stop in one line (every process together)."""
    logger.warning("skipping checkpoint %s: it does not fit this run: %s", loaded.path, problem)
    store.set_aside(loaded.path)
    earlier = store.load()
    if earlier is None:
        raise ckpt.CheckpointError(
            f"--resume: no usable checkpoint in {config.job.out}: {loaded.path} does not fit this "
            f"run ({problem}); it was set aside"
        )
    return _resumed(config, earlier)


def saved_config(meta: dict) -> TrainConfig:
    """The resolved config a checkpoint was written with."""
    try:
        return resolve(TrainConfig.from_dict(meta["config"]))
    except (KeyError, TypeError, ValueError) as error:
        raise ckpt.CheckpointError(
            f"--resume: the checkpoint's config is unusable: {error}"
        ) from None


def _check_fresh_resume(run_dir: Path, config: TrainConfig) -> None:
    """A fresh start under --resume may replace a run's files only when they are this run's
    (a first attempt that died before its first checkpoint), and never a run's progress."""
    damaged = set_aside_checkpoints(run_dir)
    if damaged:
        names = ", ".join(str(path.relative_to(run_dir)) for path in damaged)
        raise RunDirError(
            f"--resume: every checkpoint of the run in {run_dir} was found damaged and set "
            f"aside ({names}); nothing to resume from, and the run's progress is not thrown "
            "away: inspect them, or run with --overwrite instead of --resume to start over"
        )
    if (run_dir / "results.json").is_file():
        raise RunDirError(
            f"--resume: {run_dir} holds a finished run (results.json) but no checkpoint to "
            "resume from; run with --overwrite instead of --resume to start over, or choose another --out"
        )
    path = run_dir / "config.json"
    if not path.is_file():
        _refuse_others_files(run_dir)
        return
    try:
        differences = resolve(TrainConfig.from_dict(json.loads(path.read_text()))).differences(
            config
        )
    except (OSError, ValueError, TypeError) as error:
        differences = [f"unreadable: {error}"]
    if differences:
        raise RunDirError(
            f"--resume: {run_dir} has no checkpoint yet, and its config.json is another run's "
            f"({'; '.join(differences)}); pass --overwrite to replace it, or choose another --out"
        )


def _refuse_others_files(run_dir: Path) -> None:
    """A first start under --resume trains in a new or empty directory, or beside what a first
    attempt wrote: never among files that are not a run's (a mistyped --out)."""
    if holds_run(run_dir) or not run_dir.is_dir():
        return
    others = sorted(entry.name for entry in run_dir.iterdir() if entry.name != LOCK_FILE)
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise RunDirError(
            f"--resume: {run_dir} holds no run to resume, but other files ({shown}); a run is "
            "not started among them: give --out a new or empty directory"
        )


def _resumed(config: TrainConfig, loaded: ckpt.LoadedCheckpoint) -> Start:
    """Check that ``loaded`` can continue as ``config`` asks; refuse in one line if not."""
    run_dir, step = Path(config.job.out), loaded.step
    saved = saved_config(loaded.meta)
    differences = saved.differences(config)
    if differences:
        raise ckpt.CheckpointError(
            f"--resume: the config differs from the run in {run_dir}: " + "; ".join(differences)
        )
    new_steps, old_steps = config.total_steps(), saved.total_steps()
    if step > new_steps:
        raise ckpt.CheckpointError(
            f"--resume: the checkpoint is at step {step}, past --steps {new_steps}"
        )
    if new_steps == old_steps:
        return Start(checkpoint=loaded)
    change = steps_change(saved, config, step)
    if not config.job.extend:
        raise ValueError(
            f"--resume: --steps {new_steps} differs from the run's {old_steps} (checkpoint at "
            f"step {step}). Keep --steps {old_steps} to continue it exactly, or pass --extend to "
            f"re-plan it: {change.consequence()}"
        )
    note = f"--extend: re-planned from {old_steps} to {new_steps} steps at step {step}: "
    note += change.consequence()
    record = {
        "step": step,
        "from_steps": old_steps,
        "to_steps": new_steps,
        "exact": change.exact,
        "lr_planned": change.lr_planned,
        "lr_new": change.lr_new,
    }
    return Start(checkpoint=loaded, notes=[note], extension=record)
