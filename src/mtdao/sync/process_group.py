"""Real workers: averaging over a ``torch.distributed`` process group (gloo on CPU, NCCL on GPU).

One worker per process; tensors due at one step travel in the bucketed all-reduce of
:mod:`mtdao.sync.collectives` (one flat buffer per device and dtype, split at ``bucket_bytes``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor

from mtdao.sync.collectives import DEFAULT_BUCKET_BYTES, all_reduce_mean
from mtdao.sync.communicator import Averages, Communicator
from mtdao.sync.layout import ProcessGroupLayout


class ProcessGroupWorkers(Communicator):
    """One worker per process of an initialized process group (``None``: the default group)."""

    layout: ProcessGroupLayout

    def __init__(
        self, group: dist.ProcessGroup | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ):
        super().__init__(ProcessGroupLayout(group, bucket_bytes))
        self.group = group
        self.bucket_bytes = bucket_bytes

    def average(
        self, tensors: Sequence[Tensor], kinds: Sequence[str], excluded: Sequence[int] = ()
    ) -> Averages:
        values, collectives = all_reduce_mean(tensors, self.group, self.bucket_bytes, excluded)
        num_bytes, collectives = self._account(tensors, kinds, collectives)
        return Averages(values, num_bytes, collectives)

    def broadcast_from_first(self, tensors: Sequence[Tensor]) -> None:
        source = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        for tensor in tensors:
            dist.broadcast(tensor, src=source, group=self.group)
