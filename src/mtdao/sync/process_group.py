"""Real workers: averaging over a ``torch.distributed`` process group (gloo on CPU, NCCL on GPU).

Tensors due at one step are flattened into one buffer per (device, dtype), split at
``bucket_bytes``, and summed with ``all_reduce``; gloo has no AVG reduction, so the sum is divided
by the number of contributing workers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from mtdao.sync.communicator import Communicator, dtype_buckets

DEFAULT_BUCKET_BYTES = 256 * 2**20


class ProcessGroupWorkers(Communicator):
    """One worker per process of an initialized process group."""

    def __init__(
        self, group: dist.ProcessGroup | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ProcessGroupWorkers needs torch.distributed initialized "
                "(launch with torchrun, or call torch.distributed.init_process_group first)"
            )
        self.group = group
        self.num_workers = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.bucket_bytes = bucket_bytes

    def _chunks(self, indices: list[int], tensors: Sequence[Tensor]) -> list[list[int]]:
        chunks: list[list[int]] = [[]]
        size = 0
        for index in indices:
            nbytes = tensors[index].numel() * tensors[index].element_size()
            if chunks[-1] and size + nbytes > self.bucket_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(index)
            size += nbytes
        return chunks

    def mean(
        self, tensors: Sequence[Tensor], kinds: Sequence[str], excluded: Sequence[int] = ()
    ) -> list[Tensor]:
        contributes = self.rank not in set(excluded)
        contributors = self.num_workers - len(set(excluded))
        if contributors < 1:
            raise RuntimeError("Every worker was excluded from the average")
        averages: list[Tensor | None] = [None] * len(tensors)
        collectives = 0
        for indices in dtype_buckets(tensors).values():
            for chunk in self._chunks(indices, tensors):
                flat = torch.cat([tensors[i].reshape(-1) for i in chunk])
                if not contributes:
                    flat.zero_()
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
                flat.div_(contributors)
                collectives += 1
                offset = 0
                for i in chunk:
                    numel = tensors[i].numel()
                    averages[i] = flat[offset : offset + numel].view_as(tensors[i])
                    offset += numel
        self._record(tensors, kinds, collectives)
        return averages  # type: ignore[return-value]

    def first_non_finite(self, tensors: Sequence[Tensor]) -> dict[int, int]:
        first = -1
        for index, tensor in enumerate(tensors):
            if not torch.isfinite(tensor).all():
                first = index
                break
        device = tensors[0].device if tensors else torch.device("cpu")
        per_worker = self.gather_scalars(torch.tensor(float(first), device=device))
        return {w: int(i) for w, i in enumerate(per_worker.tolist()) if i >= 0}

    def gather_scalars(self, values: Tensor) -> Tensor:
        value = values.reshape(1).to(
            torch.float64 if values.device.type == "cpu" else torch.float32
        )
        gathered = [torch.zeros_like(value) for _ in range(self.num_workers)]
        dist.all_gather(gathered, value, group=self.group)
        return torch.cat(gathered)

    def broadcast_from_first(self, tensors: Sequence[Tensor]) -> None:
        source = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        for tensor in tensors:
            dist.broadcast(tensor, src=source, group=self.group)
