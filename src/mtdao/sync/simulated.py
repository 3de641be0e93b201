"""M workers simulated in one process: every tensor carries a leading worker dimension.

Worker w's copy of a parameter of shape S is ``tensor[w]`` of a tensor of shape [M, *S]; an
average over workers is a mean over dim 0. Element-wise optimizers (Adam, ADOPT, SGD and their
MT-DAO forms) run unchanged on such stacked tensors, so one optimizer step updates every worker.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from mtdao.sync.communicator import Communicator, dtype_buckets


class SimulatedWorkers(Communicator):
    """In-process communicator over tensors stacked along dim 0 (deterministic)."""

    def __init__(self, num_workers: int) -> None:
        super().__init__()
        if num_workers < 1:
            raise ValueError(f"Invalid number of workers: {num_workers} (must be >= 1)")
        self.num_workers = num_workers

    def _check(self, tensor: Tensor) -> None:
        if tensor.dim() == 0 or tensor.shape[0] != self.num_workers:
            raise ValueError(
                f"Simulated tensors need a leading worker dimension of {self.num_workers}, "
                f"got shape {tuple(tensor.shape)}"
            )

    def mean(
        self, tensors: Sequence[Tensor], kinds: Sequence[str], excluded: Sequence[int] = ()
    ) -> list[Tensor]:
        for tensor in tensors:
            self._check(tensor)
        self._record(tensors, kinds, collectives=len(dtype_buckets(tensors)))
        if not excluded:
            return [tensor.mean(dim=0) for tensor in tensors]
        keep = [w for w in range(self.num_workers) if w not in set(excluded)]
        if not keep:
            raise RuntimeError("Every worker was excluded from the average")
        index = torch.tensor(keep, device=tensors[0].device)
        return [tensor.index_select(0, index).mean(dim=0) for tensor in tensors]

    def assign(self, tensors: Sequence[Tensor], values: Sequence[Tensor]) -> None:
        for tensor, value in zip(tensors, values):
            tensor.copy_(value.unsqueeze(0).expand_as(tensor))

    def first_non_finite(self, tensors: Sequence[Tensor]) -> dict[int, int]:
        found: dict[int, int] = {}
        for index, tensor in enumerate(tensors):
            finite = torch.isfinite(tensor.reshape(self.num_workers, -1)).all(dim=1)
            for worker in (~finite).nonzero().flatten().tolist():
                found.setdefault(worker, index)
        return found

    def gather_scalars(self, values: Tensor) -> Tensor:
        return values.reshape(self.num_workers)

    def global_copy(self, tensor: Tensor) -> Tensor:
        self._check(tensor)
        return tensor[0].detach().clone()

    def per_worker_sum(self, tensor: Tensor) -> Tensor:
        return tensor.reshape(self.num_workers, -1).sum(dim=1)

    def broadcast_from_first(self, tensors: Sequence[Tensor]) -> None:
        for tensor in tensors:
            self._check(tensor)
            tensor.copy_(tensor[:1].expand_as(tensor))

    def bytes_per_worker(self, tensor: Tensor) -> int:
        return tensor[0].numel() * tensor.element_size()
