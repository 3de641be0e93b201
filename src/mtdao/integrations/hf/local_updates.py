"""What a Trainer run needs from mtdao: the method's settings, and the optimizer and engine they
build, made by the harness's own builders (nothing here decides an update or a sync).

Nothing in this module imports transformers: it serves any trainer that hands over a model and
its learning rate, weight decay and gradient-clipping norm.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mtdao.sync import LocalUpdateSync, SingleWorker
from mtdao.sync.communicator import Traffic
from mtdao.sync.process_group import ProcessGroupWorkers
from mtdao.train.config import TrainConfig, resolve
from mtdao.train.methods import build_optimizer
from mtdao.train.schedule import BetaWarmup, OmegaWarmup, beta_warmup_of, omega_warmup_of
from mtdao.train.setup import build_sync
from mtdao.train.workers import ProcessWorkerSet, WorkerSet
from mtdao.units import format_bytes, format_traffic


@dataclass(frozen=True)
class LocalUpdates:
    """The method of a run: the ``mtdao train`` fields of the same names, with their defaults.

    The learning rate, its schedule, the weight decay and the gradient-clipping norm stay the
    trainer's (``TrainingArguments.learning_rate``, ``lr_scheduler_type``, ``weight_decay``,
    ``max_grad_norm``).
    """

    method: str = "mtdao"
    """ddp, qh-ddp, local-adam, diloco, desloc or mtdao (``mtdao train --help``)."""
    optimizer: str = "adam"
    """Base optimizer: adam, adopt or sgdm."""
    sync_period: int = 32
    """K: local steps between parameter averages."""
    sync_policy: str | None = None
    """Period rule of the optimizer states: unified, half-life or desloc (default: the method's)."""
    state_sync_period: int | None = None
    """Average every optimizer state every N steps, whatever the period rule."""
    sync_delay: int = 0
    """D: each round is sent D steps before it is applied, its collectives overlapping steps."""
    sync_fragments: int = 1
    """P: the layers and their states in P fragments synced at staggered steps."""
    sync_dtype: tuple[str, ...] | None = None
    """What crosses the link (fp32, bf16, fp8, int8; or KIND=DTYPE per kind)."""
    error_feedback: bool = False
    """Carry each worker's quantization error of the parameters into its next round."""
    final_round: bool = True
    """At the last step, land the rounds in flight and average what is still apart, so that
    every worker ends with the same model (what ``save_model()`` writes)."""
    betas: tuple[float, ...] | None = None
    """First-momentum decays (default: the method's)."""
    omegas: tuple[float, ...] | None = None
    """Mixing weights of the momenta; the raw gradient gets 1 - sum."""
    beta2: float | None = None
    """Second-moment decay."""
    eps: float | None = None
    """Denominator epsilon."""
    omega_warmup: float = 0.0
    """Fraction of the run over which the omegas ramp from 0."""
    beta_warmup: float | None = None
    """Fraction of the run over which each decay above 0.9 rises from 0.9 (default: the method's)."""
    beta_ramp: float | None = None
    """C: each decay above 0.9 is at most 1 - C / t at step t (default: the method's)."""
    outer_step: str = "average"
    """average, or nesterov: DiLoCo's outer step on each parameter average."""
    outer_lr: float = 0.7
    """Outer learning rate (diloco, or outer_step nesterov)."""
    outer_momentum: float = 0.9
    """Outer Nesterov momentum."""
    on_non_finite: str = "raise"
    """A NaN/inf in a round: raise, or skip the worker and heal it."""
    track_alignment: bool = False
    """Record each worker's pseudo-gradient alignment at every parameter sync."""
    shards: int = 1
    """S: processes per worker, sharding its model with FSDP2 (world size M x S)."""

    def resolve(self, lr: float, weight_decay: float, grad_clip: float, steps: int) -> TrainConfig:
        """The harness config of this method, validated and with every default filled in."""
        workers, shards = launched_workers(self.shards), self.shards
        config = TrainConfig(
            **dataclasses.asdict(self),
            lr=lr,
            weight_decay=weight_decay,
            grad_clip=grad_clip,
            steps=max(1, steps),
            workers=workers,
            batch_size=shards,  # unused here; resolve() asks it to split over the shards
        )
        return resolve(config)


def launched_workers(shards: int) -> int:
    """M: the processes of this run (torchrun or accelerate) over the processes per worker."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if shards < 1 or world % shards:
        raise ValueError(f"shards={shards} does not divide the {world} launched processes")
    return world // shards


@dataclass
class LocalRun:
    """The optimizer, the engine and this process's part of the workers, built together."""

    config: TrainConfig
    optimizer: torch.optim.Optimizer
    sync: LocalUpdateSync
    workers: WorkerSet

    def warmups(self, total_steps: int) -> tuple[OmegaWarmup, BetaWarmup]:
        """The omega and beta warm-ups over a run of ``total_steps`` optimizer steps."""
        config = dataclasses.replace(self.config, steps=max(1, total_steps))
        return omega_warmup_of(config), beta_warmup_of(config)


def build_local_run(
    model: nn.Module, config: TrainConfig, decayed: Collection[str] | None = None
) -> LocalRun:
    """The optimizer and engine of a resolved ``config`` over ``model`` (already on its device).

    ``decayed``: the names of the parameters that take weight decay (default: all of them).
    With ``config.shards > 1`` the model is sharded in place with FSDP2 first.
    """
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if config.shards > 1:
        from mtdao.integrations.hf.sharding import shard_workers

        communicator, workers = shard_workers(model, config)
    else:  # one worker per process; at world size 1 the engine sends nothing
        communicator = ProcessGroupWorkers() if distributed else SingleWorker()
        workers = ProcessWorkerSet(model, communicator.layout)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    optimizer = build_optimizer(weight_decay_groups(named, decayed, config.weight_decay), config)
    sync = build_sync(config, optimizer, communicator, workers)
    return LocalRun(config, optimizer, sync, workers)


def weight_decay_groups(
    named: list[tuple[str, nn.Parameter]], decayed: Collection[str] | None, weight_decay: float
) -> list[dict]:
    """[decayed, undecayed] param groups, each with ``"names"`` (fragments and messages use
    them); an empty group is left out."""
    groups = [
        {"params": [], "names": [], "weight_decay": weight_decay},
        {"params": [], "names": [], "weight_decay": 0.0},
    ]
    for name, param in named:
        group = groups[0 if decayed is None or name in decayed else 1]
        group["params"].append(param)
        group["names"].append(name)
    return [group for group in groups if group["params"]]


def traffic_summary(traffic: Traffic) -> str:
    """One line on what a worker sent, against DDP over the same steps."""
    rounds = f"{traffic.rounds} round" + ("" if traffic.rounds == 1 else "s")
    text = f"traffic: {format_bytes(traffic.bytes)} sent per worker in {rounds}"
    text += f" over {traffic.steps} steps"
    reduction = traffic.reduction_vs_ddp()
    if reduction is None:
        return text + " (nothing averaged: one worker, or no round came due)"
    return text + f", {format_traffic(reduction, 'DDP')} ({format_bytes(traffic.ddp_bytes)})"


def traffic_logs(traffic: Traffic) -> dict[str, float]:
    """The traffic account as numbers for a trainer's logs."""
    logs = {"sync_bytes_per_worker": float(traffic.bytes), "sync_rounds": float(traffic.rounds)}
    if traffic.ddp_bytes is not None:
        logs["sync_ddp_bytes_per_worker"] = float(traffic.ddp_bytes)
    reduction = traffic.reduction_vs_ddp()
    if reduction is not None:
        logs["sync_reduction_vs_ddp"] = reduction
    return logs


@torch.no_grad()
def workers_agree(model: nn.Module, group: dist.ProcessGroup | None = None) -> bool:
    """Whether every worker holds worker 0's parameters, bit for bit (True at world size 1).

    ``group``: the processes holding the same part of the model, one per worker (the engine's
    ``communicator.group``; None: all processes, one worker each). The first process of the
    group broadcasts its values, each compares, and the verdicts are combined over all
    processes: control traffic, not counted in the traffic account.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return True
    local = torch.cat([_local(p).detach().reshape(-1).float() for p in model.parameters()])
    first = local.clone()
    dist.broadcast(first, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    agree = torch.tensor([int(torch.equal(local, first))], device=local.device)
    dist.all_reduce(agree, op=dist.ReduceOp.MIN)
    return bool(agree.item())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
