"""The workers of a run: M simulated in one process, or this process as one of M real ones.

Both expose the same small surface to the training loop: parameters to optimize, per-worker
losses for a batch, per-worker gradient clipping, the global (averaged) model for evaluation, and
the communicator the sync engine uses.

The simulator stacks every parameter along a leading worker dimension and runs the model once per
step for all workers with ``torch.func.vmap`` over ``functional_call``; element-wise optimizers
then update every worker in one call, so M workers cost about M single-worker steps.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, vmap

from mtdao.sync.communicator import Communicator, SingleWorker
from mtdao.sync.simulated import SimulatedWorkers

# On CPU, vmap has no batching rule for the fused attention kernel and falls back to a loop over
# workers, which measured as fast as an explicit matmul attention; the warning is only noise.
warnings.filterwarnings("ignore", message=".*batching rule for aten::_scaled_dot_product.*")


def language_model_loss(model: nn.Module, params, buffers, inputs: Tensor, targets: Tensor):
    logits = functional_call(model, (params, buffers), (inputs,))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class WorkerSet:
    """What the training loop needs from the workers, whatever they run on."""

    communicator: Communicator
    num_workers: int
    rank: int
    autocast_dtype: torch.dtype | None = None

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        raise NotImplementedError

    def losses(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """Mean loss of each local worker on its batch: shape [local workers]."""
        raise NotImplementedError

    def global_model(self) -> nn.Module:
        """A model holding the average of the workers' parameters (for evaluation)."""
        raise NotImplementedError

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        device = self.named_parameters()[0][1].device.type
        return torch.autocast(device_type=device, dtype=self.autocast_dtype)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Scale each worker's gradients to norm <= max_norm; returns the norms before scaling."""
        grads = [p.grad for _, p in self.named_parameters() if p.grad is not None]
        squared = sum(self.communicator.per_worker_sum(g.float().square()) for g in grads)
        norms = squared.sqrt()
        if max_norm > 0:
            scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
            for g in grads:
                g.mul_(self._per_worker_view(scale, g).to(g.dtype))
        return norms

    def _per_worker_view(self, values: Tensor, like: Tensor) -> Tensor:
        return values.reshape(())


class SimulatedWorkerSet(WorkerSet):
    """M workers in one process; parameters have shape [M, *shape]."""

    def __init__(self, model: nn.Module, num_workers: int) -> None:
        self.template = model
        self.num_workers = num_workers
        self.rank = 0
        self.communicator = SimulatedWorkers(num_workers)
        # named_parameters() drops tied duplicates; functional_call re-ties them (tie_weights).
        self.params = {
            name: nn.Parameter(p.detach().unsqueeze(0).repeat(num_workers, *([1] * p.dim())))
            for name, p in model.named_parameters()
        }
        self.buffers = dict(model.named_buffers())
        self._vmapped_loss = vmap(
            lambda params, inputs, targets: language_model_loss(
                self.template, params, self.buffers, inputs, targets
            ),
            in_dims=(0, 0, 0),
            randomness="different",
        )

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.params.items())

    def losses(self, inputs: Tensor, targets: Tensor) -> Tensor:
        with self._autocast():
            return self._vmapped_loss(self.params, inputs, targets)

    def _per_worker_view(self, values: Tensor, like: Tensor) -> Tensor:
        return values.reshape([-1] + [1] * (like.dim() - 1))

    @torch.no_grad()
    def global_model(self) -> nn.Module:
        model = copy.deepcopy(self.template)
        averaged = {name: p.mean(dim=0) for name, p in self.params.items()}
        model.load_state_dict(averaged, strict=False)
        return model


class ProcessWorkerSet(WorkerSet):
    """This process is one worker; ``communicator`` reaches the others (or none at world size 1)."""

    def __init__(self, model: nn.Module, communicator: Communicator | None = None) -> None:
        self.model = model
        self.communicator = communicator or SingleWorker()
        self.num_workers = self.communicator.num_workers
        self.rank = self.communicator.rank

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.model.named_parameters())

    def losses(self, inputs: Tensor, targets: Tensor) -> Tensor:
        with self._autocast():
            logits = self.model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        return loss.reshape(1)

    @torch.no_grad()
    def global_model(self) -> nn.Module:
        if self.num_workers == 1:
            return self.model
        model = copy.deepcopy(self.model)
        params = [p for p in model.parameters()]
        averages = self.communicator.mean_uncounted(params)
        for p, average in zip(params, averages):
            p.copy_(average)
        return model
