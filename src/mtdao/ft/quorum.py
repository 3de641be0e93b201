"""A replica's torchft Manager and its current quorum: what a round's collectives run in."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import Tensor

from mtdao.ft.collective_watch import CollectiveWatch
from mtdao.ft.identity import ReplicaIdentity
from mtdao.ft.lines import first_line, to_stderr
from mtdao.ft.plumbing import MembershipGloo
from mtdao.ft.security.torchft_internals import Manager
from mtdao.ft.shards import ReplicaProcesses
from mtdao.sync.communicator import RoundNotCommitted


class Quorum:
    """This replica's manager (None until it connects) and the quorum it last formed, in
    ``group`` (its members, in rank order), over this replica's ``processes``."""

    def __init__(
        self, group: MembershipGloo, identity: ReplicaIdentity, processes: ReplicaProcesses
    ) -> None:
        self.manager: Manager | None = None
        self.group, self.identity = group, identity
        self.processes = processes
        self.open = False  # whether a round is open: between its quorum and its commit
        self.prepared: int | None = None  # the step whose round the open quorum is for
        self.unreachable: str | None = None  # why no quorum can form now (lighthouse away)
        self.discarded: str | None = None  # why the open quorum's round ended before it began
        self.before_collective: Callable[[], None] | None = None  # a fault drill's hook
        self.collectives = CollectiveWatch(say=to_stderr)

    @property
    def members(self) -> list[int]:
        """The replica ids of the quorum, in rank order."""
        return self.identity.quorum.replicas

    @property
    def size(self) -> int:
        return max(1, len(self.members))

    @property
    def rank(self) -> int:
        """This replica's rank in the quorum."""
        return self.identity.quorum.rank

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

    def sum(self, flat: Tensor) -> Tensor:
        """``flat`` summed over the quorum now; a failure discards the round."""
        if self.before_collective is not None:
            self.before_collective()
        self.require_open()
        work = self.manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM)
        return ManagerWork(self, work, [flat]).wait()[0]

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
