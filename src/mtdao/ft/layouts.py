"""Where a replica's copy lives: one worker of the current quorum, its control values moving
through the quorum inside a round (nothing is coordinated between rounds)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from mtdao.ft.quorum import Quorum
from mtdao.sync.collectives import InFlightMean
from mtdao.sync.layout import WorkerLayout
from mtdao.sync.sharded_layout import ShardGroupSums


class ReplicaLayout(WorkerLayout):
    """This replica among its quorum; its gathers belong to the round in progress."""

    def __init__(self, transport: Quorum) -> None:
        self.transport = transport

    @property
    def num_workers(self) -> int:  # type: ignore[override]
        return self.transport.num_workers

    @property
    def rank(self) -> int:  # type: ignore[override]
        return self.transport.rank

    def gather(self, values: Tensor) -> Tensor:
        """Inside a round, every replica's value; between rounds (no coordination) this
        replica's own, and NaN for the others."""
        in_round = self.transport.open
        slots = torch.full((self.num_workers,), 0.0 if in_round else float("nan"))
        slots = slots.to(dtype=torch.float64, device=values.device)
        slots[self.rank] = values.reshape(()).to(torch.float64)
        return self.transport.sum(slots) if in_round else slots

    def global_mean(self, tensors: Sequence[Tensor], excluded: Sequence[int] = ()) -> list[Tensor]:
        return InFlightMean(tensors, self.transport, excluded).wait()


class ShardedReplicaLayout(ShardGroupSums, ReplicaLayout):
    """A replica of ``shard_group``'s processes: a sum over a worker adds its shards first."""

    def __init__(self, transport: Quorum, shard_group: dist.ProcessGroup) -> None:
        super().__init__(transport)
        self._join_shard_group(shard_group)
