"""mtdao: multi-timescale distributed adaptive optimizers with local updates, in PyTorch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = ["MTAdam", "MTAdopt", "MTSGD", "half_life", "beta_for_half_life", "__version__"]

# Imported on first use (PEP 562), so that `mtdao --help` starts without importing torch.
_LAZY = {
    "MTAdam": "mtdao.optim",
    "MTAdopt": "mtdao.optim",
    "MTSGD": "mtdao.optim",
    "half_life": "mtdao.timescales",
    "beta_for_half_life": "mtdao.timescales",
}

if TYPE_CHECKING:
    from mtdao.optim import MTSGD, MTAdam, MTAdopt
    from mtdao.timescales import beta_for_half_life, half_life


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'mtdao' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
