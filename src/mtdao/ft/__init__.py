"""Replica groups that die, rejoin and heal: averaging through torchft.

Each replica group holds a full copy of the model and optimizer and is one worker of the sync
engine: one process, or several sharding it with FSDP2 (``shard_group``, see :mod:`.shards`). A
torchft lighthouse keeps track of the live replicas; each replica has a torchft ``Manager`` (one
per process). A loop gets a replica from :func:`fault_tolerant_replica` (:mod:`.joining`: the
run's secret, bind host and the config every replica must share) and hands it to
:class:`~mtdao.sync.engine.LocalUpdateSync` as its communicator; ``mtdao train --fault-tolerant``
does the same. A round runs in three parts:

1. :meth:`ReplicaGroups.prepare`, which the engine calls before the forward pass of every step
   (:meth:`~mtdao.sync.engine.LocalUpdateSync.prepare`; ``attached()`` does it after each step),
   handing it the coming step and a ``round_due`` callable: when this replica has not joined
   yet, or a round is due at the coming step, a quorum of the live replicas
   (:class:`~.quorum.Quorum`), a new process group when the membership changed, and, for a
   replica that is new or missed a commit, a heal: it receives a live peer's state (the engine's
   trained state, and everything registered with :meth:`ReplicaGroups.track_state`) and
   continues as that peer's copy from before the step, so its own step is a real one. A quorum
   with no round behind it (the first one, when nothing is due at step 1) is closed by an empty
   round, once every healing replica holds its state;
2. :meth:`ReplicaGroups.average`: the due tensors, encoded as on any communicator (float32
   buckets, or a codec's exchange) and moved by :class:`~.transport.ManagerTransport` through the
   manager (the replicas first agree on who contributes); delayed, fragmented and quantized
   rounds are the same rounds, a delayed one in flight for D steps in its quorum;
3. :meth:`ReplicaGroups.commit`: torchft's ``should_commit``; the round stands only when no
   collective of it failed. A round still in flight when the next one opens is settled (landed
   and committed) first, since the manager runs one quorum at a time.

A round a peer's death breaks raises :class:`~mtdao.sync.communicator.RoundNotCommitted` and the
engine applies none of it: every replica keeps its local state and the next quorum goes on without
the dead one. A final round it breaks is formed again among the survivors (a quorum of its own,
:data:`~mtdao.sync.engine.FINAL_ROUND_TRIES` tries in all), so every replica that ends holds the
same model, or the engine raises ``FinalRoundNotCommitted``. Between rounds nothing is coordinated. A replica healed at this round's quorum has
not run the round's local steps, so it adds nothing to a parameter or state average (it receives
it); its gradient, computed on the healed state, does count in a gradient round (DDP).

This package is the only one that imports torchft (an optional dependency: ``pip install
mtdao[ft]``). Only members that prove they belong to the run (a shared secret: :mod:`.auth`,
:mod:`.proofs`) form a round's process group; every round checks that its members stand at one
step with one config (:mod:`.round_identity`; delayed, fragmented and quantized rounds
alike, since each opens at a quorum), and that what the round before assigned is bit for bit
the same on every member (:mod:`.parity`); healed state travels signed and without pickle
(:mod:`.safe_transport`); every listener is on the replica's ``bind_host``, torchft's manager
server behind a front that refuses its unauthenticated ``Kill`` call (:mod:`.manager_front`).
See docs/security.md.

Modules: :mod:`.joining` (a replica of any loop), :mod:`.replicas` (the communicator), :mod:`.quorum` (the manager and its current
quorum), :mod:`.transport` (the round's collectives in that quorum), :mod:`.layouts` (a
replica's layout), :mod:`.connection` (its manager, and the lighthouse going and
coming back), :mod:`.healing` (the state a healing replica receives), :mod:`.shards` (replicas of
several processes), :mod:`.manager_front` (the manager server behind its front),
:mod:`.plumbing` (what is added to torchft's process group and store, and the lighthouse).
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
