"""The one collective real workers average with: a bucketed all-reduce over a process group.

Tensors are flattened into one buffer per (device, dtype), split at ``bucket_bytes``, and summed
with ``all_reduce``; gloo has no AVG reduction, so the sum is divided by the number of contributing
workers. A worker left out of the average contributes zeros. The all-reduces are launched without
blocking (:class:`InFlightMean`), so a caller may compute while they run and wait later. A sharded
tensor (a ``DTensor``, as FSDP2 makes parameters) travels as its local shard: the group averages
shard with shard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from mtdao.sync.dtensors import local_shard

DEFAULT_BUCKET_BYTES = 256 * 2**20


def dtype_buckets(tensors: Sequence[Tensor]) -> dict[tuple, list[int]]:
    """Indices of ``tensors`` grouped by (device, dtype): one flat buffer per group."""
    buckets: dict[tuple, list[int]] = {}
    for index, tensor in enumerate(tensors):
        buckets.setdefault((tensor.device, tensor.dtype), []).append(index)
    return buckets


def size_chunks(
    indices: list[int], tensors: Sequence[Tensor], bucket_bytes: int
) -> list[list[int]]:
    """``indices`` cut into consecutive runs of at most ``bucket_bytes`` (one tensor at least)."""
    chunks: list[list[int]] = [[]]
    size = 0
    for index in indices:
        nbytes = tensors[index].numel() * tensors[index].element_size()
        if chunks[-1] and size + nbytes > bucket_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append(index)
        size += nbytes
    return chunks


class InFlightMean:
    """Bucketed all-reduces launched without blocking; :meth:`wait` completes them."""

    def __init__(
        self,
        tensors: Sequence[Tensor],
        group: dist.ProcessGroup | None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        excluded: Sequence[int] = (),
    ) -> None:
        rank = dist.get_rank(group)
        self.contributors = dist.get_world_size(group) - len(set(excluded))
        if self.contributors < 1:
            raise RuntimeError("Every worker was excluded from the average")
        tensors = [local_shard(tensor) for tensor in tensors]
        self.shapes = [t.shape for t in tensors]
        self.launched: list[tuple[list[int], Tensor, dist.Work]] = []
        for indices in dtype_buckets(tensors).values():
            for chunk in size_chunks(indices, tensors, bucket_bytes):
                flat = torch.cat([tensors[i].reshape(-1) for i in chunk])  # a copy: inputs free
                if rank in set(excluded):
                    flat.zero_()
                work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
                self.launched.append((chunk, flat, work))

    @property
    def collectives(self) -> int:
        return len(self.launched)

    def advance(self) -> None:
        """Nothing to launch later: one stage."""

    def wait(self) -> list[Tensor]:
        averages: list[Tensor | None] = [None] * len(self.shapes)
        for chunk, flat, work in self.launched:
            work.wait()
            flat.div_(self.contributors)
            offset = 0
            for i in chunk:
                numel = math.prod(self.shapes[i])
                averages[i] = flat[offset : offset + numel].view(self.shapes[i])
                offset += numel
        return averages  # type: ignore[return-value]


def all_reduce_mean(
    tensors: Sequence[Tensor],
    group: dist.ProcessGroup | None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    excluded: Sequence[int] = (),
) -> tuple[list[Tensor], int]:
    """Averages over the group's ranks not in ``excluded``; returns (averages, collectives)."""
    in_flight = InFlightMean(tensors, group, bucket_bytes, excluded)
    return in_flight.wait(), in_flight.collectives
