"""Workers bigger than one process: M replica groups of S processes, each group sharding its model
with FSDP2 (``--workers M --shards S`` under torchrun; process r holds shard r % S of worker
r // S). A sharded worker computes what one unsharded worker computes (docs/training.md, "Sharded
workers"); a fault-tolerant replica with ``--shards S`` is one such worker launched on its own."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from mtdao.integrations.sharding import reshard
from mtdao.sync.dtensors import local_shard
from mtdao.sync.process_group import ProcessGroupWorkers
from mtdao.sync.shard_mesh import build_mesh, check_shardable
from mtdao.sync.sharded_layout import ShardedWorkerLayout
from mtdao.train.config import TrainConfig
from mtdao.train.distributed import ProcessInfo
from mtdao.train.workers import ProcessWorkerSet

# -- topology -------------------------------------------------------------------------------------


def launched_workers(config: TrainConfig) -> int:
    """The workers this launch's processes make: ``--workers``, or one fault-tolerant replica."""
    return 1 if config.parallel.fault_tolerant else config.parallel.workers


def check_topology(config: TrainConfig, process: ProcessInfo) -> None:
    """Refuse a launch whose processes do not make ``--workers`` x ``--shards`` (one line), or,
    for a fault-tolerant replica, ``--shards``."""
    workers, shards = config.parallel.workers, config.parallel.shards
    if config.parallel.fault_tolerant:
        if process.world_size != shards:
            need = "one process" if shards == 1 else f"{shards} processes, one per shard"
            how = "" if shards == 1 else f" (torchrun --nproc-per-node {shards})"
            has = "one" if not process.distributed else f"{process.world_size} (torchrun)"
            raise ValueError(
                f"--fault-tolerant --shards {shards}: each replica is its own launch of {need}"
                f"{how}, but this one has {has}"
            )
        return
    if shards > 1 and not process.distributed:
        raise ValueError(
            f"--shards {shards}: sharded workers need one process per shard; launch with "
            f"torchrun --nproc-per-node {workers * shards} (--workers {workers} x --shards "
            f"{shards}); simulated workers are unsharded"
        )
    if not process.distributed:
        return
    if shards == 1 and process.world_size != workers:
        raise ValueError(
            f"--workers {workers} but torchrun started {process.world_size} processes; "
            "they must match (one worker per process)"
        )
    if shards > 1 and process.world_size % shards != 0:
        raise ValueError(
            f"--shards {shards}: torchrun started {process.world_size} processes, which do not "
            f"divide into groups of {shards}"
        )
    if shards > 1 and process.world_size != workers * shards:
        raise ValueError(
            f"--workers {workers} x --shards {shards} needs {workers * shards} processes, but "
            f"torchrun started {process.world_size} ({process.world_size // shards} groups of "
            f"{shards})"
        )


def worker_of(process: ProcessInfo, shards: int) -> int:
    """The worker this process belongs to."""
    return process.rank // shards


def shard_model(model: nn.Module, mesh, bf16: bool) -> nn.Module:
    """FSDP2 over the mesh's shard dimension: each transformer block, then the rest of the model.

    On a GPU with ``bf16``, blocks compute in bfloat16 and reduce gradients in float32, while the
    sharded parameters, and so the optimizer states, stay float32.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    shard_mesh = mesh["shard"]
    policy = MixedPrecisionPolicy()
    if bf16 and shard_mesh.device_type == "cuda":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=shard_mesh, mp_policy=policy)
    fully_shard(model, mesh=shard_mesh, mp_policy=policy)
    return model


def build_sharded_workers(
    model: nn.Module, config: TrainConfig, device: torch.device
) -> tuple[ProcessGroupWorkers, ShardedWorkerSet]:
    """The communicator over the replicate groups and this process's part of its worker."""
    check_shardable(model, config.parallel.shards)
    mesh = build_mesh(device, config.parallel.workers, config.parallel.shards)
    shard_model(model, mesh, config.training.bf16)
    communicator = ProcessGroupWorkers(
        mesh.get_group("replicate"), shard_group=mesh.get_group("shard")
    )
    return communicator, ShardedWorkerSet(model, communicator.layout, mesh)


def build_sharded_replica(
    model: nn.Module, config: TrainConfig, device: torch.device, communicator
) -> ShardedWorkerSet:
    """This process's part of a fault-tolerant replica of ``--shards`` processes: FSDP2 over them,
    and ``communicator`` (a :class:`mtdao.ft.ReplicaGroups`) averaging its shards with
    the same process of the other replicas. Between rounds the replica reaches no other worker:
    its losses, clipping and evaluation are its own."""
    check_shardable(model, config.parallel.shards)
    mesh = build_mesh(device, 1, config.parallel.shards)
    shard_model(model, mesh, config.training.bf16)
    communicator.shard_over(mesh.get_group("shard"))
    return ShardedWorkerSet(model, ShardedWorkerLayout(mesh.get_group("shard")), mesh)


# -- the workers ----------------------------------------------------------------------------------


class ShardedWorkerSet(ProcessWorkerSet):
    """This process: shard ``layout.shard_rank`` of worker ``layout.rank``, an FSDP2 model."""

    def __init__(self, model: nn.Module, layout, mesh) -> None:
        super().__init__(model, layout)
        self.mesh = mesh

    def losses(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """This process's loss on its rows of the worker's batch (FSDP averages the gradients of
        the worker's processes; the layout's ``gather`` averages their losses)."""
        rows = inputs.shape[0] // self.layout.num_shards
        mine = slice(self.layout.shard_rank * rows, (self.layout.shard_rank + 1) * rows)
        return super().losses(inputs[mine], targets[mine])

    @torch.no_grad()
    def global_model(self, excluded: Sequence[int] = ()) -> nn.Module:
        if self.layout.num_workers == 1:
            return EvaluatedShards(self.model)
        params = [p for _, p in self.named_parameters()]
        return EvaluatedShards(self.model, params, self.layout.global_mean(params, excluded))


class EvaluatedShards(nn.Module):
    """The sharded model run for evaluation, with the workers' ``averages`` in place of its own
    shards while it runs (a copy of the model would not be sharded: every call swaps the
    averages in and back out).

    Every call ends with each FSDP2 module resharded: the root module keeps its parameters
    unsharded after a forward (a training step frees them in its backward), and an evaluation
    has no backward. Left behind, the root's gathered (averaged) parameters would serve the next
    training step's forward in place of the worker's own.
    """

    def __init__(self, model: nn.Module, params=(), averages=()) -> None:
        super().__init__()
        self.model = model
        self.params, self.averages = list(params), list(averages)

    @torch.no_grad()
    def forward(self, tokens: Tensor) -> Tensor:
        shards = [local_shard(p) for p in self.params]
        own = [shard.clone() for shard in shards]
        if shards:
            torch._foreach_copy_(shards, self.averages)
        try:
            return self.model(tokens)
        finally:
            reshard(self.model)
            if shards:
                torch._foreach_copy_(shards, own)


# -- what a process holds -------------------------------------------------------------------------


def process_memory(params: list[Tensor], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters and optimizer state this process holds (its shards, when sharded;
    every local worker's copy, when simulated)."""

    def nbytes(tensor: Tensor) -> int:
        shard = local_shard(tensor)
        return shard.numel() * shard.element_size()

    states = [
        v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, Tensor)
    ]
    return {
        "parameter_bytes": sum(nbytes(p) for p in params),
        "optimizer_state_bytes": sum(nbytes(v) for v in states),
    }
