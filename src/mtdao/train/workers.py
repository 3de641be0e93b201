"""The workers of a run: M simulated in one process, or this process as one of M real ones, with the
same small surface for the training loop. Where each worker's copy lives is the communicator's
layout (:mod:`mtdao.sync.layout`)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtdao.data import WorkerShard, stacked_batches
from mtdao.model.stacked_workers import stack_workers
from mtdao.sync.layout import WorkerLayout


def language_model_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy (computed in float32 whatever the autocast dtype)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class WorkerSet:
    """What the training loop needs from the workers, whatever they run on."""

    layout: WorkerLayout
    autocast_dtype: torch.dtype | None = None

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        raise NotImplementedError

    def next_batch(
        self, shards: Sequence[WorkerShard], device: torch.device
    ) -> tuple[Tensor, Tensor]:
        """(inputs, targets) of the next step on ``device``, each local worker's batch from its
        own data shard, as :meth:`losses` takes them: here one worker, this process."""
        inputs, targets = shards[0].next_batch()
        return inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)

    def losses(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """Mean loss of each local worker on its batch: shape [local workers]."""
        raise NotImplementedError

    def global_model(self, excluded: Sequence[int] = ()) -> nn.Module:
        """A model holding the average of the workers' parameters (for evaluation), leaving out
        the workers in ``excluded``."""
        raise NotImplementedError

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        device = self.named_parameters()[0][1].device.type
        return torch.autocast(device_type=device, dtype=self.autocast_dtype)

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Scale each worker's gradients to norm <= max_norm; returns the norms before scaling."""
        grads = [p.grad for _, p in self.named_parameters() if p.grad is not None]
        return self.layout.clip_grad_norm_(grads, max_norm)


class SimulatedWorkerSet(WorkerSet):
    """M workers in one process; parameters have shape [M, *shape]."""

    def __init__(self, model: nn.Module, layout: WorkerLayout) -> None:
        self.layout = layout
        self.stacked = stack_workers(model, layout.num_workers)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.stacked.named_parameters())

    def next_batch(
        self, shards: Sequence[WorkerShard], device: torch.device
    ) -> tuple[Tensor, Tensor]:
        """Every worker's batch, stacked along a leading worker dim: two [M, B, T] tensors."""
        inputs, targets = stacked_batches(shards)
        return inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)

    def losses(self, inputs: Tensor, targets: Tensor) -> Tensor:
        with self.autocast():
            return self.stacked.losses(language_model_loss, inputs, targets)

    @torch.no_grad()
    def global_model(self, excluded: Sequence[int] = ()) -> nn.Module:
        if not excluded:
            return self.stacked.average()
        model = copy.deepcopy(self.stacked.template)
        names, params = zip(*self.named_parameters())
        model.load_state_dict(
            dict(zip(names, self.layout.global_mean(params, excluded))), strict=False
        )
        return model


class ProcessWorkerSet(WorkerSet):
    """This process is one worker; the layout reaches the others (or none at world size 1)."""

    def __init__(self, model: nn.Module, layout: WorkerLayout) -> None:
        self.model = model
        self.layout = layout

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.model.named_parameters())

    def losses(self, inputs: Tensor, targets: Tensor) -> Tensor:
        with self.autocast():
            logits = self.model(inputs)
        return language_model_loss(logits, targets).reshape(1)

    @torch.no_grad()
    def global_model(self, excluded: Sequence[int] = ()) -> nn.Module:
        if self.layout.num_workers == 1:
            return self.model
        model = copy.deepcopy(self.model)
        params = list(model.parameters())
        for p, average in zip(params, self.layout.global_mean(params, excluded)):
            p.copy_(average)
        return model
