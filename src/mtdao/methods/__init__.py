"""The named methods (ddp, qh-ddp, local-adam, diloco, desloc, mtdao), each a composition of a
base optimizer (:mod:`mtdao.optim`), a sync policy and an outer step (:mod:`mtdao.sync`); this
package sits above both, which import nothing of it.

:class:`SyncConfig` holds a method's settings (:mod:`.config`), checked by :mod:`.checks` and
completed from :mod:`.defaults`; :mod:`.recipes` holds one function per method returning its
parts, and :func:`build_sync` the engine that carries them out. The method names and what each is
made of: :mod:`.table`.
"""

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
