"""The float32 mean of a round: a bucketed all-reduce over a transport.

Tensors are grouped into one bucket per (device, dtype), split at the transport's
``bucket_bytes``, and summed (:meth:`~mtdao.sync.transport.Transport.all_reduce_sum`: a process
group flattens a bucket into one buffer and all-reduces it); there is no AVG reduction in gloo,
so the sum is divided by the number of contributing workers. A worker left out of the average
contributes zeros. The all-reduces are launched without blocking (:class:`InFlightMean`), so a
caller may compute while they run and wait later. A sharded tensor (a ``DTensor``, as FSDP2
makes parameters) travels as its local shard: the group averages shard with shard.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from mtdao.sync.dtensors import local_shard
from mtdao.sync.transport import Transport, Work

DEFAULT_BUCKET_BYTES = 256 * 2**20


def dtype_buckets(tensors: Sequence[Tensor]) -> dict[tuple, list[int]]:
    """Indices of ``tensors`` grouped by (device, dtype): one flat buffer per group."""
    buckets: dict[tuple, list[int]] = {}
    for index, tensor in enumerate(tensors):
        buckets.setdefault((tensor.device, tensor.dtype), []).append(index)
    return buckets


def size_chunks(
    indices: list[int], tensors: Sequence[Tensor], bucket_bytes: float
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
    """The float32 mean of a round's tensors, one all-reduce per bucket launched over a
    :class:`~mtdao.sync.transport.Transport` at once; :meth:`wait` completes it.

    ``tensors`` are this process's values (local shards), each with ``transport.local_workers``
    rows along dim 0 when there are several (the simulator)."""

    def __init__(
        self,
        tensors: Sequence[Tensor],
        transport: Transport,
        excluded: Sequence[int] = (),
        contributes: bool = True,
    ) -> None:
        tensors = [local_shard(tensor) for tensor in tensors]
        rows = transport.local_workers
        self.counted = transport.contributors(excluded, contributes)
        self.shapes = [t.shape[1:] if transport.stacked else t.shape for t in tensors]
        self.launched: list[tuple[list[int], Work]] = []
        for indices in dtype_buckets(tensors).values():
            for chunk in size_chunks(indices, tensors, transport.bucket_bytes):
                buffers = [tensors[i].reshape(rows, -1) for i in chunk]
                self.launched.append((chunk, transport.all_reduce_sum(buffers, self.counted)))

    @property
    def collectives(self) -> int:
        return len(self.launched)

    def advance(self) -> None:
        """Nothing to launch later: one stage."""

    def wait(self) -> list[Tensor]:
        averages: list[Tensor | None] = [None] * len(self.shapes)
        for chunk, work in self.launched:
            for i, total in zip(chunk, work.wait()):
                averages[i] = total.div_(len(self.counted)).view(self.shapes[i])
        return averages  # type: ignore[return-value]
