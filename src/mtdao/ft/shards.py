"""Replica groups of several processes (FSDP2 inside a replica, torchft between replicas): what a
replica's processes must agree on goes through their shard group (docs/fault-tolerance.md)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class ReplicaProcesses:
    """The processes of this replica (its shard group; None: this process alone) and what they
    agree on."""

    def __init__(self, shard_group: dist.ProcessGroup | None = None) -> None:
        self.group = shard_group
        self.rank = dist.get_rank(shard_group) if shard_group is not None else 0
        self.size = dist.get_world_size(shard_group) if shard_group is not None else 1

    def from_first(self, value: Any) -> Any:
        """Group rank 0's ``value`` (picklable), in every process."""
        if self.size == 1:
            return value
        values = [value]
        source = dist.get_global_rank(self.group, 0)
        dist.broadcast_object_list(values, src=source, group=self.group)
        return values[0]

    def first_failure(self, failure: str | None) -> str | None:
        """None when no process of the replica saw a failure, else the first one's reason."""
        if self.size == 1:
            return failure
        failed = torch.tensor([int(failure is not None)])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.group)
        if not failed.item():
            return None
        reasons: list[str | None] = [None] * self.size
        dist.all_gather_object(reasons, failure, group=self.group)
        return next(reason for reason in reasons if reason is not None)

    def sum(self, number: int) -> int:
        if self.size == 1:
            return number
        total = torch.tensor([number], dtype=torch.int64)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        return int(total.item())
