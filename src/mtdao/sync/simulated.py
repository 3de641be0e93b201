"""M workers simulated in one process: every tensor carries a leading worker dimension.

Worker w's copy of a parameter of shape S is ``tensor[w]`` of a tensor of shape [M, *S]; an
average over workers is a mean over dim 0. Element-wise optimizers (Adam, ADOPT, SGD and their
MT-DAO forms) run unchanged on such stacked tensors, so one optimizer step updates every worker.

:func:`stack_workers` turns an ordinary module into M such workers whose forward runs all of them
at once (``torch.func.vmap`` over ``functional_call``), so M workers cost about M single-worker
steps, and :class:`SimulatedWorkers` averages their tensors.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from mtdao.sync.communicator import Averages, Communicator
from mtdao.sync.layout import StackedLayout, check_num_workers
from mtdao.sync.quantize import Codec
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


class StackedWorkers(nn.Module):
    """M copies of a module as one module: each parameter gains a leading worker dimension.

    Parameter and buffer names are the original module's, so optimizer groups, sync policies and
    checkpoints see the names they would with one worker. Buffers are shared by all workers (not
    stacked); tied parameters (an output layer sharing the embedding) stay tied.
    """

    def __init__(self, module: nn.Module, num_workers: int) -> None:
        super().__init__()
        self.num_workers = check_num_workers(num_workers)
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
            call = vmap(self._call_one, in_dims=in_dims, randomness="different")
            return call(params, buffers, *inputs)
        tensors = {k: v for k, v in keyword_inputs.items() if isinstance(v, Tensor)}
        others = {k: v for k, v in keyword_inputs.items() if not isinstance(v, Tensor)}
        call = vmap(
            self._call_one_with_keywords, in_dims=(0, None, 0, 0, None), randomness="different"
        )
        return call(params, buffers, inputs, tensors, others)

    def losses(self, loss_fn: Callable[..., Tensor], inputs: Tensor, *targets: Tensor) -> Tensor:
        """``loss_fn(module(inputs[w]), *targets[w])`` of every worker w, in one call: shape [M].

        Backpropagating ``losses.sum()`` puts each worker's own gradient in its own slice.
        """

        def one_worker(params, buffers, inputs, *targets):
            return loss_fn(self._call_one(params, buffers, inputs), *targets)

        call = vmap(one_worker, in_dims=(0, None, 0) + (0,) * len(targets), randomness="different")
        return call(dict(self.named_parameters()), dict(self.named_buffers()), inputs, *targets)

    @torch.no_grad()
    def average(self) -> nn.Module:
        """A copy of the original module holding the workers' average parameters."""
        model = copy.deepcopy(self.template)
        averaged = {name: p.mean(dim=0) for name, p in self.named_parameters()}
        model.load_state_dict(averaged, strict=False)
        return model


def stack_workers(module: nn.Module, num_workers: int) -> StackedWorkers:
    """M simulated workers of ``module``, all starting from its parameters.

    Train them with an optimizer over ``workers.parameters()`` and a
    ``LocalUpdateSync(optimizer, policy, SimulatedWorkers(num_workers))``; feed each worker its own
    batch along a leading dimension of size ``num_workers``. The module's forward runs under
    ``torch.func.vmap``, so it must not branch on tensor values or call ``.item()``.
    """
    return StackedWorkers(module, num_workers)
