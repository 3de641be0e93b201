"""Replica groups that die, rejoin and heal, averaging through torchft (``pip install mtdao[ft]``):
docs/fault-tolerance.md; the round protocol, docs/design.md; who may take part, docs/security.md.
Nothing in :mod:`mtdao.sync` imports this package."""

from __future__ import annotations

import importlib

# Imported on first use (PEP 562): mtdao.ft.config (ReplicaConfig) loads without torchft, so a
# training config holds it whether torchft is installed or not.
_LAZY = {
    "SharedConfig": "mtdao.ft.joining",
    "fault_tolerant_replica": "mtdao.ft.joining",
    "Heal": "mtdao.ft.replicas",
    "QuorumError": "mtdao.ft.plumbing",
    "RefusalLog": "mtdao.ft.refusals",
    "ReplicaConfig": "mtdao.ft.config",
    "ReplicaGroups": "mtdao.ft.replicas",
    "ReplicaRefused": "mtdao.ft.plumbing",
    "RoundStart": "mtdao.ft.replicas",
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
