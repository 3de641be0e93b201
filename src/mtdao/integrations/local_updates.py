"""What a trainer run needs from mtdao: the method's settings, and the optimizer and engine they
build with the library's builders (:mod:`mtdao.methods`). Nothing here imports transformers."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mtdao.methods import SyncConfig, build_optimizer, build_sync, warmups_of
from mtdao.methods.checks import non_negative, positive_int
from mtdao.optim.warmups import BetaWarmup, OmegaWarmup
from mtdao.sync import LocalUpdateSync, SingleWorker
from mtdao.sync.communicator import Traffic
from mtdao.sync.process_group import ProcessGroupWorkers
from mtdao.units import format_bytes, format_traffic


@dataclass(frozen=True)
class LocalUpdates(SyncConfig):
    """The method of a run: :class:`mtdao.methods.SyncConfig` (the ``mtdao train`` fields of
    the same names, with their defaults) and the processes per worker.

    The learning rate, its schedule, the weight decay and the gradient-clipping norm stay the
    trainer's (Hugging Face's ``TrainingArguments.learning_rate``, ``lr_scheduler_type``,
    ``weight_decay``, ``max_grad_norm``; Lightning's ``configure_optimizers`` and
    ``gradient_clip_val``).
    """

    track_alignment: bool = False
    """Record each worker's pseudo-gradient alignment at every parameter sync (a collective)."""
    shards: int = 1
    """S: processes per worker, sharding its model with FSDP2 (world size M x S)."""

    def resolved(self) -> LocalUpdates:
        """Checked (a ValueError names the first bad field), every default filled in."""
        positive_int("shards", self.shards)
        return super().resolved(launched_workers(self.shards))  # type: ignore[return-value]


def launched_workers(shards: int) -> int:
    """M: the processes of this run (torchrun or accelerate) over the processes per worker."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if shards < 1 or world % shards:
        raise ValueError(f"shards={shards} does not divide the {world} launched processes")
    return world // shards


@dataclass
class LocalRun:
    """The optimizer and the engine of a run, built together, and what every trainer's step
    hooks do with them."""

    config: LocalUpdates
    """Resolved."""
    optimizer: torch.optim.Optimizer
    sync: LocalUpdateSync
    planned_steps: int = 0
    """The optimizer steps the trainer plans (0: no planned end, so no final round before the
    trainer's own end): the warm-ups span them, and the final round follows the last."""
    warmups: tuple[OmegaWarmup, BetaWarmup] | tuple[()] = ()
    finished: bool = False

    def plan(self, total_steps: int) -> None:
        self.planned_steps = total_steps
        self.warmups = warmups_of(self.config, max(1, total_steps))

    def apply_warmups(self) -> None:
        """The omegas and betas of the step about to be taken."""
        for warmup in self.warmups:
            warmup.apply(self.optimizer, self.sync.step_count)

    def after_step(self) -> None:
        """The rounds due; after the last planned step, the final round (before its evaluation
        and checkpoint)."""
        self.sync.rounds.after_step()
        if self.config.final_round and self.sync.step_count == self.planned_steps:
            self.finish()

    def finish(self) -> None:
        if not self.finished:
            self.sync.finish()
            self.finished = True


def build_local_run(
    model: nn.Module,
    local_updates: LocalUpdates,
    lr: float,
    weight_decay: float,
    grad_clip: float,
    decayed: Collection[str] | None = None,
) -> LocalRun:
    """The optimizer and engine of ``local_updates`` over ``model`` (already on its device):
    peak learning rate ``lr``, ``weight_decay`` on the parameters named in ``decayed`` (default:
    all of them), each worker's gradients clipped to norm ``grad_clip`` (0: not clipped). With
    ``shards > 1`` the model is sharded in place with FSDP2 first."""
    config = local_updates.resolved()
    for name, value in (("lr", lr), ("weight_decay", weight_decay), ("grad_clip", grad_clip)):
        non_negative(name, value)
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if config.shards > 1:
        from mtdao.integrations.sharding import shard_workers

        communicator = shard_workers(model, launched_workers(config.shards), config.shards)
    else:  # one worker per process; at world size 1 the engine sends nothing
        communicator = ProcessGroupWorkers() if distributed else SingleWorker()
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = weight_decay_groups(named, decayed, weight_decay)
    optimizer = build_optimizer(groups, config, lr, weight_decay)

    def clip_gradients() -> None:  # each worker's own (its shards summed), after averaging
        grads = [p.grad for _, p in named if p.grad is not None]
        communicator.layout.clip_grad_norm_(grads, grad_clip)

    sync = build_sync(config, optimizer, communicator, clip_gradients if grad_clip > 0 else None)
    return LocalRun(config, optimizer, sync)


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
