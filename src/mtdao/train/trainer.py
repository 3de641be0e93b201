"""The training loop: one loop for every method, simulated workers or real ones.

setup   (setup.py) data -> model -> workers -> optimizer -> sync policy -> engine (-> resume)
loop    batch -> per-worker losses -> backward -> [average grads] -> clip -> step -> [sync]
finish  evaluate the global model -> checkpoint (snapshot.py) -> results.json (results.py)
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from tqdm import tqdm

from mtdao.data import stacked_batches
from mtdao.sync.engine import NonFiniteError
from mtdao.train import checkpoint as ckpt
from mtdao.train.config import TrainConfig
from mtdao.train.evaluate import evaluate
from mtdao.train.metrics import MetricsLog, write_json
from mtdao.train.results import summarize
from mtdao.train.schedule import lr_multiplier, ramp
from mtdao.train.setup import Run, build_run
from mtdao.train.snapshot import resume, save

__all__ = ["Run", "build_run", "train", "train_step", "set_hyperparameters"]


# -- one step -----------------------------------------------------------------------------------


def set_hyperparameters(run: Run, step: int) -> float:
    """LR schedule (and omega warm-up) for 0-based ``step``; returns the LR multiplier."""
    config = run.config
    multiplier = lr_multiplier(
        step,
        run.total_steps,
        config.schedule,
        round(config.warmup * run.total_steps),
        config.min_lr_ratio,
        config.decay_fraction,
    )
    omega_scale = ramp(step, round(config.omega_warmup * run.total_steps))
    for group in run.optimizer.param_groups:
        group["lr"] = group["initial_lr"] * multiplier
        group["omegas"] = tuple(w * omega_scale for w in group["target_omegas"])
    return multiplier


def next_batch(run: Run) -> tuple[torch.Tensor, torch.Tensor]:
    if run.process.distributed:
        inputs, targets = run.shards[0].next_batch()
    else:
        inputs, targets = stacked_batches(run.shards)
    return inputs.to(run.device, non_blocking=True), targets.to(run.device, non_blocking=True)


def train_step(run: Run, step: int) -> tuple[torch.Tensor, float]:
    """One optimizer step of every local worker, with whatever averaging is due.

    Returns the per-worker losses and the seconds spent averaging (communication).
    """
    set_hyperparameters(run, step)
    inputs, targets = next_batch(run)
    losses = run.workers.losses(inputs, targets)
    losses.sum().backward()  # each worker's gradient lands in its own slice
    started = time.perf_counter()
    run.sync.before_optimizer_step()  # DDP: average gradients
    sync_seconds = time.perf_counter() - started
    run.workers.clip_grad_norm_(run.config.grad_clip)
    run.optimizer.step()
    started = time.perf_counter()
    run.sync.after_optimizer_step()  # average the parameters and states that are due
    sync_seconds += time.perf_counter() - started
    run.optimizer.zero_grad(set_to_none=True)
    return losses.detach(), sync_seconds


# -- the loop -----------------------------------------------------------------------------------


def train(config: TrainConfig) -> dict[str, Any]:
    """Train as configured; returns (and writes) the results of the run."""
    run = build_run(config)
    if config.resume:
        resume(run)
    elif run.is_main and (run.run_dir / ckpt.CHECKPOINT_DIR).exists():
        raise ValueError(
            f"{run.run_dir} already holds a run; pass --resume to continue it or choose another --out"
        )
    if run.is_main:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        write_json(run.run_dir / "config.json", config.to_dict())
    log = MetricsLog(run.run_dir, enabled=run.is_main, append=config.resume)
    if config.resume:
        log.truncate_after(run.step)
    eval_every = config.eval_every or max(1, run.total_steps // 10)
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
            losses, elapsed = advance(run)
            throughput.add(config.tokens_per_step, elapsed)
            should_log = run.step % config.log_every == 0 or run.step == run.total_steps
            if should_log or not run.process.distributed:
                # every worker's loss (a tiny uncounted gather on real workers: log steps only)
                worker_losses = run.workers.communicator.gather_scalars(losses.float())
                check_finite_losses(run, worker_losses)
            if should_log:
                log_training(run, log, progress, worker_losses.mean().item(), throughput.take())
            progress.update(1)
            if run.step % eval_every == 0 or run.step == run.total_steps:
                run_evaluation(run, log)
            if config.checkpoint_every and run.step % config.checkpoint_every == 0:
                save(run)
    finally:
        progress.close()
        log.close()
    save(run)
    results = summarize(run)
    if run.is_main:
        write_json(run.run_dir / "results.json", results)
        from mtdao.train.plots import plot_run

        plot_run(run.run_dir)
    return results


def advance(run: Run) -> tuple[torch.Tensor, float]:
    """One training step with its accounting: wall time, compute time, bytes sent that step."""
    traffic = run.sync.communicator.traffic
    sent_before, started = traffic.bytes, time.perf_counter()
    losses, sync_seconds = train_step(run, run.step)
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    elapsed = time.perf_counter() - started
    run.step += 1
    run.wall_time_s += elapsed
    run.compute_time_s += elapsed - sync_seconds
    if traffic.bytes > sent_before:
        run.comm_events.append([run.step, traffic.bytes - sent_before])
    return losses, elapsed


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
    sent = run.sync.communicator.traffic.bytes
    log.write(
        {
            "step": run.step,
            "tokens": run.step * run.config.tokens_per_step,
            "train_loss": loss,
            "lr": run.optimizer.param_groups[0]["lr"],
            "bytes_per_worker": sent,
            "tokens_per_s": tokens_per_s,
            "wall_time_s": run.wall_time_s,
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


def run_evaluation(run: Run, log: MetricsLog) -> float:
    started = time.perf_counter()
    model = run.workers.global_model()
    with run.workers._autocast():
        val_loss = evaluate(model, run.val_batches, run.device)
    if not math.isfinite(val_loss) and run.config.on_non_finite == "raise":
        raise NonFiniteError(
            f"validation loss of the averaged model is NaN/inf at step {run.step}; lower --lr"
        )
    record = {
        "step": run.step,
        "tokens": run.step * run.config.tokens_per_step,
        "val_loss": val_loss,
        "val_ppl": math.exp(min(val_loss, 50.0)),
        "wall_time_s": run.wall_time_s,
        "bytes_per_worker": run.sync.communicator.traffic.bytes,
    }
    for key in ("cosine", "drift"):
        if run.sync.alignment:
            values = run.sync.alignment[-1][key]
            record[f"alignment_{key}_mean"] = sum(values) / len(values)
    run.evals.append(record)
    log.write(record)
    run.eval_time_s += time.perf_counter() - started
    return val_loss
