"""Workers bigger than one process: each worker is a group of S processes that shard its tensors.

With FSDP2 every parameter (and so every optimizer state made ``like`` it) is a DTensor whose
local shard is a slice of dim 0. Process s of worker w holds slice s, and so does process s of
every other worker: those M processes form one averaging (replicate) group, and the S processes of
worker w form its shard group. Averaging is element-wise, so averaging each slice over its
replicate group is averaging the whole tensor; the rounds, policies and events do not change.

What does change is everything that sums over a worker: a gradient norm, an alignment cosine, a
worker's loss, whether a worker's values are finite. Those sum (or agree) over the shard group
here, through a :class:`~mtdao.sync.transport.GroupTransport` of it, so that every process of a
worker takes the same decision (clip by the same factor, leave the same worker out) and no
process of a worker runs ahead of the others.

Sizes (``worker_numel``, ``worker_bytes``, and so the traffic account) are those of one worker's
whole tensor: the bytes a worker sends per round are the sum over its S processes, each sending
its shard (1/S of it when the rows divide evenly). A quantized process encodes its own shards
(``worker_parts``: how many elements each process holds), so its worker's bytes are the sum of
S payloads, each padded to whole blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from mtdao.sync.collectives import DEFAULT_BUCKET_BYTES
from mtdao.sync.dtensors import local_shard, shard_group_ranks, shard_numels
from mtdao.sync.layout import ProcessGroupLayout, WorkerLayout
from mtdao.sync.transport import GroupTransport, Work


class ShardGroupSums:
    """What changes for a layout whose worker is a group of processes sharding its tensors: sums
    and agreements over that shard group, before whatever the layout does between workers (the
    ``super()`` methods). Mixed in before a :class:`~mtdao.sync.layout.WorkerLayout`; call
    :meth:`_join_shard_group` from the constructor."""

    def _join_shard_group(self, shard_group: dist.ProcessGroup) -> None:
        self.shard_group = shard_group
        self.shard_transport = GroupTransport(shard_group, float("inf"))
        self.num_shards = self.shard_transport.num_workers
        self.shard_rank = self.shard_transport.rank
        self._shard_ranks = dist.get_process_group_ranks(shard_group)

    def worker_numel(self, tensor: Tensor) -> int:
        ranks = shard_group_ranks(tensor)
        if ranks is not None and ranks != self._shard_ranks:
            raise ValueError(
                f"a tensor is sharded over processes {ranks}, but this worker's shard group is "
                f"{self._shard_ranks}"
            )
        return tensor.numel()  # a DTensor's numel is the whole tensor's

    def worker_parts(self, tensor: Tensor) -> list[int]:
        self.worker_numel(tensor)  # the same shard group
        return shard_numels(tensor, self.num_shards)

    def _sum_over_shards(self, local_sums: Tensor) -> Tensor:
        return self.shard_transport.sum(local_sums)

    def gather_over_shards(self, value: Tensor) -> Tensor:
        """This process's ``value`` from every process of its worker: ``[S, *value.shape]``."""
        return self.shard_transport.gather(value)

    def per_worker_sum(self, tensor: Tensor) -> Tensor:
        return self._sum_over_shards(local_shard(tensor).sum().reshape(1))

    def global_sum(self, tensor: Tensor) -> Tensor:
        return self._sum_over_shards(local_shard(tensor).sum().reshape(1)).reshape(())

    def gather(self, values: Tensor) -> Tensor:
        """One value per process -> one per worker: the mean over each worker's processes (a
        worker's loss is the mean of its processes' losses on equal parts of its batch; a value
        the processes agree on passes unchanged, the float64 sum of S copies being exact)."""
        dtype = torch.float64 if values.device.type == "cpu" else torch.float32
        mean = self._sum_over_shards(values.reshape(1).to(dtype).clone()) / self.num_shards
        return super().gather(mean)

    def gather_later(self, values: Tensor) -> Work:
        """Blocking, a column at a time: the processes of a worker agree on its values first."""
        return WorkerLayout.gather_later(self, values)

    def first_non_finite(self, tensors: Sequence[Tensor]) -> dict[int, int]:
        tensors = [local_shard(t) for t in tensors]
        none = len(tensors)
        first = next((i for i, t in enumerate(tensors) if not torch.isfinite(t).all()), none)
        device = tensors[0].device if tensors else torch.device("cpu")
        first_here = torch.tensor([first], dtype=torch.int64, device=device)
        first_in_worker = self.gather_over_shards(first_here).min().reshape(1)
        per_worker = super().gather(first_in_worker.to(torch.float32))
        return {w: int(i) for w, i in enumerate(per_worker.tolist()) if i < none}

    def all_finite(self, tensors: Sequence[Tensor]) -> bool:
        if not tensors:  # the processes of a worker hold the same tensors: all return here
            return True
        device = local_shard(tensors[0]).device
        here = torch.tensor(
            [int(not super().all_finite(tensors))], dtype=torch.int32, device=device
        )
        return not bool(self._sum_over_shards(here).item())

    @torch.no_grad()
    def clip_grad_norm_(self, grads: Sequence[Tensor], max_norm: float) -> Tensor:
        """As for one process, with the squared norm summed over the worker's shards in one
        collective (not one per tensor)."""
        grads = [local_shard(g) for g in grads]
        device = grads[0].device if grads else torch.device("cpu")
        local = sum((g.float().square().sum() for g in grads), torch.zeros((), device=device))
        norms = self._sum_over_shards(local.reshape(1)).sqrt()
        if max_norm > 0:
            scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
            for g in grads:
                g.mul_(scale.reshape(()).to(g.dtype))
        return norms


class ShardedLayout(ShardGroupSums, ProcessGroupLayout):
    """One worker per ``shard_group`` of processes; ``group`` joins this process with the process
    holding the same shard in every other worker (None: the default group)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        shard_group: dist.ProcessGroup,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        super().__init__(group, bucket_bytes)
        self._join_shard_group(shard_group)


class ShardedWorkerLayout(ShardGroupSums, WorkerLayout):
    """One worker of ``shard_group``'s processes, with no other worker in reach: a fault-tolerant
    replica between its rounds (its losses, clipping and evaluation are its own)."""

    def __init__(self, shard_group: dist.ProcessGroup) -> None:
        self._join_shard_group(shard_group)
