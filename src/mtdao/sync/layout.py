"""Where each worker's copy of a tensor lives: the one place that knows.

* :class:`WorkerLayout`: one worker in this process and no other (world size 1);
* :class:`StackedLayout`: M simulated workers in one process, worker w's copy of a tensor of
  shape S being row w of a tensor of shape [M, *S];
* :class:`ProcessGroupLayout`: one worker per process of a ``torch.distributed`` process group;
* :class:`mtdao.sync.sharded_layout.ShardedLayout`: one worker per group of processes that shard
  its tensors (FSDP2), one process per worker in each averaging group.

Everything that depends on the layout but is not averaging goes through it: sizes per worker, a
global copy of a tensor all workers hold identically, per-worker sums (gradient norms, alignment),
gathering one scalar per worker (losses), locating the workers that hold a NaN, and the average
model for evaluation. A layout describes shapes; the few values it exchanges with other
processes move through a :class:`~mtdao.sync.transport.Transport` (the communicator's), never
through a collective of its own. They are control traffic, left out of the traffic account.
A sharded tensor (DTensor) is seen through its local shard, its sizes are those of the whole.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from mtdao.sync.collectives import DEFAULT_BUCKET_BYTES, InFlightMean
from mtdao.sync.dtensors import local_shard, shard_group_ranks
from mtdao.sync.transport import Done, GroupTransport, Then, Work


class WorkerLayout:
    """One unstacked worker in this process, and no other worker anywhere (world size 1)."""

    num_workers: int = 1
    rank: int = 0
    """Index of this process's first worker among all workers."""
    local_workers: int = 1
    """Workers whose copies this process holds."""
    num_shards: int = 1
    """Processes per worker, each holding a shard of its tensors (1: the worker's whole copy)."""
    shard_rank: int = 0
    """Which of its worker's processes this one is."""

    def worker_numel(self, tensor: Tensor) -> int:
        """Elements of one worker's copy."""
        return tensor.numel()

    def worker_bytes(self, tensor: Tensor) -> int:
        return self.worker_numel(tensor) * tensor.element_size()

    def worker_parts(self, tensor: Tensor) -> list[int]:
        """Elements of one worker's copy that each of its processes holds (and sends)."""
        return [self.worker_numel(tensor)]

    def global_copy(self, tensor: Tensor) -> Tensor:
        """A copy of a tensor that all workers hold identically, in one worker's shape (of a
        sharded tensor: this process's shard)."""
        return local_shard(tensor).detach().clone()

    def per_worker_sum(self, tensor: Tensor) -> Tensor:
        """Sum over each local worker's copy: shape [local_workers]."""
        return local_shard(tensor).sum().reshape(1)

    def global_sum(self, tensor: Tensor) -> Tensor:
        """Sum of a tensor that has one worker's shape (a global value): shape []."""
        return local_shard(tensor).sum()

    def per_worker_view(self, values: Tensor, like: Tensor) -> Tensor:
        """``values`` [local_workers] shaped to broadcast against ``like`` worker by worker."""
        return values.reshape(())

    def gather(self, values: Tensor) -> Tensor:
        """One value per local worker [local_workers] -> one per worker [num_workers]."""
        return values.reshape(1)

    def gather_later(self, values: Tensor) -> Work:
        """Several values per local worker [local_workers, n] -> [num_workers, n], launched now
        and waited for when read, for values nothing waits on (a diagnostic): one gather in
        flight on a process group; here, :meth:`gather` per column."""
        columns = [self.gather(column) for column in values.unbind(-1)]
        return Done([torch.stack(columns, dim=-1)])

    def worker_mask(self, workers: Sequence[int]) -> Tensor:
        """[local_workers] booleans: which local workers are among ``workers``."""
        first = self.rank
        return torch.tensor([first + w in set(workers) for w in range(self.local_workers)])

    def global_mean(self, tensors: Sequence[Tensor], excluded: Sequence[int] = ()) -> list[Tensor]:
        """Averages over all workers but ``excluded``, for evaluation and logging (uncounted)."""
        return list(tensors)

    def first_non_finite(self, tensors: Sequence[Tensor]) -> dict[int, int]:
        """{worker: index of its first tensor holding NaN/inf} for every worker that has one."""
        tensors = [local_shard(t) for t in tensors]
        first = next((i for i, t in enumerate(tensors) if not torch.isfinite(t).all()), -1)
        device = tensors[0].device if tensors else torch.device("cpu")
        per_worker = self.gather(torch.tensor(float(first), device=device))
        return {w: int(i) for w, i in enumerate(per_worker.tolist()) if i >= 0}

    def all_finite(self, tensors: Sequence[Tensor]) -> bool:
        """Whether every tensor is free of NaN/inf: the same answer in every process of a worker."""
        if not tensors:
            return True
        tensors = [local_shard(t) for t in tensors]
        # NaN and inf survive a sum, so finite sums prove the tensors finite: one reduction per
        # tensor; only a non-finite sum (or finite values overflowing) pays for the exact check
        sums = [t.sum(dtype=torch.float64 if t.is_floating_point() else None) for t in tensors]
        if bool(torch.isfinite(torch.stack(sums)).all()):
            return True
        return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())

    @torch.no_grad()
    def assign_to_workers(
        self, tensors: Sequence[Tensor], values: Sequence[Tensor], workers: Sequence[int]
    ) -> None:
        """Overwrite only ``workers``' copies of ``tensors`` with the global ``values``."""
        local = torch.arange(self.rank, self.rank + self.local_workers)
        chosen = torch.isin(local, torch.tensor(list(workers)))
        if bool(chosen.any()):
            for tensor, value in zip(tensors, values):
                tensor = local_shard(tensor)  # a sharded tensor's average is its shard's
                mask = self.per_worker_view(chosen.to(tensor.device), tensor)
                tensor.copy_(torch.where(mask, value.to(tensor.dtype), tensor))

    @torch.no_grad()
    def clip_grad_norm_(self, grads: Sequence[Tensor], max_norm: float) -> Tensor:
        """Scale each worker's gradients to norm <= max_norm; returns the norms before scaling."""
        grads = [local_shard(g) for g in grads]
        squared = sum(self.per_worker_sum(g.float().square()) for g in grads)
        norms = squared.sqrt()
        if max_norm > 0:
            scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
            for g in grads:
                g.mul_(self.per_worker_view(scale, g).to(g.dtype))
        return norms


def check_num_workers(num_workers: int) -> int:
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"Invalid number of workers: {num_workers} (must be >= 1)")
    return num_workers


class StackedLayout(WorkerLayout):
    """M workers in one process; every tensor carries a leading worker dimension of size M."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = self.local_workers = check_num_workers(num_workers)

    def check(self, tensor: Tensor) -> None:
        if tensor.dim() == 0 or tensor.shape[0] != self.num_workers:
            raise ValueError(
                f"Simulated tensors need a leading worker dimension of {self.num_workers}, "
                f"got shape {tuple(tensor.shape)} (stack a model with mtdao.sync.stack_workers)"
            )

    def worker_numel(self, tensor: Tensor) -> int:
        return tensor[0].numel()

    def global_copy(self, tensor: Tensor) -> Tensor:
        self.check(tensor)
        return tensor[0].detach().clone()

    def per_worker_sum(self, tensor: Tensor) -> Tensor:
        return tensor.reshape(self.num_workers, -1).sum(dim=1)

    def per_worker_view(self, values: Tensor, like: Tensor) -> Tensor:
        return values.reshape([-1] + [1] * (like.dim() - 1))

    def gather(self, values: Tensor) -> Tensor:
        return values.reshape(self.num_workers)

    def global_mean(self, tensors: Sequence[Tensor], excluded: Sequence[int] = ()) -> list[Tensor]:
        if not excluded:
            return [tensor.mean(dim=0) for tensor in tensors]
        kept = [w for w in range(self.num_workers) if w not in set(excluded)]
        index = torch.tensor(kept, device=tensors[0].device if tensors else None)
        return [tensor.index_select(0, index).mean(dim=0) for tensor in tensors]

    def first_non_finite(self, tensors: Sequence[Tensor]) -> dict[int, int]:
        found: dict[int, int] = {}
        for index, tensor in enumerate(tensors):
            finite = torch.isfinite(tensor.reshape(self.num_workers, -1)).all(dim=1)
            for worker in (~finite).nonzero().flatten().tolist():
                found.setdefault(worker, index)
        return found


class ProcessGroupLayout(WorkerLayout):
    """One worker per process of an initialized process group (``None``: the default group),
    reached through its :class:`~mtdao.sync.transport.GroupTransport` (``transport``, which the
    communicator shares)."""

    def __init__(
        self, group: dist.ProcessGroup | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "one worker per process needs torch.distributed initialized "
                "(launch with torchrun, or call torch.distributed.init_process_group first)"
            )
        self.group = group
        self.bucket_bytes = bucket_bytes
        self.transport = GroupTransport(group, bucket_bytes)
        self.num_workers = self.transport.num_workers
        self.rank = self.transport.rank

    def worker_numel(self, tensor: Tensor) -> int:
        if shard_group_ranks(tensor) is not None:
            raise ValueError(
                "this tensor is sharded over several processes (a DTensor, as FSDP2 makes): pass "
                "the processes of one worker as shard_group to ProcessGroupWorkers"
            )
        return tensor.numel()

    def gather(self, values: Tensor) -> Tensor:
        return self._launch_gather(values).wait()[0].reshape(self.num_workers)

    def gather_later(self, values: Tensor) -> Work:
        return self._launch_gather(values)

    def _launch_gather(self, values: Tensor) -> Work:
        """This process's values [1, n] (or [1]) gathered: [num_workers, n]."""
        value = values.reshape(1, -1).to(
            torch.float64 if values.device.type == "cpu" else torch.float32
        )
        gathered = self.transport.all_gather(value)
        return Then(gathered, lambda outputs: [outputs[0].reshape(self.num_workers, -1)])

    def global_mean(self, tensors: Sequence[Tensor], excluded: Sequence[int] = ()) -> list[Tensor]:
        return InFlightMean(tensors, self.transport, excluded).wait()
