"""The collectives of a round through a torchft Manager's quorum; one quorum and one commit at a
time, so rounds do not overlap in flight, and a failed collective discards its round."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import AllgatherOptions, AllToAllOptions

from mtdao.ft.quorum import ManagerWork, Quorum
from mtdao.sync.transport import Transport, Work, contributors, flat_copy, split


class ManagerTransport(Transport):
    """Collectives of a round in ``quorum`` (a torchft manager's current quorum), float32
    buckets of at most ``bucket_bytes``."""

    rounds_overlap = False

    def __init__(self, quorum: Quorum, bucket_bytes: float) -> None:
        self.quorum, self.bucket_bytes = quorum, bucket_bytes

    @property
    def num_workers(self) -> int:  # type: ignore[override]
        return self.quorum.size

    @property
    def rank(self) -> int:  # type: ignore[override]
        return self.quorum.rank

    def contributors(self, excluded: Sequence[int], contributes: bool = True) -> list[int]:
        flags = torch.zeros(self.num_workers, dtype=torch.float64)
        if contributes and self.rank not in set(excluded):
            flags[self.rank] = 1.0
        summed = self.quorum.sum(flags)  # a round's first collective
        counted = [w for w, flag in enumerate(summed.tolist()) if flag > 0.5]
        if not counted:
            self.quorum.fail("no replica contributed to the average")
        left_out = [w for w in range(self.num_workers) if w not in counted]
        return contributors(self.num_workers, left_out)

    def sum(self, value: Tensor) -> Tensor:
        """``value`` summed over the quorum now (blocking, before-collective hook included)."""
        return self.quorum.sum(value.reshape(-1)).view(value.shape)

    def all_reduce_sum(self, buffers: Sequence[Tensor], counted: Sequence[int]) -> Work:
        self.quorum.require_open()
        flat = flat_copy(buffers, self.rank in counted)
        work = self.quorum.manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM)
        return ManagerWork(self.quorum, work, [flat], lambda outputs: split(outputs[0], buffers))

    def all_to_all(self, buffer: Tensor) -> Work:
        received = torch.zeros_like(buffer[0])
        group = self.quorum.group
        launch = lambda: group.alltoall_base(received, buffer[0], [], [], AllToAllOptions())  # noqa: E731
        return self._launch(launch, [received.unsqueeze(0)])

    def all_gather(self, buffer: Tensor) -> Work:
        gathered = buffer.new_zeros((self.num_workers, *buffer.shape[1:]))
        group = self.quorum.group
        outputs = [list(gathered.unbind(0))]
        launch = lambda: group.allgather(outputs, [buffer[0]], AllgatherOptions())  # noqa: E731
        return self._launch(launch, [gathered])

    def _launch(self, launch, outputs: list[Tensor]) -> Work:
        """A collective on the quorum's group; nothing is launched once the round has failed
        (its outputs stay zeros, and the wait discards the round)."""
        self.quorum.require_open()
        manager = self.quorum.manager
        if manager.errored() is not None:
            return ManagerWork(self.quorum, None, outputs)
        try:
            work = launch()
        except Exception as error:  # a group already broken by a lost peer
            manager.report_error(error)
            work = None
        return ManagerWork(self.quorum, work, outputs)
