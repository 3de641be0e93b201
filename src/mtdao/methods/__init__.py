"""The named methods, each a base optimizer (:mod:`mtdao.optim`), a sync policy and an outer step
(:mod:`mtdao.sync`); this package sits above both, which import nothing of it. Settings:
:mod:`.config` (checked by :mod:`.checks`, completed by :mod:`.defaults`); one function per
method: :mod:`.recipes`; what each is made of: :mod:`.table`."""

from mtdao.methods.config import SyncConfig
from mtdao.methods.optimizers import build_optimizer, warmups_of
from mtdao.methods.recipes import MethodParts, build_sync, method_parts
from mtdao.methods.table import METHODS

__all__ = [
    "METHODS",
    "MethodParts",
    "SyncConfig",
    "build_optimizer",
    "build_sync",
    "method_parts",
    "warmups_of",
]
