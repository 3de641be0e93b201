"""The state a healing replica receives from a live peer: what makes it that peer's copy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from mtdao.sync.dtensors import local_shard, shard_like
from mtdao.sync.engine import LocalUpdateSync
from mtdao.sync.torchft.plumbing import ReplicaRefused

LOCAL_SHARD = "mtdao.local_shard"
"""An optimizer state that is sharded (a DTensor) where it was sent travels as
``{LOCAL_SHARD: its sender's local shard}`` (plain data: see :mod:`.safe_transport`): the receiver,
the same process of another replica of the same shape, makes it a DTensor like its own parameter
again."""


def engine_state(sync: LocalUpdateSync) -> tuple[Callable[[], dict], Callable[[dict], None]]:
    """What a healing replica needs from a live peer to carry on as its copy: the parameters,
    every optimizer state and the engine's state (step, anchors, outer momentum, rounds).

    The state is copied to CPU when a peer asks for it: the sender goes on training while the
    receiver fetches it. A process of a sharded replica sends its shards, to the process holding
    the same shards in the healing replica.
    """

    def state_dict() -> dict:
        return _portable(
            {
                "params": [local_shard(p).detach() for p in sync.params],
                "optimizer": sync.optimizer.state_dict(),
                "sync": sync.state_dict(),
            }
        )

    @torch.no_grad()
    def load_state_dict(state: dict) -> None:
        shapes = [tuple(local_shard(p).shape) for p in sync.params]
        received = [tuple(p.shape) for p in state["params"]]
        if shapes != received:
            raise ReplicaRefused(
                f"the peer's model has parameter shapes {received}, this replica's {shapes}"
            )
        for param, value in zip(sync.params, state["params"]):
            local_shard(param).copy_(value)
        optimizer = state["optimizer"]
        for index, param_state in optimizer["state"].items():
            param = sync.params[index]
            for key, value in param_state.items():
                if isinstance(value, dict) and LOCAL_SHARD in value:
                    shard = value[LOCAL_SHARD].to(local_shard(param).device)
                    param_state[key] = shard_like(param, shard)
        sync.optimizer.load_state_dict(optimizer)
        sync.load_state_dict(state["sync"])

    return state_dict, load_state_dict


def _portable(value: Any) -> Any:
    """A CPU copy of ``value``, every DTensor in it as its local shard (a DTensor is bound to the
    processes of its replica)."""
    if isinstance(value, Tensor):
        shard = local_shard(value)
        copy = shard.detach().to("cpu", copy=True)
        return {LOCAL_SHARD: copy} if shard is not value else copy
    if isinstance(value, dict):
        return {key: _portable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_portable(item) for item in value)
    return value
