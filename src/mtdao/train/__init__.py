"""The training harness: config, one loop for every method, checkpoints, metrics."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = ["TrainConfig", "train"]

# Imported on first use (PEP 562): `mtdao lighthouse`, whose module lives in this package, starts
# without importing torch.
_LAZY = {"TrainConfig": "mtdao.train.config", "train": "mtdao.train.launch"}

if TYPE_CHECKING:
    from mtdao.train.config import TrainConfig
    from mtdao.train.launch import train


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'mtdao.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
