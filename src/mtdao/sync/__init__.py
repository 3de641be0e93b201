"""The local-update sync engine: policies (what and when), engine (carries it out), communicators
(how bytes move)."""

from mtdao.sync.communicator import Communicator, SingleWorker, Traffic
from mtdao.sync.engine import LocalUpdateSync, NonFiniteError
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
    "Communicator",
    "LocalUpdateSync",
    "NonFiniteError",
    "OuterOptimizerConfig",
    "SimulatedWorkers",
    "SingleWorker",
    "SyncPolicy",
    "SyncRule",
    "Traffic",
    "desloc",
    "explicit",
    "gradient_averaging",
    "half_life_policy",
    "keep_local",
    "state_decays",
    "unified",
]
