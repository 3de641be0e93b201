"""``mtdao.train.train``: a run as configured, plain or one replica of a fault-tolerant run."""

from __future__ import annotations

from typing import Any

from mtdao.train import trainer
from mtdao.train.config import TrainConfig, resolve


def train(config: TrainConfig) -> dict[str, Any]:
    """Train as configured; returns (and writes) the results. With ``fault_tolerant`` set, this
    process is one replica (:mod:`mtdao.train.fault_tolerance.replica`, the only path to torchft)."""
    if config.parallel.fault_tolerant:
        from mtdao.train.fault_tolerance.replica import train_replica

        return train_replica(resolve(config))
    return trainer.train(config)
