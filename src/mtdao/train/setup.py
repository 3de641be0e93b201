"""Building a run: data, model, workers, optimizer, sync policy and engine, from a TrainConfig."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mtdao.data import WorkerShard, encode_corpus, load_corpus, load_tokenizer
from mtdao.data.batches import validation_batches
from mtdao.model import Llama, model_config, split_weight_decay
from mtdao.sync.engine import LocalUpdateSync
from mtdao.sync.methods import OptimizerSettings, build_optimizer, build_policy, resolve_settings
from mtdao.sync.policy import OuterOptimizerConfig, with_state_period
from mtdao.sync.process_group import ProcessGroupWorkers
from mtdao.train.config import DEFAULT_LR, TrainConfig
from mtdao.train.distributed import ProcessInfo, init_process_group, pick_device
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
    if config.state_sync_period is not None:
        policy = with_state_period(policy, config.state_sync_period)
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
