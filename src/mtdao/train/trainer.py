"""The training loop: one loop for every method, simulated workers or real ones.

setup   (setup.py) resolved config -> data -> model -> workers -> optimizer -> policy -> engine
loop    schedules -> batch -> per-worker losses -> backward -> sync.step() -> [evaluate, checkpoint]
        sync.step(): [average grads] -> clip (gradient hook) -> optimizer step -> [average due]
finish  checkpoint (snapshot.py) -> results.json (results.py) -> loss.png
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from tqdm import tqdm

from mtdao.data import stacked_batches
from mtdao.sync.engine import NonFiniteError
from mtdao.train import checkpoint as ckpt
from mtdao.train.config import TrainConfig, resolve
from mtdao.train.evaluate import run_evaluation
from mtdao.train.metrics import MetricsLog, write_json
from mtdao.train.results import summarize
from mtdao.train.setup import Run, build_run
from mtdao.train.snapshot import resume, save

__all__ = ["Run", "build_run", "train", "train_step", "set_hyperparameters"]


# -- one step -----------------------------------------------------------------------------------


def set_hyperparameters(run: Run, step: int) -> None:
    """The learning rate and omegas of 0-based ``step``, applied to every param group."""
    run.lr_schedule.apply(run.optimizer, step)
    run.omega_warmup.apply(run.optimizer, step)


def next_batch(run: Run) -> tuple[torch.Tensor, torch.Tensor]:
    if run.process.distributed:
        inputs, targets = run.shards[0].next_batch()
    else:
        inputs, targets = stacked_batches(run.shards)
    return inputs.to(run.device, non_blocking=True), targets.to(run.device, non_blocking=True)


def train_step(run: Run) -> torch.Tensor:
    """One optimizer step of every local worker, with whatever averaging is due; returns the
    per-worker losses."""
    set_hyperparameters(run, run.step)
    inputs, targets = next_batch(run)
    losses = run.workers.losses(inputs, targets)
    losses.sum().backward()  # each worker's gradient lands in its own slice
    run.sync.step()
    run.optimizer.zero_grad(set_to_none=True)
    return losses.detach()


def timed_step(run: Run) -> tuple[torch.Tensor, float]:
    """:func:`train_step` with its accounting; returns the losses and the step's seconds."""
    syncing_before, started = run.sync.seconds_syncing, time.perf_counter()
    losses = train_step(run)
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    elapsed = time.perf_counter() - started
    run.clock.train_s += elapsed
    run.clock.sync_s += run.sync.seconds_syncing - syncing_before
    return losses, elapsed


# -- the loop -----------------------------------------------------------------------------------


def train(config: TrainConfig) -> dict[str, Any]:
    """Train as configured (resolved first); returns (and writes) the results of the run."""
    started = time.perf_counter()
    config = resolve(config)
    run = build_run(config)
    run.clock.started = started
    if config.resume:
        resume(run)
    elif run.is_main and (run.run_dir / ckpt.CHECKPOINT_DIR).exists():
        raise ValueError(
            f"{run.run_dir} already holds a run; pass --resume to continue it or choose another --out"
        )
    if run.is_main:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        write_json(run.run_dir / "config.json", config.to_dict())
        say(run.data_summary)
        if config.resume:
            say(f"resumed from step {run.step} of {run.total_steps} ({run.run_dir})")
    log = MetricsLog(run.run_dir, enabled=run.is_main, append=config.resume)
    if config.resume:
        log.truncate_after(run.step)
    try:
        loop(run, log)
    finally:
        log.close()
    save(run)
    results = summarize(run)
    if run.is_main:
        write_json(run.run_dir / "results.json", results)
        from mtdao.train.plots import plot_run

        plot_run(run.run_dir)
    return results


def say(line: str) -> None:
    """A progress line for the person at the terminal (stderr: stdout carries the results)."""
    print(line, file=sys.stderr, flush=True)


def loop(run: Run, log: MetricsLog) -> None:
    config = run.config
    progress = tqdm(
        total=run.total_steps,
        initial=run.step,
        disable=not (config.progress and run.is_main),
        desc=f"{config.method}",
        unit="step",
        dynamic_ncols=True,
    )
    throughput = Throughput()
    try:
        while run.step < run.total_steps:
            losses, elapsed = timed_step(run)
            throughput.add(config.tokens_per_step, elapsed)
            should_log = run.step % config.log_every == 0 or run.step == run.total_steps
            if should_log or not run.process.distributed:
                # every worker's loss (a tiny uncounted gather on real workers: log steps only)
                worker_losses = run.workers.layout.gather(losses.float())
                check_finite_losses(run, worker_losses)
            if should_log:
                log_training(run, log, progress, worker_losses.mean().item(), throughput.take())
            progress.update(1)
            if run.step % config.eval_every == 0 or run.step == run.total_steps:
                run_evaluation(run, log)
            if config.checkpoint_every and run.step % config.checkpoint_every == 0:
                save(run)
    finally:
        progress.close()


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
    progress.set_postfix(
        loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:.0f}", sent=f"{sent / 2**20:.1f}MB"
    )


def check_finite_losses(run: Run, worker_losses: torch.Tensor) -> None:
    """Stop on a diverged worker (on_non_finite 'raise'), or when none is left to skip."""
    finite = torch.isfinite(worker_losses)
    if bool(finite.all()):
        return
    diverged = torch.nonzero(~finite).flatten().tolist()
    if run.config.on_non_finite == "raise":
        raise NonFiniteError(
            f"training loss is NaN/inf at step {run.step} on worker(s) {diverged}; lower --lr, "
            "or pass --on-non-finite skip to leave diverged workers out at the next sync"
        )
    if len(diverged) == len(worker_losses):
        raise NonFiniteError(
            f"training loss is NaN/inf at step {run.step} on every worker; none is left to average"
        )
