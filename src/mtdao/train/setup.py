"""Building a run from a resolved TrainConfig: data, model, workers, optimizer, policy, engine."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mtdao.data import WorkerShard, encode_corpus, load_corpus, load_tokenizer
from mtdao.data.batches import validation_batches
from mtdao.methods import recipes
from mtdao.methods.optimizers import build_optimizer, warmups_of
from mtdao.model import Llama, model_config, split_weight_decay
from mtdao.optim.warmups import BetaWarmup, OmegaWarmup
from mtdao.sync import Communicator, LocalUpdateSync, SimulatedWorkers, WorkerLayout
from mtdao.sync.process_group import ProcessGroupWorkers
from mtdao.train.config import TrainConfig
from mtdao.train.distributed import ProcessInfo, init_process_group, pick_device
from mtdao.train.schedule import LRSchedule, lr_schedule_of
from mtdao.train.sharding import (
    build_sharded_replica,
    build_sharded_workers,
    check_topology,
    worker_of,
)
from mtdao.train.workers import ProcessWorkerSet, SimulatedWorkerSet, WorkerSet


def default_cache_dir() -> Path:
    return Path(os.environ.get("MTDAO_CACHE", Path.home() / ".cache" / "mtdao"))


@dataclass
class RunClock:
    """Where a run's time goes, summed over the sessions of a resumed run."""

    train_s: float = 0.0
    """The steps: forward, backward, averaging, optimizer."""
    sync_s: float = 0.0
    """The part of train_s spent in sync rounds."""
    eval_s: float = 0.0
    """Evaluations of the global model."""
    earlier_wall_s: float = 0.0
    """Wall time of the sessions before the last resume."""
    started: float = field(default_factory=time.perf_counter)

    def wall_s(self) -> float:
        """Real time since the run started: start-up, steps, evaluations and checkpoints."""
        return self.earlier_wall_s + time.perf_counter() - self.started

    def state_dict(self) -> dict[str, float]:
        times = {"train_s": self.train_s, "sync_s": self.sync_s, "eval_s": self.eval_s}
        return {**times, "wall_s": self.wall_s()}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.train_s, self.sync_s, self.eval_s = state["train_s"], state["sync_s"], state["eval_s"]
        self.earlier_wall_s = state["wall_s"]


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
    lr_schedule: LRSchedule
    omega_warmup: OmegaWarmup
    beta_warmup: BetaWarmup
    data_summary: str = ""
    clock: RunClock = field(default_factory=RunClock)
    evals: list = field(default_factory=list)
    extensions: list = field(default_factory=list)
    """Every re-planning of the run's length (``--resume --extend``), as recorded."""

    @property
    def step(self) -> int:
        """Optimizer steps taken (the sync engine's count: there is no other)."""
        return self.sync.step_count

    @property
    def total_steps(self) -> int:
        return self.config.total_steps()

    @property
    def is_main(self) -> bool:
        return self.process.rank == 0


def build_run(
    config: TrainConfig,
    process: ProcessInfo | None = None,
    *,
    communicator: Communicator | None = None,
    worker_index: int | None = None,
) -> Run:
    """The run of a resolved ``config`` (see :func:`mtdao.train.config.resolve`).

    With a ``communicator``, this process is one worker that averages through it, reading data
    shard ``worker_index`` (a fault-tolerant replica: :mod:`mtdao.train.fault_tolerance.replica`).
    """
    if (
        config.job.out is None
        or config.training.steps is None
        or config.lr_schedule.lr is None
        or config.sync.omegas is None
    ):
        raise ValueError("build_run needs a resolved config (mtdao.train.config.resolve)")
    device = pick_device(config.training.device, int(os.environ.get("LOCAL_RANK", "0")))
    process = process or init_process_group(device)
    check_topology(config, process)
    torch.manual_seed(config.training.seed)
    shards, val_batches, vocab_size, data_summary = load_data(config, process, worker_index)
    model = Llama(model_config(config.training.model, vocab_size, config.text.seq_len)).to(device)
    communicator, workers = build_workers(model, config, process, device, communicator)
    groups = split_weight_decay(workers.named_parameters(), config.training.weight_decay)
    optimizer = build_optimizer(
        groups, config.sync, config.lr_schedule.lr, config.training.weight_decay
    )
    omega_warmup, beta_warmup = warmups_of(config.sync, config.total_steps())
    return Run(
        config=config,
        run_dir=Path(config.job.out),
        process=process,
        device=device,
        workers=workers,
        shards=shards,
        val_batches=val_batches,
        optimizer=optimizer,
        sync=build_sync(config, optimizer, communicator, workers),
        lr_schedule=lr_schedule_of(config),
        omega_warmup=omega_warmup,
        beta_warmup=beta_warmup,
        data_summary=data_summary,
    )


def build_workers(
    model: torch.nn.Module,
    config: TrainConfig,
    process: ProcessInfo,
    device: torch.device,
    communicator: Communicator | None = None,
) -> tuple[Communicator, WorkerSet]:
    """The communicator and the workers: one per process (or per --shards processes) under
    torchrun, else simulated; or one worker in this process, averaging through a given
    communicator."""
    if communicator is not None and config.parallel.shards > 1:  # a replica of --shards processes
        workers: WorkerSet = build_sharded_replica(model, config, device, communicator)
    elif communicator is not None:  # no coordination outside its rounds: the losses are its own
        workers = ProcessWorkerSet(model, WorkerLayout())
    elif config.parallel.shards > 1:
        communicator, workers = build_sharded_workers(model, config, device)
    elif process.distributed:
        communicator = ProcessGroupWorkers()
        workers = ProcessWorkerSet(model, communicator.layout)
    else:
        communicator = SimulatedWorkers(config.parallel.workers)
        workers = SimulatedWorkerSet(model, communicator.layout)
    if device.type == "cuda" and config.training.bf16:
        workers.autocast_dtype = torch.bfloat16
    return communicator, workers


def build_sync(
    config: TrainConfig, optimizer, communicator: Communicator, workers: WorkerSet
) -> LocalUpdateSync:
    """The engine carrying out the method's policy, with per-worker gradient clipping."""
    clip = config.training.grad_clip
    return recipes.build_sync(
        config.sync,
        optimizer,
        communicator,
        (lambda: workers.clip_grad_norm_(clip)) if clip > 0 else None,
        config.total_steps(),
    )


def load_data(config: TrainConfig, process: ProcessInfo, worker_index: int | None = None):
    """(this process's worker shards, validation batches, vocabulary size, a one-line summary)."""
    corpus = load_corpus(config.text.data)
    tokenizer = load_tokenizer(config.text.tokenizer, corpus, default_cache_dir())
    tokens = encode_corpus(corpus, tokenizer, default_cache_dir())
    my_workers = (
        [worker_of(process, config.parallel.shards)]
        if process.distributed
        else range(config.parallel.workers)
    )
    if worker_index is not None:
        my_workers = [worker_index]
    shards = [
        WorkerShard(
            tokens,
            w,
            config.parallel.workers,
            config.text.batch_size,
            config.text.seq_len,
            config.training.seed,
            config.text.data_split,
        )
        for w in my_workers
    ]
    eval_batch = max(1, min(32, config.text.eval_tokens // config.text.seq_len))
    val_batches = validation_batches(
        tokens.val, eval_batch, config.text.seq_len, config.text.eval_tokens
    )
    train_tokens = sum(len(doc) for doc in tokens.train)
    summary = (
        f"data: {corpus.name}: {len(corpus.train_docs)} training and {len(corpus.val_docs)} "
        f"validation documents, {train_tokens:,} and {len(tokens.val):,} tokens "
        f"({config.text.tokenizer} tokenizer, vocabulary {tokenizer.vocab_size})"
    )
    return shards, val_batches, tokenizer.vocab_size, summary + skipped_files(corpus)


SKIPPED_NAMED = 20
"""Skipped files named one per line; a directory of many more (images beside text) gets a count."""


def skipped_files(corpus) -> str:
    """The data line's note of the files a local corpus directory skipped, each named once."""
    if not corpus.skipped:
        return ""
    count = len(corpus.skipped)
    lines = [f"; {count} file{'s' * (count != 1)} skipped"]
    lines += [f"\ndata: skipped {name}: {why}" for name, why in corpus.skipped[:SKIPPED_NAMED]]
    if count > SKIPPED_NAMED:
        lines.append(f"\ndata: ... and {count - SKIPPED_NAMED} more skipped files")
    return "".join(lines)
