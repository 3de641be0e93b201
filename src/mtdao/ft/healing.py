"""The state a healing replica receives: the checkpoint's trained state (so healing and resuming
cannot drift apart), sent as a CPU copy with DTensors as local shards, shapes checked first."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mtdao.ft.plumbing import ReplicaRefused
from mtdao.sync.dtensors import local_shard, shard_like
from mtdao.sync.trained_state import TrainedState

# a sharded (DTensor) optimizer state travels as {LOCAL_SHARD: its local shard}, plain data the
# receiver (the same process of another replica) makes a DTensor like its own parameter again
LOCAL_SHARD = "mtdao.local_shard"


class HealedState:
    """The ``trained`` state a healing replica takes from a live peer, copied to CPU when asked
    for (the sender trains on meanwhile); a sharded replica's process sends its own shards."""

    def __init__(self, trained: TrainedState) -> None:
        self.trained = trained

    def state_dict(self) -> dict:
        return _portable(self.trained.state_dict())

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        shapes, params = self.trained.shapes(), state["params"]
        received = (
            {n: tuple(p.shape) for n, p in params.items()} if isinstance(params, dict) else {}
        )
        if received != shapes:
            raise ReplicaRefused(
                f"the peer's model has parameter shapes {received}, this replica's {shapes}"
            )
        for index, param_state in state["optimizer"]["state"].items():
            param = self.trained.sync.params[index]
            for key, value in param_state.items():
                if isinstance(value, dict) and LOCAL_SHARD in value:
                    shard = value[LOCAL_SHARD].to(local_shard(param).device)
                    param_state[key] = shard_like(param, shard)
        self.trained.load_state_dict(state)


def _portable(value: Any) -> Any:
    """A CPU copy of ``value``, every DTensor in it as its local shard."""
    if isinstance(value, Tensor):
        shard = local_shard(value)
        copy = shard.detach().to("cpu", copy=True)
        return {LOCAL_SHARD: copy} if shard is not value else copy
    if isinstance(value, dict):
        return {key: _portable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_portable(item) for item in value)
    return value
