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

from mtdao.sync.collectives import DEFAULT_BUCKET_BYTES
from mtdao.sync.communicator import Communicator
from mtdao.sync.dtensors import local_shard
from mtdao.sync.layout import ProcessGroupLayout
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
        self.transport = self.layout.transport  # the layout's control values travel on it too

    @property
    def alone(self) -> bool:
        return self.num_workers == 1

    def assign(self, tensors: Sequence[Tensor], values: Sequence[Tensor]) -> None:
        for tensor, value in zip(tensors, values):
            local_shard(tensor).copy_(value)

    def broadcast_from_first(self, tensors: Sequence[Tensor]) -> None:
        source = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        for tensor in tensors:
            dist.broadcast(local_shard(tensor), src=source, group=self.group)
