"""The local-update sync engine: policies (what and when), the engine (carries them out),
communicators (how bytes move) and worker layouts (where each worker's copy lives).

The engine depends on torch only (and :mod:`mtdao.timescales` for half-lives, :mod:`mtdao.units`
for byte counts) and knows no optimizer beyond the state keys its policies name; the named methods
(:mod:`mtdao.methods`) compose the optimizers (:mod:`mtdao.optim`) with this package, which
imports neither. Codecs: :mod:`mtdao.sync.codecs`. Test doubles:
:mod:`mtdao.sync.testing`. :func:`stack_workers`, the model side of simulated workers, lives in
:mod:`mtdao.model.stacked_workers` (which imports nothing of this package) and is re-exported here.
"""

from mtdao.model.stacked_workers import StackedWorkers, stack_workers
from mtdao.sync.codecs.compression import SyncCodecs
from mtdao.sync.communicator import (
    Averages,
    Communicator,
    FinalRoundNotCommitted,
    SingleWorker,
    Traffic,
)
from mtdao.sync.engine import LocalUpdateSync, NonFiniteError, SyncEvent
from mtdao.sync.layout import ProcessGroupLayout, StackedLayout, WorkerLayout
from mtdao.sync.policy import (
    OuterOptimizerConfig,
    SyncPolicy,
    SyncRule,
    desloc,
    explicit,
    gradient_averaging,
    half_life_policy,
    keep_local,
    state_decays,
    unified,
)
from mtdao.sync.simulated import SimulatedWorkers

__all__ = [
    "Averages",
    "Communicator",
    "FinalRoundNotCommitted",
    "LocalUpdateSync",
    "NonFiniteError",
    "OuterOptimizerConfig",
    "ProcessGroupLayout",
    "SimulatedWorkers",
    "SingleWorker",
    "StackedLayout",
    "StackedWorkers",
    "SyncCodecs",
    "SyncEvent",
    "SyncPolicy",
    "SyncRule",
    "Traffic",
    "WorkerLayout",
    "desloc",
    "explicit",
    "gradient_averaging",
    "half_life_policy",
    "keep_local",
    "stack_workers",
    "state_decays",
    "unified",
]
