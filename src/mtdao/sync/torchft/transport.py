"""The collectives of a round through a torchft Manager: the transport of a fault-tolerant replica.

The same three collectives as any transport (:mod:`mtdao.sync.transport`), run in the process
group of the manager's current quorum: the all-reduce through ``Manager.allreduce``, the
all-to-all and all-gather of a quantized exchange on the manager's group. A collective that fails
is reported to the manager, so its round is not committed; the wait that sees the failure (in
any process of a sharded replica: they agree through their shard group) discards the round at
once, before anything decoded from it is checked or applied.

The manager runs one quorum and one commit at a time, so rounds do not overlap in flight
(``rounds_overlap`` False): the engine settles a round in flight before the next one's quorum.
Who contributes to a call is agreed by the replicas themselves (one small all-reduce), since
only a replica knows whether it was healed at this round's quorum.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import AllgatherOptions, AllToAllOptions

from mtdao.sync.transport import Transport, Work, contributors, flat_copy, split

if TYPE_CHECKING:
    from mtdao.sync.torchft.replicas import ReplicaGroups


class ManagerTransport(Transport):
    """Collectives of a round in the quorum of ``replicas``' manager."""

    rounds_overlap = False

    def __init__(self, replicas: ReplicaGroups) -> None:
        self.replicas = replicas

    @property
    def num_workers(self) -> int:  # type: ignore[override]
        return max(1, len(self.replicas.replicas))

    @property
    def rank(self) -> int:  # type: ignore[override]
        return self.replicas.quorum_rank

    @property
    def bucket_bytes(self) -> float:  # type: ignore[override]
        return self.replicas.settings.bucket_bytes

    def contributors(self, excluded: Sequence[int], contributes: bool = True) -> list[int]:
        flags = torch.zeros(self.num_workers, dtype=torch.float64)
        if contributes and self.rank not in set(excluded):
            flags[self.rank] = 1.0
        summed = self.replicas.sum_in_round(flags)  # a round's first collective
        counted = [w for w, flag in enumerate(summed.tolist()) if flag > 0.5]
        if not counted:
            self.replicas.fail("no replica contributed to the average")
        left_out = [w for w in range(self.num_workers) if w not in counted]
        return contributors(self.num_workers, left_out)

    def sum(self, flat: Tensor) -> Tensor:
        """``flat`` summed over the quorum now (blocking)."""
        self.replicas.require_round()
        work = self.replicas.manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM)
        return ManagerWork(self, work, [flat]).wait()[0]

    def all_reduce_sum(self, buffers: Sequence[Tensor], counted: Sequence[int]) -> Work:
        self.replicas.require_round()
        flat = flat_copy(buffers, self.rank in counted)
        work = self.replicas.manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM)
        return ManagerWork(self, work, [flat], lambda outputs: split(outputs[0], buffers))

    def all_to_all(self, buffer: Tensor) -> Work:
        received = torch.zeros_like(buffer[0])
        group = self.replicas.process_group
        launch = lambda: group.alltoall_base(received, buffer[0], [], [], AllToAllOptions())  # noqa: E731
        return self._launch(launch, [received.unsqueeze(0)])

    def all_gather(self, buffer: Tensor) -> Work:
        gathered = buffer.new_zeros((self.num_workers, *buffer.shape[1:]))
        group = self.replicas.process_group
        outputs = [list(gathered.unbind(0))]
        launch = lambda: group.allgather(outputs, [buffer[0]], AllgatherOptions())  # noqa: E731
        return self._launch(launch, [gathered])

    def _launch(self, launch, outputs: list[Tensor]) -> Work:
        """A collective on the manager's group; nothing is launched once the round has failed
        (its outputs stay zeros, and the wait discards the round)."""
        self.replicas.require_round()
        manager = self.replicas.manager
        if manager.errored() is not None:
            return ManagerWork(self, None, outputs)
        try:
            work = launch()
        except Exception as error:  # a group already broken by a lost peer
            manager.report_error(error)
            work = None
        return ManagerWork(self, work, outputs)

    def check(self) -> None:
        """Discard the round now if any collective of it failed (in any process of the replica)."""
        replicas = self.replicas
        failure = replicas.failure() if replicas.manager.errored() is not None else None
        failure = replicas.processes.first_failure(failure)  # every process of the replica stops
        if failure is not None:
            replicas.fail(failure)


class ManagerWork:
    """A launched collective of a round: waiting reports a failure to the manager, then checks
    the round (raising ``RoundNotCommitted`` when it failed)."""

    def __init__(self, transport: ManagerTransport, work, outputs: list[Tensor], after=None):
        self.transport, self.work, self.outputs, self.after = transport, work, outputs, after
        self.done = False

    def wait(self) -> list[Tensor]:
        if self.done:
            return self.outputs
        if self.work is not None:
            try:
                self.work.wait()
            except Exception as error:
                self.transport.replicas.manager.report_error(error)
        self.done = True
        self.transport.check()
        if self.after is not None:
            self.outputs, self.after = self.after(self.outputs), None
        return self.outputs
