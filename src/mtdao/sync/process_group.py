"""Real workers: averaging over a ``torch.distributed`` process group (gloo on CPU, NCCL on GPU).

One worker per process, or per group of processes sharding its tensors (FSDP2, ``shard_group``);
float32 tensors due at one step travel in the bucketed all-reduce of :mod:`mtdao.sync.collectives`
(one flat buffer per device and dtype, split at ``bucket_bytes``; a sharded tensor as its local
shard), quantized ones in the exchange of :mod:`mtdao.sync.exchange` (each process encoding its
own shards). Both are launched without blocking: the :class:`Averages` returned holds them in
flight until ``wait()``. A sharded process also counts its own part of its worker's bytes
(``Traffic.process_bytes``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor

from mtdao.sync.collectives import DEFAULT_BUCKET_BYTES, InFlightMean
from mtdao.sync.communicator import Averages, Communicator, InFlight, codec_groups
from mtdao.sync.dtensors import local_shard
from mtdao.sync.exchange import InFlightQuantizedMean, payload_sizes
from mtdao.sync.layout import ProcessGroupLayout
from mtdao.sync.quantize import Codec
from mtdao.sync.sharded_layout import ShardedLayout


class ProcessGroupWorkers(Communicator):
    """One worker per process of an initialized process group (``None``: the default group).

    With ``shard_group``, a worker is that group of processes sharding its tensors (FSDP2's
    DTensor parameters), and ``group`` joins this process with the one holding the same shard in
    every other worker (a device mesh's ``"replicate"`` dimension): see
    :mod:`mtdao.sync.sharded_layout`.
    """

    layout: ProcessGroupLayout

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        shard_group: dist.ProcessGroup | None = None,
    ):
        layout = (
            ShardedLayout(group, shard_group, bucket_bytes)
            if shard_group is not None
            else ProcessGroupLayout(group, bucket_bytes)
        )
        super().__init__(layout)
        self.group = group
        self.bucket_bytes = bucket_bytes

    @property
    def alone(self) -> bool:
        return self.num_workers == 1

    def average(
        self,
        tensors: Sequence[Tensor],
        kinds: Sequence[str],
        excluded: Sequence[int] = (),
        codecs: Sequence[Codec | None] | None = None,
    ) -> Averages:
        in_flight: list[tuple[list[int], InFlight]] = []
        sizes: list[tuple[str, int]] = []
        process_bytes = 0  # this process's part of what its worker sends
        for codec, indices in codec_groups(len(tensors), codecs):
            group, group_kinds = [tensors[i] for i in indices], [kinds[i] for i in indices]
            part: InFlight
            if codec is None:
                part = InFlightMean(group, self.group, self.bucket_bytes, excluded)
                sizes += [
                    (kind, self.layout.worker_bytes(t)) for t, kind in zip(group, group_kinds)
                ]
                process_bytes += sum(local_shard(t).numel() * t.element_size() for t in group)
            else:
                part = InFlightQuantizedMean(group, codec, self.group, excluded)
                parts = [self.layout.worker_parts(t) for t in group]
                group_sizes, sent = payload_sizes(
                    parts, group_kinds, codec, self.num_workers, self.layout.shard_rank
                )
                sizes += group_sizes
                process_bytes += sent
            in_flight.append((indices, part))
        collectives = sum(part.collectives for _, part in in_flight)
        sharded = self.layout.num_shards > 1
        num_bytes, collectives = self._account_sizes(
            sizes, collectives, process_bytes if sharded else None
        )
        return Averages(None, num_bytes, collectives, in_flight)

    def assign(self, tensors: Sequence[Tensor], values: Sequence[Tensor]) -> None:
        for tensor, value in zip(tensors, values):
            local_shard(tensor).copy_(value)

    def broadcast_from_first(self, tensors: Sequence[Tensor]) -> None:
        source = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        for tensor in tensors:
            dist.broadcast(local_shard(tensor), src=source, group=self.group)
