"""Who a replica is, as its quorums see it: shared by its communicator and its quorum step."""

from __future__ import annotations

from dataclasses import dataclass, field

from mtdao.ft.collective_watch import Peer
from mtdao.ft.plumbing import ReplicaRefused
from mtdao.ft.refusals import Refusal
from mtdao.ft.security.auth import RunKey


@dataclass
class ReplicaIdentity:
    replica_id: int
    key: RunKey = field(repr=False)  # the run's secret
    config_digest: str = ""  # of the settings every replica must share
    training_step: int = 0  # the step this replica has taken, at the quorum being formed
    members: list[int] = field(default_factory=list)  # the last quorum's, in rank order
    rank: int = 0  # this replica's in it
    quorum_id: int = -1
    peers: list[Peer] = field(default_factory=list)  # the other members' heal servers (probes)
    refusal: ReplicaRefused | None = None  # why this replica may not join: it leaves
    refused: list[Refusal] = field(default_factory=list)  # peers refused since the driver asked
    notes: list[str] = field(default_factory=list)  # what those quorums did worth saying
