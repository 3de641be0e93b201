"""Who a replica is, as its quorums see it: shared by its communicator and its quorum step."""

from __future__ import annotations

from dataclasses import dataclass, field

from mtdao.ft.collective_watch import Peer
from mtdao.ft.plumbing import QuorumView, Refusal, ReplicaRefused
from mtdao.ft.security.auth import RunKey


@dataclass
class ReplicaIdentity:
    replica_id: int
    key: RunKey = field(repr=False)
    """The run's secret: what a peer proves it belongs to the run with (:mod:`.security.auth`)."""
    config_digest: str = ""
    """Digest of the settings every replica must share: a member with another sits out."""
    training_step: int = 0  # the training step this replica has taken, at the quorum being formed
    quorum: QuorumView = field(default_factory=QuorumView)
    """The last quorum: its members' replica ids in rank order, this replica's rank, its id."""
    peers: list[Peer] = field(default_factory=list)
    """The other members of the current quorum, where a probe reaches this process's
    counterpart in each (its heal server)."""
    refusal: ReplicaRefused | None = None
    """Why this replica may not join (a replica id taken, a config that differs): it leaves."""
    refused: list[Refusal] = field(default_factory=list)
    """The members of the quorums since the driver last asked that did not prove they belong
    to the run."""
    notes: list[str] = field(default_factory=list)
    """What those quorums did that the replica should say (a refused heal state)."""
