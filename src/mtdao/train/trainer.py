"""The training loop: one loop for every method, simulated workers or real ones.

start   (startup.py) lock --out -> fresh, --overwrite, or --resume from the newest good checkpoint
setup   (setup.py) resolved config -> data -> model -> workers -> optimizer -> policy -> engine
loop    schedules -> batch -> per-worker losses -> backward -> sync.step() -> [evaluate, checkpoint]
        sync.step(): [average grads] -> clip (gradient hook) -> optimizer step -> [average due]
        after the last step: the final round (sync.finish(); --no-final-round: none)
finish  checkpoint (checkpoint/checkpointer.py, unless just saved) -> results.json (results.py) -> loss.png
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from mtdao.sync.communicator import RoundNotCommitted
from mtdao.train.checkpoint.checkpointer import Checkpointer
from mtdao.train.config import TrainConfig, config_warnings, resolve
from mtdao.train.distributed import (
    ProcessInfo,
    collective_errors,
    init_process_group,
    pick_device,
)
from mtdao.train.evaluate import run_evaluation
from mtdao.train.loop_hooks import LoopHooks
from mtdao.train.memory import out_of_memory_errors
from mtdao.train.metrics import MetricsLog, write_json
from mtdao.train.results import summarize
from mtdao.train.setup import Run, build_run
from mtdao.train.sharding import check_topology
from mtdao.train.startup import Start, choose_start, lock_run_dir
from mtdao.units import format_bytes

logger = logging.getLogger(__name__)


# -- one step -----------------------------------------------------------------------------------


def set_hyperparameters(run: Run, step: int) -> None:
    """The learning rate, omegas and betas of 0-based ``step``, applied to every param group."""
    run.lr_schedule.apply(run.optimizer, step)
    run.omega_warmup.apply(run.optimizer, step)
    run.beta_warmup.apply(run.optimizer, step)


def train_step(run: Run) -> torch.Tensor:
    """One optimizer step of every local worker, with whatever averaging is due; returns the
    per-worker losses."""
    set_hyperparameters(run, run.step)
    inputs, targets = run.workers.next_batch(run.shards, run.device)
    losses = run.workers.losses(inputs, targets)
    losses.sum().backward()  # each worker's gradient lands in its own slice
    run.sync.step()
    run.optimizer.zero_grad(set_to_none=True)
    return losses.detach()


def timed_step(run: Run) -> tuple[torch.Tensor, float]:
    """:func:`train_step` with its accounting; returns the losses and the step's seconds."""
    syncing_before, started = run.sync.rounds.seconds_syncing, time.perf_counter()
    losses = train_step(run)
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    elapsed = time.perf_counter() - started
    run.clock.train_s += elapsed
    run.clock.sync_s += run.sync.rounds.seconds_syncing - syncing_before
    return losses, elapsed


# -- the loop -----------------------------------------------------------------------------------


def train(
    config: TrainConfig, *, build=build_run, hooks: LoopHooks | None = None
) -> dict[str, Any]:
    """Train as configured (resolved first); returns (and writes) the results of the run.

    ``build`` ((config, process) -> Run) and ``hooks`` are how a replica of a fault-tolerant run
    (:mod:`mtdao.train.fault_tolerance.replica`, started by :func:`mtdao.train.train`) plugs in.
    """
    started = time.perf_counter()
    config = resolve(config)
    if config.parallel.fault_tolerant and hooks is None:
        raise ValueError(
            "a fault-tolerant replica is trained by mtdao.train.train (or mtdao train), which "
            "connects it to the lighthouse"
        )
    device = pick_device(config.training.device, int(os.environ.get("LOCAL_RANK", "0")))
    launched = ProcessInfo(world_size=int(os.environ.get("WORLD_SIZE", "1")))
    with collective_errors(launched, config.parallel.collective_timeout):
        process = init_process_group(device, config.parallel.collective_timeout)
        check_topology(config, process)  # --workers x --shards processes, before any file
        if process.rank == 0:
            for warning in config_warnings(config):
                say(f"warning: {warning}")
        checkpointer = Checkpointer(config, process, device)
        lock = lock_run_dir(
            config, process, checkpointer.collective
        )  # held by process 0 till the end
        try:
            start = choose_start(config, process, checkpointer.store)
            if process.rank == 0:
                for note in start.notes:
                    say(note)
            with out_of_memory_errors(config, device, simulated=not process.distributed):
                run = build(config, process)
                run.clock.started = started
                return train_run(run, checkpointer, start, hooks or LoopHooks())
        finally:
            lock.release()


@dataclass
class Outputs:
    """Where the loop writes, and what it must remember about this start of the run."""

    checkpointer: Checkpointer
    log: MetricsLog
    last_saved: int | None = None
    """The step of the newest checkpoint (loaded or saved): the final save is skipped at it."""
    resumed: tuple[int, Path] | None = None
    """(step, checkpoint directory) when the run was resumed."""


def train_run(
    run: Run, checkpointer: Checkpointer, start: Start, hooks: LoopHooks
) -> dict[str, Any]:
    """Restore the run if it resumes, train it to the end, and write its results."""
    start = checkpointer.restore(run, start)
    for note in start.notes if run.is_main else []:
        say(note)
    loaded = start.checkpoint
    if start.extension is not None:
        run.extensions.append(start.extension)
    if run.is_main:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        write_json(run.run_dir / "config.json", run.config.to_dict())
        if run.data_summary:  # empty where a caller has said it already (a suite's later runs)
            say(run.data_summary)
        if loaded is not None:
            say(f"resumed from step {run.step} of {run.total_steps} ({loaded.path})")
    log = MetricsLog(run.run_dir, enabled=run.is_main, append=loaded is not None)
    outputs = Outputs(checkpointer, log)
    if loaded is not None:
        log.truncate_after(run.step)
        outputs.last_saved = run.step
        outputs.resumed = (run.step, loaded.path)
    try:
        loop(run, outputs, hooks)
    finally:
        log.close()
    if outputs.last_saved != run.step:  # unless the loop (or the resume) just saved this step
        checkpointer.save(run)
    results = summarize(run)
    results["extensions"] = run.extensions
    if run.is_main:
        write_json(run.run_dir / "results.json", results)
        draw_plot(run.run_dir)
    return results


def draw_plot(run_dir: Path) -> None:
    """loss.png; a plot that cannot be written (a full disk) costs only the plot, and an older
    one is removed (it would show another run, or this one cut short)."""
    from mtdao.train.plots import plot_run

    try:
        plot_run(run_dir)
    except OSError as error:
        logger.warning("could not draw %s: %s", run_dir / "loss.png", error)
        with contextlib.suppress(OSError):
            (run_dir / "loss.png").unlink()


def say(line: str) -> None:
    """A progress line for the person at the terminal (stderr: stdout carries the results)."""
    print(line, file=sys.stderr, flush=True)


def loop(run: Run, outputs: Outputs, hooks: LoopHooks) -> None:
    """Train from ``run.step`` to the end: every run, plain or a fault-tolerant replica (the
    ``hooks`` tell them apart)."""
    config = run.config
    progress = tqdm(
        total=run.total_steps,
        initial=run.step,
        disable=not (config.job.progress and run.is_main),
        desc=hooks.describe(run),
        unit="step",
        dynamic_ncols=True,
    )
    throughput = Throughput()
    try:
        while run.step < run.total_steps:
            rounds, losses = len(run.sync.events), None
            try:
                hooks.before_step(run)
                if run.step < run.total_steps:  # (a replica may heal to the end of the run)
                    losses, elapsed = timed_step(run)
            except RoundNotCommitted as failure:  # undone; the step's local progress is kept
                run.optimizer.zero_grad(set_to_none=True)
                hooks.on_discarded(run, failure)
            else:
                if len(run.sync.events) > rounds:
                    hooks.after_round(run)
                if losses is not None:
                    throughput.add(hooks.tokens_per_step(run), elapsed)
                    record_losses(run, outputs, hooks, progress, losses, throughput)
            if run.step == run.total_steps and config.sync.final_round:
                final_round(run, hooks)
            progress.update(run.step - progress.n)
            if run.step % config.job.eval_every == 0 or run.step == run.total_steps:
                complete_transfers(run)
                run_evaluation(run, outputs.log)
            due = (
                config.checkpoint.checkpoint_every
                and run.step % config.checkpoint.checkpoint_every == 0
            )
            if due and hooks.may_checkpoint(run):
                outputs.checkpointer.save(run)
                outputs.last_saved = run.step
    finally:
        progress.close()


def record_losses(run: Run, outputs: Outputs, hooks: LoopHooks, progress, losses, throughput):
    """Check the step's losses and log them when a log line is due."""
    should_log = run.step % run.config.job.log_every == 0 or run.step == run.total_steps
    if should_log or not run.process.distributed:
        # every worker's loss (a tiny uncounted gather on real workers: log steps only)
        worker_losses = run.workers.layout.gather(losses.float())
        hooks.check_losses(run, worker_losses, outputs.resumed)
    if should_log:
        loss = finite_mean(worker_losses)
        log_training(run, outputs.log, progress, loss, throughput.take())


def final_round(run: Run, hooks: LoopHooks) -> None:
    """One global model at the end (``sync.finish``: rounds in flight land, then what is still
    apart is averaged; nothing is sent when the last step synced everything), before the last
    evaluation and checkpoint; timed as training. A try the communicator discards goes to
    ``hooks.on_discarded`` and is formed again; ``FinalRoundNotCommitted`` when none commits."""
    started, rounds = time.perf_counter(), len(run.sync.events)
    try:
        run.sync.finish(on_discarded=lambda failure: hooks.on_discarded(run, failure))
        if len(run.sync.events) > rounds:
            hooks.after_round(run)
    finally:
        elapsed = time.perf_counter() - started
        run.clock.train_s += elapsed
        run.clock.sync_s += elapsed


def complete_transfers(run: Run) -> None:
    """Let the collectives of delayed rounds finish before an (untimed) evaluation, timed as
    training: an evaluation must not hide communication that the steps would have waited for."""
    started = time.perf_counter()
    run.sync.rounds.complete_transfers()
    elapsed = time.perf_counter() - started
    run.clock.train_s += elapsed
    run.clock.sync_s += elapsed


def finite_mean(worker_losses: torch.Tensor) -> float:
    """The mean loss of the workers whose loss is finite (with --on-non-finite skip a worker left
    out holds NaN until its next round)."""
    finite = worker_losses[torch.isfinite(worker_losses)]
    return (finite if finite.numel() else worker_losses).mean().item()


class Throughput:
    """Tokens per second since the last log line."""

    def __init__(self) -> None:
        self.tokens, self.seconds = 0, 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds

    def take(self) -> float:
        rate = self.tokens / max(self.seconds, 1e-9)
        self.tokens, self.seconds = 0, 0.0
        return rate


def log_training(run: Run, log: MetricsLog, progress: tqdm, loss: float, tokens_per_s: float):
    sent = run.sync.traffic.bytes
    log.write(
        {
            "step": run.step,
            "tokens": run.step * run.config.tokens_per_step,
            "train_loss": loss,
            "lr": run.optimizer.param_groups[0]["lr"],
            "bytes_per_worker": sent,
            "tokens_per_s": tokens_per_s,
            "train_time_s": run.clock.train_s,
            "wall_time_s": run.clock.wall_s(),
        }
    )
    progress.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:.0f}", sent=format_bytes(sent))
