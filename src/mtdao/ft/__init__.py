"""Replica groups that die, rejoin and heal: averaging through torchft (``pip install
mtdao[ft]``).

A loop gets a replica from :func:`fault_tolerant_replica` (its settings a
:class:`ReplicaConfig`) and hands it to :class:`~mtdao.sync.engine.LocalUpdateSync` as its
communicator (a :class:`ReplicaGroups`); ``mtdao train --fault-tolerant`` does the same. Entering
``sync.attached()`` raises :class:`QuorumError` when the lighthouse cannot be reached and
:class:`ReplicaRefused` when the run does not let the replica in. The round protocol (a quorum
before the step that opens a round, a heal there, the round through the manager, torchft's
commit) is docs/design.md's "Fault-tolerant replicas"; who may take part, :mod:`.security` and
docs/security.md. The engine knows this package only as a ``Communicator``; nothing in
:mod:`mtdao.sync` imports it.
"""

from __future__ import annotations

import importlib

# Imported on first use (PEP 562): mtdao.ft.config (ReplicaConfig) loads without torchft, so a
# training config holds it whether torchft is installed or not.
_LAZY = {
    "OTHER_ACCOUNTS": "mtdao.ft.joining",
    "SharedConfig": "mtdao.ft.joining",
    "config_digest": "mtdao.ft.joining",
    "fault_tolerant_replica": "mtdao.ft.joining",
    "Heal": "mtdao.ft.replicas",
    "QuorumError": "mtdao.ft.plumbing",
    "RefusalLog": "mtdao.ft.refusals",
    "ReplicaConfig": "mtdao.ft.config",
    "ReplicaGroups": "mtdao.ft.replicas",
    "ReplicaIdentity": "mtdao.ft.identity",
    "ReplicaLayout": "mtdao.ft.layouts",
    "ReplicaProcesses": "mtdao.ft.shards",
    "ReplicaRefused": "mtdao.ft.plumbing",
    "RoundStart": "mtdao.ft.replicas",
    "ShardedReplicaLayout": "mtdao.ft.layouts",
    "engine_state": "mtdao.ft.healing",
    "start_lighthouse": "mtdao.ft.plumbing",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'mtdao.ft' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
