"""M workers simulated in one process: every tensor carries a leading worker dimension.

Worker w's copy of a parameter of shape S is ``tensor[w]`` of a tensor of shape [M, *S]; an
average over workers is a mean over dim 0. Element-wise optimizers (Adam, ADOPT, SGD and their
MT-DAO forms) run unchanged on such stacked tensors, so one optimizer step updates every worker.

:class:`SimulatedWorkers` averages such tensors. The model side, turning an ordinary module into
M such workers (:func:`~mtdao.model.stacked_workers.stack_workers`, re-exported as
``mtdao.sync.stack_workers``), lives with the models: the engine knows no model.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from mtdao.sync.codecs.quantize import Codec
from mtdao.sync.communicator import Averages, Communicator
from mtdao.sync.layout import StackedLayout
from mtdao.sync.transport import StackedTransport


class SimulatedWorkers(Communicator):
    """In-process communicator over tensors stacked along dim 0 (deterministic)."""

    layout: StackedLayout

    def __init__(self, num_workers: int) -> None:
        super().__init__(StackedLayout(num_workers))
        self.transport = StackedTransport(num_workers)

    @property
    def alone(self) -> bool:
        return self.num_workers == 1

    def average(
        self,
        tensors: Sequence[Tensor],
        kinds: Sequence[str],
        excluded: Sequence[int] = (),
        codecs: Sequence[Codec | None] | None = None,
    ) -> Averages:
        for tensor in tensors:
            self.layout.check(tensor)
        averages = super().average(tensors, kinds, excluded, codecs)
        averages.wait()  # nothing travels: complete at once
        return averages

    def assign(self, tensors: Sequence[Tensor], values: Sequence[Tensor]) -> None:
        for tensor, value in zip(tensors, values):
            tensor.copy_(value.unsqueeze(0).expand_as(tensor))

    def broadcast_from_first(self, tensors: Sequence[Tensor]) -> None:
        for tensor in tensors:
            self.layout.check(tensor)
            tensor.copy_(tensor[:1].expand_as(tensor))
