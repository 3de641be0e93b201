"""How bytes move between workers, behind one narrow interface.

A communicator averages a list of tensors over workers. Three implementations:

* :class:`SingleWorker` - world size 1, nothing to send;
* :class:`mtdao.sync.simulated.SimulatedWorkers` - M workers in one process, each tensor stacked
  along a leading worker dimension;
* :class:`mtdao.sync.process_group.ProcessGroupWorkers` - a ``torch.distributed`` process group
  (gloo on CPU, NCCL on GPU).

Averaging is split in two so that the engine can inspect the result before it is written back:
``mean`` returns the averages without touching the inputs, ``assign`` writes them back. A
non-finite value in a worker's tensor is thus caught before it replaces anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class Traffic:
    """Bytes and collectives sent by one worker (payload of averaging collectives only)."""

    collectives: int = 0
    bytes: int = 0
    rounds: int = 0
    bytes_by_kind: dict[str, int] = field(default_factory=dict)

    def record_round(self, sizes: Sequence[tuple[str, int]], collectives: int) -> None:
        """One round of averaging: (kind, bytes) per tensor, sent in ``collectives`` calls."""
        for kind, num_bytes in sizes:
            self.bytes += num_bytes
            self.bytes_by_kind[kind] = self.bytes_by_kind.get(kind, 0) + num_bytes
        self.collectives += collectives
        self.rounds += 1

    def state_dict(self) -> dict:
        return {
            "collectives": self.collectives,
            "bytes": self.bytes,
            "rounds": self.rounds,
            "bytes_by_kind": dict(self.bytes_by_kind),
        }

    def load_state_dict(self, state: dict) -> None:
        self.collectives = int(state["collectives"])
        self.bytes = int(state["bytes"])
        self.rounds = int(state["rounds"])
        self.bytes_by_kind = {str(k): int(v) for k, v in state["bytes_by_kind"].items()}


class Communicator:
    """Averages tensors over ``num_workers`` workers and counts what that costs each worker."""

    num_workers: int = 1
    rank: int = 0

    def __init__(self) -> None:
        self.traffic = Traffic()

    # A "global" tensor is one value shared by all workers: the shape of one worker's tensor.
    def mean(
        self, tensors: Sequence[Tensor], kinds: Sequence[str], excluded: Sequence[int] = ()
    ) -> list[Tensor]:
        """Global averages of ``tensors`` over workers (leaving out ``excluded``), one round.

        ``kinds`` labels each tensor for the traffic account (``params``, ``exp_avg_0``, ...).
        """
        raise NotImplementedError

    def mean_uncounted(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """:meth:`mean` for evaluation and logging, left out of the traffic account."""
        saved = self.traffic.state_dict()
        averages = self.mean(tensors, ["uncounted"] * len(tensors))
        self.traffic.load_state_dict(saved)
        return averages

    def assign(self, tensors: Sequence[Tensor], values: Sequence[Tensor]) -> None:
        """Set every worker's copy of each tensor to the matching global value."""
        for tensor, value in zip(tensors, values):
            tensor.copy_(value)

    def first_non_finite(self, tensors: Sequence[Tensor]) -> dict[int, int]:
        """{worker: index of its first tensor holding NaN/inf} for every worker that has one."""
        raise NotImplementedError

    def global_copy(self, tensor: Tensor) -> Tensor:
        """A copy of a tensor that all workers hold identically, in global shape."""
        return tensor.detach().clone()

    def per_worker_sum(self, tensor: Tensor) -> Tensor:
        """Sum of each local worker's slice: shape [1] here, [M] in the simulator."""
        return tensor.sum().reshape(1)

    def gather_scalars(self, values: Tensor) -> Tensor:
        """Per-worker scalars [num_workers] from each worker's value (control traffic, uncounted)."""
        raise NotImplementedError

    def broadcast_from_first(self, tensors: Sequence[Tensor]) -> None:
        """Make every worker start from worker 0's values (set-up traffic, uncounted)."""

    def _record(self, tensors: Sequence[Tensor], kinds: Sequence[str], collectives: int) -> None:
        sizes = [(kind, self.bytes_per_worker(tensor)) for tensor, kind in zip(tensors, kinds)]
        self.traffic.record_round(sizes, collectives)

    def bytes_per_worker(self, tensor: Tensor) -> int:
        return tensor.numel() * tensor.element_size()


class SingleWorker(Communicator):
    """World size 1: every average is the tensor itself and nothing is sent."""

    def mean(
        self, tensors: Sequence[Tensor], kinds: Sequence[str], excluded: Sequence[int] = ()
    ) -> list[Tensor]:
        return list(tensors)

    def assign(self, tensors: Sequence[Tensor], values: Sequence[Tensor]) -> None:
        # An average is the tensor itself; an outer step's new parameters are not.
        for tensor, value in zip(tensors, values):
            if value is not tensor:
                tensor.copy_(value)

    def first_non_finite(self, tensors: Sequence[Tensor]) -> dict[int, int]:
        for index, tensor in enumerate(tensors):
            if not torch.isfinite(tensor).all():
                return {0: index}
        return {}

    def gather_scalars(self, values: Tensor) -> Tensor:
        return values.reshape(1)


def dtype_buckets(tensors: Sequence[Tensor]) -> dict[tuple, list[int]]:
    """Indices of ``tensors`` grouped by (device, dtype): one flat buffer per group."""
    buckets: dict[tuple, list[int]] = {}
    for index, tensor in enumerate(tensors):
        buckets.setdefault((tensor.device, tensor.dtype), []).append(index)
    return buckets
