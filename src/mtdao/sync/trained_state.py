"""What training has made of a worker: its parameters, every optimizer state and the sync engine's.

One definition for everyone who copies it: a checkpoint saves it (with the run's progress, see
:mod:`mtdao.train.checkpoint.run_state`), and a fault-tolerant replica that heals receives it from a live
peer (:mod:`mtdao.ft.healing`, which adds how it travels). Both forms of it are here:
the plain one (parameters by name, the optimizer's and the engine's ``state_dict``) and the
sharded one for DCP (the model and optimizer as DCP's ``get_state_dict`` gives them, the engine's
tensors as DTensors: :meth:`~mtdao.sync.sharded_state.ShardedEngineState.sharded_state_dict`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from mtdao.sync.dtensors import local_shard
from mtdao.sync.types import EngineState


class TrainedState:
    """The trained part of a worker: ``named_params`` (default: the engine's parameters under
    their optimizer names), ``sync.optimizer`` and ``sync``; ``module`` (for the sharded form
    only) is the model the parameters belong to."""

    def __init__(
        self,
        sync: EngineState,
        named_params: list[tuple[str, Tensor]] | None = None,
        module: nn.Module | None = None,
    ) -> None:
        self.sync = sync
        if named_params is None:
            named_params = [(sync.param_names[id(p)], p) for p in sync.params]
        names = [name for name, _ in named_params]
        shared = sorted({name for name in names if names.count(name) > 1})
        if shared:  # keyed by name, one would overwrite the other
            raise ValueError(f"parameters share the name {shared[0]!r}: name each one apart")
        self.named_params = named_params
        self.module = module

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Each parameter's shape, as this process holds it (its local shard)."""
        return {name: tuple(local_shard(p).shape) for name, p in self.named_params}

    # -- plain ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The parameters by name (this process's shards), the optimizer's and the engine's
        ``state_dict``: tensors are the live ones or the engine's copies, not snapshots."""
        return {
            "params": {name: local_shard(p).detach() for name, p in self.named_params},
            "optimizer": self.sync.optimizer.state_dict(),
            "sync": self.sync.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        params = state["params"]
        for name, p in self.named_params:
            local_shard(p).copy_(params[name])
        self.sync.optimizer.load_state_dict(state["optimizer"])
        self.sync.load_state_dict(state["sync"])

    # -- sharded (DCP) -------------------------------------------------------------------------

    def sharded_state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the DCP state dict: ``model``, ``optimizer`` and the engine's DTensors; the engine's
        plain rest). A collective over the worker's shard group."""
        engine, plain = self.sync.sharded_state_dict()
        model, optimizer = self._model_and_optimizer()
        return {"model": model, "optimizer": optimizer, "engine": engine}, plain

    def sharded_layout(self, plain: dict[str, Any] | None = None) -> dict[str, Any]:
        """DTensors for DCP to read into, laid out as :meth:`sharded_state_dict` saved them
        (``plain``: its plain part; without it, the tensors every such worker holds). Makes the
        optimizer's states if it has none yet (DCP's ``get_state_dict`` does)."""
        model, optimizer = self._model_and_optimizer()  # (first: the rounds' layout needs states)
        return {"model": model, "optimizer": optimizer, "engine": self.sync.sharded_layout(plain)}

    @torch.no_grad()
    def load_sharded_state_dict(self, sharded: dict[str, Any], plain: dict[str, Any]) -> None:
        """Load what DCP read into :meth:`sharded_layout`'s tensors, with its plain part."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self._module(),
            self.sync.optimizer,
            model_state_dict=sharded["model"],
            optim_state_dict=sharded["optimizer"],
        )
        self.sync.load_sharded_state_dict(sharded["engine"], plain)

    def _model_and_optimizer(self) -> tuple[dict[str, Any], dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        return get_state_dict(self._module(), self.sync.optimizer)

    def _module(self) -> nn.Module:
        if self.module is None:
            raise ValueError("the sharded form of a trained state needs the module it trains")
        return self.module
