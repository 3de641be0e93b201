"""Replica groups of several processes: FSDP2 inside a replica, torchft between replicas.

A replica of S processes shards its model (DTensor parameters and states); process s of every
replica holds the same slice. Each process has its own torchft ``Manager`` with the replica's id,
torchft's group rank s of S: the managers of one replica share one manager server (group rank 0
runs it, and the store the groups between replicas meet in), so the replica asks for one quorum,
heals process by process from the same process of a live peer, and commits a round only when
every one of its processes has (``should_commit``). Process s averages its shards with process s
of the other replicas, in a group of its own; so every replica needs the same number of
processes (checked before any group of a quorum forms:
:class:`~mtdao.ft.plumbing.MembershipGloo`).

What the processes of one replica must agree on between themselves goes through their shard
group (:class:`ReplicaProcesses`): that a round failed, as soon as any of them sees a collective
fail (they then all discard it at the same point, not one of them going on into the next
collective alone), the heal's size, and the sums over a worker of the layout
(:class:`~mtdao.ft.replicas.ShardedReplicaLayout`). A replica of one process has none
of this: every agreement is its own value.
"""

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
