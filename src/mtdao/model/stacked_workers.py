"""M copies of a module as one module, for workers simulated in one process: each parameter gets a
leading worker dimension (worker w's copy is ``tensor[w]``, the layout
:class:`mtdao.sync.SimulatedWorkers` averages over) and every worker's forward runs at once
(``vmap`` over ``functional_call``). Depends on torch only."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from mtdao.model.vmapped_attention import attention_that_vmaps


def _check_num_workers(num_workers: int) -> int:
    # the same rule, and message, as StackedLayout's (mtdao.sync.layout): the model side does not
    # import the sync package, which imports it
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"Invalid number of workers: {num_workers} (must be >= 1)")
    return num_workers


def _check_workers_per_call(workers_per_call: int | None) -> int | None:
    if workers_per_call is None:
        return None
    if (
        isinstance(workers_per_call, bool)
        or not isinstance(workers_per_call, int)
        or workers_per_call < 1
    ):
        raise ValueError(
            f"Invalid workers per call: {workers_per_call!r} (must be an int >= 1, or None for all)"
        )
    return workers_per_call


class StackedWorkers(nn.Module):
    """M copies of a module as one module: each parameter gains a leading worker dimension.

    Parameter and buffer names are the original module's, so optimizer groups, sync policies and
    checkpoints see the names they would with one worker. Buffers are shared by all workers (not
    stacked); tied parameters (an output layer sharing the embedding) stay tied.

    ``workers_per_call`` workers run in one vmapped call, and the calls run one after the other
    (None, the default: all workers in one call). Smaller calls hold less memory at the peak of a
    step, at some speed (benchmarks/simulator_scaling.py ``--workers-per-call``). The chunking
    changes no deterministic result: every op computes each worker's slice on its own, whichever
    other workers share its call (random draws, such as dropout's, come out in another order).
    """

    def __init__(
        self, module: nn.Module, num_workers: int, workers_per_call: int | None = None
    ) -> None:
        super().__init__()
        self.num_workers = _check_num_workers(num_workers)
        self.workers_per_call = _check_workers_per_call(workers_per_call)
        self._template = [module]  # in a list: its parameters are not this module's
        for name, param in module.named_parameters():
            owner, leaf = self._owner(name)
            stacked = param.detach().unsqueeze(0).repeat(num_workers, *([1] * param.dim()))
            owner.register_parameter(leaf, nn.Parameter(stacked))
        for prefix, submodule in module.named_modules():
            for leaf, buffer in submodule._buffers.items():
                if buffer is not None:
                    owner, _ = self._owner(f"{prefix}.{leaf}" if prefix else leaf)
                    persistent = leaf not in submodule._non_persistent_buffers_set
                    owner.register_buffer(leaf, buffer, persistent=persistent)

    def _owner(self, dotted_name: str) -> tuple[nn.Module, str]:
        """(container module, leaf name) of a dotted name, creating containers on first use."""
        *path, leaf = dotted_name.split(".")
        owner: nn.Module = self
        for part in path:
            if part not in owner._modules:
                owner.add_module(part, nn.Module())
            owner = owner._modules[part]  # type: ignore[assignment]
        return owner, leaf

    @property
    def template(self) -> nn.Module:
        """The original module (its own parameters are not trained)."""
        return self._template[0]

    def _call_one(self, params: dict[str, Tensor], buffers: dict[str, Tensor], *inputs: Tensor):
        return functional_call(self.template, (params, buffers), inputs)

    def _call_one_with_keywords(self, params, buffers, inputs, tensor_keywords, other_keywords):
        keywords = {**tensor_keywords, **other_keywords}
        return functional_call(self.template, (params, buffers), inputs, keywords)

    def forward(self, *inputs: Tensor, **keyword_inputs):
        """Every worker on its own inputs: each input tensor, positional or keyword, is
        [M, ...], and so is each tensor of the output; keyword values that are not tensors
        (flags, None) reach every worker as they are."""
        params, buffers = dict(self.named_parameters()), dict(self.named_buffers())
        if not keyword_inputs:
            in_dims = (0, None) + (0,) * len(inputs)
            return self._vmapped(self._call_one, in_dims, params, buffers, *inputs)
        tensors = {k: v for k, v in keyword_inputs.items() if isinstance(v, Tensor)}
        others = {k: v for k, v in keyword_inputs.items() if not isinstance(v, Tensor)}
        in_dims = (0, None, 0, 0, None)
        call = self._call_one_with_keywords
        return self._vmapped(call, in_dims, params, buffers, inputs, tensors, others)

    def losses(self, loss_fn: Callable[..., Tensor], inputs: Tensor, *targets: Tensor) -> Tensor:
        """``loss_fn(module(inputs[w]), *targets[w])`` of every worker w, in one call: shape [M].

        Backpropagating ``losses.sum()`` puts each worker's own gradient in its own slice.
        """

        def one_worker(params, buffers, inputs, *targets):
            return loss_fn(self._call_one(params, buffers, inputs), *targets)

        in_dims = (0, None, 0) + (0,) * len(targets)
        params, buffers = dict(self.named_parameters()), dict(self.named_buffers())
        return self._vmapped(one_worker, in_dims, params, buffers, inputs, *targets)

    def _vmapped(self, function: Callable, in_dims: tuple, *args):
        """``function`` of every worker (vmapped, ``workers_per_call`` at a time), with attention
        that vmaps."""
        chunk = self.workers_per_call
        chunk = None if chunk is None or chunk >= self.num_workers else chunk
        call = vmap(function, in_dims=in_dims, randomness="different", chunk_size=chunk)
        with attention_that_vmaps(next(self.parameters()).device):
            return call(*args)

    @torch.no_grad()
    def average(self) -> nn.Module:
        """A copy of the original module holding the workers' average parameters."""
        model = copy.deepcopy(self.template)
        averaged = {name: p.mean(dim=0) for name, p in self.named_parameters()}
        model.load_state_dict(averaged, strict=False)
        return model


def stack_workers(
    module: nn.Module, num_workers: int, workers_per_call: int | None = None
) -> StackedWorkers:
    """M simulated workers of ``module``, all starting from its parameters.

    Train them with an optimizer over ``workers.parameters()`` and a
    ``LocalUpdateSync(optimizer, policy, SimulatedWorkers(num_workers))``; feed each worker its own
    batch along a leading dimension of size ``num_workers``. The module's forward runs under
    ``torch.func.vmap``, so it must not branch on tensor values or call ``.item()``;
    ``workers_per_call`` of them at a time (None: all at once).
    """
    return StackedWorkers(module, num_workers, workers_per_call)
