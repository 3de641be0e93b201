"""What one part of the engine needs of another, as protocols: the engine imports its parts and
none of them imports the engine back, so the package's imports run one way (a type names only
what is used of the object)."""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor
from torch.optim import Optimizer


class EngineState(Protocol):
    """What a worker's trained state (:class:`~mtdao.sync.trained_state.TrainedState`) reads and
    loads of the engine (:class:`~mtdao.sync.engine.LocalUpdateSync`)."""

    optimizer: Optimizer
    params: list[Tensor]
    param_names: dict[int, str]

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def sharded_state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]: ...

    def sharded_layout(self, plain: dict[str, Any] | None = None) -> dict[str, Any]: ...

    def load_sharded_state_dict(self, sharded: dict[str, Any], plain: dict[str, Any]) -> None: ...


class WorkerState(Protocol):
    """A worker's trained state as a communicator keeps it to hand a joining worker
    (:class:`~mtdao.sync.trained_state.TrainedState`)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
