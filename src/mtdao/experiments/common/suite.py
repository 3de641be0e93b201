"""Run a list of named training configs, each in its own directory, and collect their results.

A suite is data: ``[(name, TrainConfig), ...]``. Each run lives in ``<out>/runs/<name>``; a run
whose ``results.json`` exists is not trained again, so rerunning the same command after an
interruption (or with more seeds) trains only what is missing. A run directory without results
is resumed from its checkpoint when it holds one for the same config, otherwise wiped and
restarted. Before training, the suite says how many runs, steps and evaluations are coming.

``jobs == 1`` trains in this process, one run after another. ``jobs > 1`` launches that many
``python -m mtdao train ...`` subprocesses at a time, each with ``max(1, cores // jobs)`` threads;
:func:`mtdao.train.command.config_to_argv` turns a config into their command-line flags.
The shared flags of the experiment commands are in :mod:`.study_flags`.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtdao.train.command import config_to_argv
from mtdao.train.config import (
    WARMUP_FIELDS,
    TrainConfig,
    resolve,
)
from mtdao.train.run_lock import RunLock, RunLockedError
from mtdao.train.schedule import warmup_steps_of
from mtdao.train.threads import available_cores
from mtdao.units import format_bytes

RUNS_DIR = "runs"
RESULTS_FILE = "results.json"
LOG_FILE = "train.log"

# TrainConfig fields that do not change what a run computes: a finished run with other values
# of these is still the same run.
# how a run was kept, not what it trained: a run started with --overwrite is the same experiment
BOOKKEEPING_FIELDS = frozenset(
    {"out", "resume", "overwrite", "progress", "log_every", "checkpoint_every", "keep_checkpoints"}
)

# -- one run --------------------------------------------------------------------------------------


@dataclass
class SuiteResult:
    """Results of the runs that finished (by name) and the error of each run that did not."""

    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)


def run_dir_of(out: Path, name: str) -> Path:
    return Path(out) / RUNS_DIR / name


def load_results(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / RESULTS_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # a torn write: train again


def _computed_settings(config: TrainConfig) -> dict[str, Any]:
    """The resolved settings a run's result depends on; the LR warm-up as its number of steps,
    however it was given (a 3000-step run at 5% is one at the default's 150)."""
    resolved = resolve(config)
    settings = {
        k: v for k, v in resolved.to_dict().items() if k not in BOOKKEEPING_FIELDS | WARMUP_FIELDS
    }
    return {**settings, "warmup_steps": warmup_steps_of(resolved)}


def stale_settings(results: dict[str, Any], config: TrainConfig) -> list[str]:
    """How a finished run's config differs from ``config`` ('field: old -> new'); [] if it matches.

    Both sides are compared resolved, so a config saved with unset (null) fields, as older
    versions saved it, matches the same config resolved today; one that no longer resolves is
    stale."""
    try:
        saved = _computed_settings(TrainConfig.from_dict(results.get("config", {})))
    except (TypeError, ValueError) as error:
        return [f"the saved config is unusable ({error})"]
    wanted = _computed_settings(config)
    return [
        f"{k}: {saved.get(k)!r} -> {wanted.get(k)!r}"
        for k in sorted(set(saved) | set(wanted))
        if saved.get(k) != wanted.get(k)
    ]


def _prepare(run_dir: Path, config: TrainConfig) -> TrainConfig:
    """The config to launch: resume a matching checkpoint, otherwise start from an empty dir."""
    from mtdao.train.checkpoint.store import latest_checkpoint

    latest = latest_checkpoint(run_dir)
    config = config.replace(out=str(run_dir), resume=False, progress=False)
    if latest is not None:
        try:
            meta = latest.meta
            same = not stale_settings({"config": meta["config"]}, config)
            if same and int(meta["step"]) <= config.total_steps():
                return config.replace(resume=True)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable: start over
    if run_dir.exists():
        # a run another process is training here (a second study on this --out) keeps its files:
        # RunLockedError names it, and this run is reported failed, not trained beside it
        with RunLock(run_dir):
            shutil.rmtree(run_dir)
    return config


def _prepare_unless_locked(name: str, run_dir: Path, config: TrainConfig, finished):
    """:func:`_prepare`, or None (the run reported failed) when another process is training a
    run in ``run_dir``: its directory is left alone."""
    try:
        return _prepare(run_dir, config)
    except RunLockedError as error:
        finished(name, None, f"{type(error).__name__}: {error}")
        return None


def _describe(results: dict[str, Any]) -> str:
    loss, ppl = results.get("final_val_loss"), results.get("val_ppl")
    sent = format_bytes(results.get("bytes_per_worker", 0))
    text = f"val {loss:.4f} (ppl {ppl:.2f})" if loss is not None else "no evaluation"
    return f"{text}  sent {sent}/worker  {results.get('wall_time_s', 0):.0f}s"


# -- the suite ------------------------------------------------------------------------------------


def run_suite(
    runs: Sequence[tuple[str, TrainConfig]],
    out: Path,
    *,
    jobs: int = 1,
    cores: int | None = None,
    threads: int | None = None,
    log: Callable[[str], None] = print,
    train: bool = True,
) -> SuiteResult:
    """Train every run not finished yet (none with ``train`` False, to report on a suite still
    running elsewhere); return all results, finished earlier or now.

    Each run gets ``threads`` torch threads (default: ``OMP_NUM_THREADS`` when set, else
    ``max(1, cores // jobs)``).

    Raises ValueError before training anything if a finished run in ``out`` has other settings
    than asked for now (its results would silently stand in for a different experiment).
    """
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    names = [name for name, _ in runs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"run names must be unique, repeated: {duplicates}")
    suite = SuiteResult()
    pending: list[tuple[str, TrainConfig]] = []
    for name, config in runs:
        resolve(config)  # refuses a bad config before anything trains
        results = load_results(run_dir_of(out, name))
        if results is None:
            pending.append((name, config))
            continue
        stale = stale_settings(results, config)
        if stale:
            raise ValueError(
                f"{run_dir_of(out, name)} holds a finished run with other settings "
                f"({'; '.join(stale)}); choose another --out or delete that directory"
            )
        suite.results[name] = results
    total, counter = len(runs), iter(range(len(suite.results) + 1, len(runs) + 1))
    if suite.results:
        log(f"{len(suite.results)}/{total} runs already finished in {out}; {len(pending)} to go")
    if not train:
        return suite
    if pending:
        log(workload([config for _, config in pending]))

    def finished(name: str, results: dict[str, Any] | None, error: str | None) -> None:
        if results is not None:
            suite.results[name] = results
            log(f"[{next(counter)}/{total}] {name:<34} {_describe(results)}")
        else:
            suite.failures[name] = error or "unknown error"
            log(f"[{next(counter)}/{total}] {name:<34} FAILED: {suite.failures[name]}")

    threads = threads or omp_threads() or max(1, (cores or available_cores()) // jobs)
    if jobs == 1:
        _train_one_after_another(pending, out, threads, finished)
    else:
        _train_in_subprocesses(pending, out, jobs, threads, finished)
    return suite


def omp_threads() -> int | None:
    """The thread count ``OMP_NUM_THREADS`` asks for (None when unset or not a count): a user
    who set it to 1 on a busy machine gets 1 thread per run, not cores // jobs."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def evaluations(config: TrainConfig) -> int:
    """How many times a run evaluates: every ``eval_every`` steps and at its last step."""
    resolved = resolve(config)
    steps, every = resolved.training.steps, resolved.job.eval_every
    return steps // every + (1 if steps % every else 0)


def workload(configs: Sequence[TrainConfig]) -> str:
    """The line said before a suite trains: runs, steps and evaluations to come."""
    resolved = [resolve(config) for config in configs]
    steps = sum(config.training.steps for config in resolved)
    evals = sum(evaluations(config) for config in configs)
    tokens = {config.text.eval_tokens for config in resolved}
    each = f"{tokens.pop():,} held-out tokens each" if len(tokens) == 1 else "held-out tokens"
    return (
        f"to train: {len(configs)} run(s), {steps:,} steps in all, {evals} evaluations ({each}); "
        "a rerun of this command skips the runs that finished"
    )


def _train_one_after_another(pending, out: Path, threads: int, finished) -> None:
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    said: set[str] = set()  # data lines already shown: the runs of a suite share their data
    try:
        for name, config in pending:
            _train_in_process(name, config, out, finished, said)
    finally:
        torch.set_num_threads(previous)


def _train_in_process(name: str, config: TrainConfig, out: Path, finished, said) -> None:
    from mtdao.train.setup import build_run
    from mtdao.train.trainer import train

    def build_saying_data_once(config, process):
        run = build_run(config, process)
        if run.data_summary in said:
            run.data_summary = ""
        said.add(run.data_summary)
        return run

    run_dir = run_dir_of(out, name)
    launch = _prepare_unless_locked(name, run_dir, config, finished)
    if launch is None:
        return
    try:
        results = train(launch, build=build_saying_data_once)
    except Exception as error:  # a diverged or broken run must not stop the others
        (run_dir / LOG_FILE).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / LOG_FILE).write_text(traceback.format_exc())
        finished(name, None, f"{type(error).__name__}: {error}")
        return
    finished(name, results, None)


def _train_in_subprocesses(pending, out: Path, jobs: int, threads: int, finished) -> None:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    queue = list(pending)
    running: dict[str, subprocess.Popen] = {}
    try:
        while queue or running:
            while queue and len(running) < jobs:
                name, config = queue.pop(0)
                run_dir = run_dir_of(out, name)
                launch = _prepare_unless_locked(name, run_dir, config, finished)
                if launch is None:
                    continue
                run_dir.mkdir(parents=True, exist_ok=True)
                command = [sys.executable, "-m", "mtdao", "train", *config_to_argv(launch)]
                with open(run_dir / LOG_FILE, "a") as log_file:  # the child keeps its own copy
                    log_file.write("$ " + shlex.join(command) + "\n")
                    log_file.flush()
                    running[name] = subprocess.Popen(
                        command, stdout=log_file, stderr=subprocess.STDOUT, env=env
                    )
            time.sleep(0.2)
            for name in [n for n, p in running.items() if p.poll() is not None]:
                returncode = running.pop(name).returncode
                results = load_results(run_dir_of(out, name))
                error = None if results else _last_error(run_dir_of(out, name), returncode)
                finished(name, results, error)
    finally:
        for process in running.values():  # interrupted: stop the runs we started
            process.terminate()
            process.wait()


def _last_error(run_dir: Path, returncode: int) -> str:
    lines = [line for line in (run_dir / LOG_FILE).read_text().splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    return f"exit code {returncode}: {last[-300:]} (log: {run_dir / LOG_FILE})"
