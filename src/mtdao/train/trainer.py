"""The training loop: one loop for every method, simulated workers or real ones.

setup   data -> model -> workers -> optimizer -> sync policy -> engine (-> resume)
loop    batch -> per-worker losses -> backward -> [average grads] -> clip -> step -> [sync]
finish  evaluate the global model -> checkpoint -> results.json -> plot
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from mtdao.data import WorkerShard, encode_corpus, load_corpus, load_tokenizer, stacked_batches
from mtdao.data.batches import validation_batches
from mtdao.model import Llama, model_config, split_weight_decay
from mtdao.sync.engine import LocalUpdateSync, NonFiniteError
from mtdao.sync.methods import OptimizerSettings, build_optimizer, build_policy, resolve_settings
from mtdao.sync.policy import OuterOptimizerConfig, communication_per_step
from mtdao.sync.process_group import ProcessGroupWorkers
from mtdao.train import checkpoint as ckpt
from mtdao.train.config import DEFAULT_LR, TrainConfig
from mtdao.train.distributed import ProcessInfo, barrier, init_process_group, pick_device
from mtdao.train.evaluate import evaluate
from mtdao.train.metrics import MetricsLog, write_json
from mtdao.train.schedule import lr_multiplier, ramp
from mtdao.train.workers import ProcessWorkerSet, SimulatedWorkerSet, WorkerSet


def default_cache_dir() -> Path:
    return Path(os.environ.get("MTDAO_CACHE", Path.home() / ".cache" / "mtdao"))


@dataclass
class Run:
    """Everything a training run holds; built by :func:`build_run`."""

    config: TrainConfig
    run_dir: Path
    process: ProcessInfo
    device: torch.device
    workers: WorkerSet
    shards: list[WorkerShard]
    val_batches: list
    optimizer: torch.optim.Optimizer
    sync: LocalUpdateSync
    total_steps: int
    step: int = 0
    wall_time_s: float = 0.0
    compute_time_s: float = 0.0
    eval_time_s: float = 0.0
    comm_events: list = field(default_factory=list)
    evals: list = field(default_factory=list)

    @property
    def is_main(self) -> bool:
        return self.process.rank == 0


def build_run(config: TrainConfig, process: ProcessInfo | None = None) -> Run:
    config.validate()
    device = pick_device(config.device, int(os.environ.get("LOCAL_RANK", "0")))
    process = process or init_process_group(device)
    if process.distributed and process.world_size != config.workers:
        raise ValueError(
            f"--workers {config.workers} but torchrun started {process.world_size} processes; "
            "they must match (one worker per process)"
        )
    run_dir = Path(config.out or Path("runs") / config.run_name())
    torch.manual_seed(config.seed)

    corpus = load_corpus(config.data)
    tokenizer = load_tokenizer(config.tokenizer, corpus, default_cache_dir())
    tokens = encode_corpus(corpus, tokenizer, default_cache_dir())
    my_workers = [process.rank] if process.distributed else range(config.workers)
    shards = [
        WorkerShard(
            tokens,
            w,
            config.workers,
            config.batch_size,
            config.seq_len,
            config.seed,
            config.data_split,
        )
        for w in my_workers
    ]
    eval_batch = max(1, min(32, config.eval_tokens // config.seq_len))
    val_batches = validation_batches(tokens.val, eval_batch, config.seq_len, config.eval_tokens)

    model = Llama(model_config(config.model, tokenizer.vocab_size, config.seq_len)).to(device)
    if process.distributed:
        workers: WorkerSet = ProcessWorkerSet(model, ProcessGroupWorkers())
    else:
        workers = SimulatedWorkerSet(model, config.workers)
    if device.type == "cuda" and config.bf16:
        workers.autocast_dtype = torch.bfloat16

    settings = resolve_settings(
        config.method,
        OptimizerSettings(
            name=config.optimizer,
            lr=config.lr if config.lr is not None else DEFAULT_LR[config.optimizer],
            betas=config.betas,
            omegas=config.omegas,
            beta2=config.beta2,
            eps=config.eps,
            weight_decay=config.weight_decay,
        ),
    )
    groups = split_weight_decay(workers.named_parameters(), config.weight_decay)
    optimizer = build_optimizer(groups, settings)
    for group in optimizer.param_groups:
        group["initial_lr"] = settings.lr
        group["target_omegas"] = tuple(group["omegas"])
    outer = OuterOptimizerConfig(lr=config.outer_lr, momentum=config.outer_momentum)
    policy = build_policy(
        config.method,
        config.sync_period,
        optimizer,
        config.sync_policy,
        outer=outer if config.method == "diloco" else None,
    )
    sync = LocalUpdateSync(
        optimizer,
        policy,
        workers.communicator,
        on_non_finite=config.on_non_finite,
        track_alignment=config.track_alignment,
    )
    return Run(
        config=config,
        run_dir=run_dir,
        process=process,
        device=device,
        workers=workers,
        shards=shards,
        val_batches=val_batches,
        optimizer=optimizer,
        sync=sync,
        total_steps=config.total_steps(),
    )


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


# -- results ------------------------------------------------------------------------------------


def ddp_bytes_per_step(run: Run) -> int:
    """What DDP sends per worker per step: one gradient of every parameter."""
    comm = run.sync.communicator
    return sum(comm.bytes_per_worker(p) for _, p in run.workers.named_parameters())


def summarize(run: Run) -> dict[str, Any]:
    config = run.config
    traffic = run.sync.communicator.traffic
    ddp_bytes = ddp_bytes_per_step(run) * run.step
    final = run.evals[-1] if run.evals else {}
    state_keys = sorted({k for s in run.optimizer.state.values() for k in s})
    return {
        "method": config.method,
        "optimizer": config.optimizer,
        "workers": config.workers,
        "sync_period": config.sync_period,
        "sync_policy": run.sync.policy.name,
        "periods": run.sync.policy.periods(),
        "steps": run.step,
        "tokens": run.step * config.tokens_per_step,
        "final_val_loss": final.get("val_loss"),
        "val_ppl": final.get("val_ppl"),
        "bytes_per_worker": traffic.bytes,
        "bytes_by_kind": traffic.bytes_by_kind,
        "collectives": traffic.collectives,
        "ddp_bytes_per_worker": ddp_bytes,
        # None when nothing was sent (one worker): JSON has no infinity
        "comm_reduction_vs_ddp": ddp_bytes / traffic.bytes if traffic.bytes else None,
        "modelled_comm_fraction_of_ddp": communication_per_step(run.sync.policy, state_keys),
        "wall_time_s": run.wall_time_s,
        "compute_s_per_worker_step": run.compute_time_s
        / max(run.step, 1)
        / (1 if run.process.distributed else config.workers),
        "simulated": not run.process.distributed,
        "parameters": sum(
            p[0].numel() if not run.process.distributed else p.numel()
            for _, p in run.workers.named_parameters()
        ),
        "evals": run.evals,
        "comm_events": run.comm_events,
        "alignment": run.sync.alignment,
        "skipped_rounds": run.sync.skipped_rounds,
        "settings": {
            "lr": run.optimizer.param_groups[0]["initial_lr"],
            "betas": list(run.optimizer.param_groups[0]["betas"]),
            "omegas": list(run.optimizer.param_groups[0]["target_omegas"]),
            "beta2": run.optimizer.param_groups[0].get("beta2"),
        },
        "config": config.to_dict(),
    }


# -- checkpoint / resume ------------------------------------------------------------------------


def save(run: Run) -> None:
    state = {
        "step": run.step,
        "params": {name: p.detach() for name, p in run.workers.named_parameters()},
        "optimizer": run.optimizer.state_dict(),
        "sync": run.sync.state_dict(),
        "shards": [shard.state_dict() for shard in run.shards],
        "torch_rng": torch.get_rng_state(),
        "wall_time_s": run.wall_time_s,
        "compute_time_s": run.compute_time_s,
        "comm_events": run.comm_events,
        "evals": run.evals,
    }
    meta = {"step": run.step, "config": run.config.to_dict()}
    ckpt.save_checkpoint(
        run.run_dir,
        run.process.rank,
        run.process.world_size,
        state,
        meta,
        lambda: barrier(run.process),
    )


@torch.no_grad()
def resume(run: Run) -> None:
    meta = ckpt.load_meta(run.run_dir)
    saved_config = TrainConfig.from_dict(meta["config"])
    differences = saved_config.differences(run.config)
    if differences:
        raise ckpt.CheckpointError(
            f"--resume: the config differs from the run in {run.run_dir}: " + "; ".join(differences)
        )
    state = ckpt.load_checkpoint(run.run_dir, run.process.rank, run.process.world_size)
    if state["step"] > run.total_steps:
        raise ckpt.CheckpointError(
            f"--resume: the checkpoint is at step {state['step']}, past --steps {run.total_steps}"
        )
    params = dict(run.workers.named_parameters())
    if set(params) != set(state["params"]):
        raise ckpt.CheckpointError("--resume: the checkpoint's parameters do not match the model")
    for name, p in params.items():
        p.copy_(state["params"][name])
    run.optimizer.load_state_dict(state["optimizer"])
    for group in run.optimizer.param_groups:  # keys torch restores as saved; keep ours current
        group["target_omegas"] = tuple(group["target_omegas"])
    run.sync.load_state_dict(state["sync"])
    for shard, saved in zip(run.shards, state["shards"], strict=True):
        shard.load_state_dict(saved)
    torch.set_rng_state(state["torch_rng"])
    run.step = state["step"]
    run.wall_time_s = state["wall_time_s"]
    run.compute_time_s = state["compute_time_s"]
    run.comm_events = [list(e) for e in state["comm_events"]]
    run.evals = list(state["evals"])
