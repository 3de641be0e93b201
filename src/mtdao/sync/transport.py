"""How a round's bytes move: the three collectives a round needs, each returning work to wait on.

A round's mean is encoded and decoded in :mod:`.collectives` (float32) and :mod:`.exchange`
(quantized); what moves the encoded buffers between workers is a :class:`Transport`. Every
buffer is given as this process's *rows* ``[R, ...]``, one per worker it holds: one row in a
process group, all M rows in the simulator, so the same encoding code serves both.

* :meth:`Transport.all_reduce_sum`: a list of buffers (one bucket) summed over the workers that
  contribute (a worker left out adds zeros);
* :meth:`Transport.all_to_all`: chunk c of every worker's buffer to worker c;
* :meth:`Transport.all_gather`: every worker's buffer to every worker.

Implementations: :class:`GroupTransport` (a ``torch.distributed`` group: launched without
blocking), :class:`StackedTransport` (the simulator: tensors stacked along dim 0, moved by
indexing), and the torchft Manager's (:mod:`mtdao.ft.quorum`: collectives through
the manager, whose quorum and commit decide a round). A transport also says who contributes to a
round (:meth:`Transport.contributors`; the torchft one asks the others) and whether rounds may
overlap in flight (:attr:`Transport.rounds_overlap`; a manager runs one quorum at a time). The
worker layouts (:mod:`mtdao.sync.layout`) move their control values (a norm, a NaN verdict, one
loss per worker) through the same transports, blocking (:meth:`Transport.sum`,
:meth:`Transport.gather`), or, for the alignment diagnostic, launched and waited for when read
(:meth:`Transport.all_gather`): no module but this one and the torchft manager's runs a
collective of a round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor


class Work(Protocol):
    """A launched collective."""

    def wait(self) -> list[Tensor]:
        """Block until it completed; its outputs."""


class Done:
    """Work that completed when it was launched."""

    def __init__(self, outputs: list[Tensor]) -> None:
        self.outputs = outputs

    def wait(self) -> list[Tensor]:
        return self.outputs


class Then:
    """Work whose outputs are another work's, transformed once it completed."""

    def __init__(self, work: Work, transform) -> None:
        self.work, self.transform = work, transform

    def wait(self) -> list[Tensor]:
        return self.transform(self.work.wait())


class Launched:
    """A ``torch.distributed`` work handle and the buffers it writes."""

    def __init__(self, work, outputs: list[Tensor], after=None) -> None:
        self.work, self.outputs, self.after = work, outputs, after

    def wait(self) -> list[Tensor]:
        self.work.wait()
        if self.after is not None:
            self.outputs, self.after = self.after(self.outputs), None
        return self.outputs


def contributors(num_workers: int, excluded: Sequence[int]) -> list[int]:
    """The workers whose values count in a mean: all but ``excluded`` (one at least)."""
    kept = [w for w in range(num_workers) if w not in set(excluded)]
    if not kept:
        raise RuntimeError("Every worker was excluded from the average")
    return kept


class Transport:
    """The collectives of a round over ``num_workers`` workers, this process holding
    ``local_workers`` of them (its rows), the first of them worker ``rank``."""

    num_workers: int = 1
    local_workers: int = 1
    rank: int = 0
    bucket_bytes: float = float("inf")
    """The largest float32 bucket one all-reduce carries."""
    stacked = False
    """Whether a tensor here carries its workers along dim 0 (the simulator)."""
    rounds_overlap = True
    """Whether a round may start while another is in flight (False: each round settles, its
    commit decided, before the next one opens)."""

    def contributors(self, excluded: Sequence[int], contributes: bool = True) -> list[int]:
        """The workers whose values count in this call: those not ``excluded``; ``contributes``
        False leaves this process's workers out too (a transport where only they know it must
        ask the others)."""
        if not contributes:
            excluded = [*excluded, *range(self.rank, self.rank + self.local_workers)]
        return contributors(self.num_workers, excluded)

    def all_reduce_sum(self, buffers: Sequence[Tensor], counted: Sequence[int]) -> Work:
        """Each ``[R, n]`` buffer summed over the workers in ``counted``: ``[n]`` each (the
        buffers are inputs, left untouched)."""
        raise NotImplementedError

    def all_to_all(self, buffer: Tensor) -> Work:
        """``[R, M, ...]`` (chunk c of each local worker's buffer is for worker c) ->
        ``[R, M, ...]`` (each local worker's chunk from every worker, in worker order)."""
        raise NotImplementedError

    def all_gather(self, buffer: Tensor) -> Work:
        """``[R, ...]`` (each local worker's part) -> ``[M, ...]`` (every worker's part)."""
        raise NotImplementedError

    def sum(self, value: Tensor) -> Tensor:
        """This process's ``value`` summed over every worker, at once (control traffic: a
        layout's norms, verdicts and sums)."""
        every = range(self.num_workers)
        return self.all_reduce_sum([value.reshape(1, -1)], every).wait()[0].view(value.shape)

    def gather(self, value: Tensor) -> Tensor:
        """This process's ``value`` from every worker, at once: ``[M, *value.shape]``."""
        return self.all_gather(value.unsqueeze(0)).wait()[0]


class StackedTransport(Transport):
    """The simulator's: all M workers' rows are here, so a collective is a sum or a transpose."""

    stacked = True

    def __init__(self, num_workers: int) -> None:
        self.num_workers = self.local_workers = num_workers

    def all_reduce_sum(self, buffers: Sequence[Tensor], counted: Sequence[int]) -> Work:
        if len(counted) == self.num_workers:
            return Done([buffer.sum(dim=0) for buffer in buffers])
        index = torch.tensor(list(counted), device=buffers[0].device)
        return Done([buffer.index_select(0, index).sum(dim=0) for buffer in buffers])

    def all_to_all(self, buffer: Tensor) -> Work:
        return Done([buffer.transpose(0, 1)])

    def all_gather(self, buffer: Tensor) -> Work:
        return Done([buffer])


class GroupTransport(Transport):
    """A ``torch.distributed`` group (``None``: the default group), one worker per process (or
    per shard group: the group then joins the processes holding the same shard)."""

    def __init__(self, group: dist.ProcessGroup | None, bucket_bytes: float) -> None:
        self.group, self.bucket_bytes = group, bucket_bytes
        self.num_workers = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def all_reduce_sum(self, buffers: Sequence[Tensor], counted: Sequence[int]) -> Work:
        flat = flat_copy(buffers, self.rank in counted)
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return Launched(work, [flat], lambda outputs: split(outputs[0], buffers))

    def all_to_all(self, buffer: Tensor) -> Work:
        received = torch.empty_like(buffer[0])
        work = dist.all_to_all_single(received, buffer[0], group=self.group, async_op=True)
        return Launched(work, [received.unsqueeze(0)])

    def all_gather(self, buffer: Tensor) -> Work:
        part = buffer[0]
        gathered = part.new_empty((self.num_workers * part.shape[0], *part.shape[1:]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = gather(gathered, part, group=self.group, async_op=True)
        return Launched(work, [gathered.view(self.num_workers, *part.shape)])


def flat_copy(buffers: Sequence[Tensor], contributes: bool) -> Tensor:
    """One process's row of every buffer in one new flat buffer (zeros when it does not
    contribute): what an all-reduce of a bucket sends."""
    flat = torch.cat([buffer[0].reshape(-1) for buffer in buffers])
    if not contributes:
        flat.zero_()
    return flat


def split(flat: Tensor, buffers: Sequence[Tensor]) -> list[Tensor]:
    """A flat sum back into one ``[n]`` view per buffer."""
    values, offset = [], 0
    for buffer in buffers:
        numel = buffer[0].numel()
        values.append(flat[offset : offset + numel])
        offset += numel
    return values
