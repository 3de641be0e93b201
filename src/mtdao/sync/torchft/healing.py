"""The state a healing replica receives from a live peer: what makes it that peer's copy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from mtdao.sync.engine import LocalUpdateSync
from mtdao.sync.torchft.plumbing import ReplicaRefused


def engine_state(sync: LocalUpdateSync) -> tuple[Callable[[], dict], Callable[[dict], None]]:
    """What a healing replica needs from a live peer to carry on as its copy: the parameters,
    every optimizer state and the engine's state (step, anchors, outer momentum, rounds).

    The state is copied to CPU when a peer asks for it: the sender goes on training while the
    receiver fetches it.
    """

    def state_dict() -> dict:
        return _cpu_copy(
            {
                "params": [p.detach() for p in sync.params],
                "optimizer": sync.optimizer.state_dict(),
                "sync": sync.state_dict(),
            }
        )

    @torch.no_grad()
    def load_state_dict(state: dict) -> None:
        shapes = [tuple(p.shape) for p in sync.params]
        received = [tuple(p.shape) for p in state["params"]]
        if shapes != received:
            raise ReplicaRefused(
                f"the peer's model has parameter shapes {received}, this replica's {shapes}"
            )
        for param, value in zip(sync.params, state["params"]):
            param.copy_(value)
        sync.optimizer.load_state_dict(state["optimizer"])
        sync.load_state_dict(state["sync"])

    return state_dict, load_state_dict


def _cpu_copy(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _cpu_copy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu_copy(item) for item in value)
    return value
