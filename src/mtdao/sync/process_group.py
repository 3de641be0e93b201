"""Real workers: averaging over a ``torch.distributed`` process group (gloo on CPU, NCCL on GPU).

One worker per process, or per group of processes sharding its tensors (FSDP2, ``shard_group``);
float32 tensors due at one step travel in the bucketed all-reduce of :mod:`mtdao.sync.collectives`
(one flat buffer per device and dtype, split at ``bucket_bytes``; a sharded tensor as its local
shard), quantized ones in the exchange of :mod:`mtdao.sync.exchange`. Both are launched without
blocking: the :class:`Averages` returned holds them in flight until ``wait()``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor

from mtdao.sync.collectives import DEFAULT_BUCKET_BYTES, InFlightMean
from mtdao.sync.communicator import Averages, Communicator, InFlight, codec_groups
from mtdao.sync.dtensors import local_shard
from mtdao.sync.exchange import InFlightQuantizedMean
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

    def average(
        self,
        tensors: Sequence[Tensor],
        kinds: Sequence[str],
        excluded: Sequence[int] = (),
        codecs: Sequence[Codec | None] | None = None,
    ) -> Averages:
        in_flight: list[tuple[list[int], InFlight]] = []
        sizes: list[tuple[str, int]] = []
        for codec, indices in codec_groups(len(tensors), codecs):
            group = [tensors[i] for i in indices]
            part: InFlight
            if codec is None:
                part = InFlightMean(group, self.group, self.bucket_bytes, excluded)
                sizes += [(kinds[i], self.layout.worker_bytes(tensors[i])) for i in indices]
            else:
                part = InFlightQuantizedMean(group, codec, self.group, excluded)
                sizes += part.layout.kind_bytes([kinds[i] for i in indices], codec)
            in_flight.append((indices, part))
        collectives = sum(part.collectives for _, part in in_flight)
        num_bytes, collectives = self._account_sizes(sizes, collectives)
        return Averages(None, num_bytes, collectives, in_flight)

    def assign(self, tensors: Sequence[Tensor], values: Sequence[Tensor]) -> None:
        for tensor, value in zip(tensors, values):
            local_shard(tensor).copy_(value)

    def broadcast_from_first(self, tensors: Sequence[Tensor]) -> None:
        source = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        for tensor in tensors:
            dist.broadcast(local_shard(tensor), src=source, group=self.group)
