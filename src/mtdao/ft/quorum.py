"""A replica's torchft Manager and its current quorum: the transport of a round's collectives. One
quorum and one commit at a time, so rounds do not overlap in flight; a failed collective discards
its round."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import AllgatherOptions, AllToAllOptions

from mtdao.ft.collective_watch import CollectiveWatch
from mtdao.ft.identity import ReplicaIdentity
from mtdao.ft.lines import first_line, to_stderr
from mtdao.ft.security.torchft_internals import GlooGroup, Manager
from mtdao.ft.shards import ReplicaProcesses
from mtdao.sync.communicator import RoundNotCommitted
from mtdao.sync.transport import Transport, Work, contributors, flat_copy, split


class Quorum(Transport):
    """This replica's manager (None until it connects) and the quorum it last formed, in
    ``group`` (its members, in rank order), over this replica's ``processes``; float32 buckets
    of at most ``bucket_bytes``."""

    rounds_overlap = False

    def __init__(
        self,
        group: GlooGroup,
        identity: ReplicaIdentity,
        processes: ReplicaProcesses,
        bucket_bytes: float,
    ) -> None:
        self.manager: Manager | None = None
        self.group, self.identity = group, identity
        self.processes, self.bucket_bytes = processes, bucket_bytes
        self.open = False  # whether a round is open: between its quorum and its commit
        self.prepared: int | None = None  # the step whose round the open quorum is for
        self.unreachable: str | None = None  # why no quorum can form now (lighthouse away)
        self.discarded: str | None = None  # why the open quorum's round ended before it began
        self.before_collective: Callable[[], None] | None = None  # a fault drill's hook
        self.collectives = CollectiveWatch(say=to_stderr)

    @property
    def members(self) -> list[int]:
        """The replica ids of the quorum, in rank order."""
        return self.identity.members

    @property
    def num_workers(self) -> int:  # type: ignore[override]
        return max(1, len(self.members))

    @property
    def rank(self) -> int:  # type: ignore[override]
        """This replica's rank in the quorum."""
        return self.identity.rank

    def require_open(self) -> None:
        """Raise unless a round is open (a discard while the lighthouse is away)."""
        if self.unreachable is not None:
            raise RoundNotCommitted(f"no round: {self.unreachable}")
        if self.discarded is not None:
            self.prepared = None  # a round formed again (the final one) needs a new quorum
            raise RoundNotCommitted(self.discarded)
        if not self.open:
            raise RuntimeError(
                "no round in progress: the engine prepares each round's quorum before the step "
                "that opens it (LocalUpdateSync.prepare; attached() does it)"
            )

    def sum(self, value: Tensor) -> Tensor:
        """``value`` summed over the quorum now (after the before-collective hook); a failure
        discards the round."""
        if self.before_collective is not None:
            self.before_collective()
        self.require_open()
        flat = value.reshape(-1)
        work = self.manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM)
        return ManagerWork(self, work, [flat]).wait()[0].view(value.shape)

    def contributors(self, excluded: Sequence[int], contributes: bool = True) -> list[int]:
        flags = torch.zeros(self.num_workers, dtype=torch.float64)
        if contributes and self.rank not in set(excluded):
            flags[self.rank] = 1.0
        summed = self.sum(flags)  # a round's first collective
        counted = [w for w, flag in enumerate(summed.tolist()) if flag > 0.5]
        if not counted:
            self.fail("no replica contributed to the average")
        left_out = [w for w in range(self.num_workers) if w not in counted]
        return contributors(self.num_workers, left_out)

    def all_reduce_sum(self, buffers: Sequence[Tensor], counted: Sequence[int]) -> Work:
        self.require_open()
        flat = flat_copy(buffers, self.rank in counted)
        work = self.manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM)
        return ManagerWork(self, work, [flat], lambda outputs: split(outputs[0], buffers))

    def all_to_all(self, buffer: Tensor) -> Work:
        received = torch.zeros_like(buffer[0])
        args = (received, buffer[0], [], [], AllToAllOptions())
        return self._launch(lambda: self.group.alltoall_base(*args), [received.unsqueeze(0)])

    def all_gather(self, buffer: Tensor) -> Work:
        gathered = buffer.new_zeros((self.num_workers, *buffer.shape[1:]))
        args = ([list(gathered.unbind(0))], [buffer[0]], AllgatherOptions())
        return self._launch(lambda: self.group.allgather(*args), [gathered])

    def _launch(self, launch, outputs: list[Tensor]) -> Work:
        """A collective on the quorum's group; nothing is launched once the round has failed
        (its outputs stay zeros, and the wait discards the round)."""
        self.require_open()
        if self.manager.errored() is not None:
            return ManagerWork(self, None, outputs)
        try:
            work = launch()
        except Exception as error:  # a group already broken by a lost peer
            self.manager.report_error(error)
            work = None
        return ManagerWork(self, work, outputs)

    def wait_for(self, work) -> None:
        """Wait for a collective of the open round, watched (see :mod:`.collective_watch`)."""
        what = f"the round of the quorum at step {self.identity.training_step}"
        self.collectives.wait(work, what, self.identity.peers)

    def check(self) -> None:
        """Discard the round now if any collective of it failed in any process of the replica."""
        failure = self.failure() if self.manager.errored() is not None else None
        failure = self.processes.first_failure(failure)  # every process of the replica stops
        if failure is not None:
            self.fail(failure)

    def fail(self, reason: str) -> None:
        """Tell torchft the round failed (the next quorum rebuilds the group), then raise."""
        self.manager.report_error(RuntimeError(reason))
        self.open, self.prepared = False, None  # a retried step needs a new quorum
        self.manager.should_commit()
        raise RoundNotCommitted(f"round discarded ({reason})")

    def commit(self) -> None:
        """torchft's ``should_commit``: raise ``RoundNotCommitted`` unless the round stands."""
        if not self.open:  # a round restored from a checkpoint: its quorum is gone
            raise RoundNotCommitted("round discarded (its quorum ended before it committed)")
        self.open = False
        if not self.manager.should_commit():
            self.prepared = None
            raise RoundNotCommitted(f"round discarded ({self.failure()})")

    def failure(self) -> str:
        error = self.manager.errored()
        if error is None:
            return "too few replicas"
        return first_line(error.original_exception)


class ManagerWork:
    """A launched collective of a round: its wait reports a failure, then checks the round."""

    def __init__(self, quorum: Quorum, work, outputs: list[Tensor], after=None):
        self.quorum, self.work, self.outputs, self.after = quorum, work, outputs, after
        self.done = False

    def wait(self) -> list[Tensor]:
        if self.done:
            return self.outputs
        if self.work is not None:
            try:
                self.quorum.wait_for(self.work)  # watched: see collective_watch
            except Exception as error:
                self.quorum.manager.report_error(error)
        self.done = True
        self.quorum.check()
        if self.after is not None:
            self.outputs, self.after = self.after(self.outputs), None
        return self.outputs
