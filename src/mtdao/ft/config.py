"""A replica's settings, :class:`ReplicaConfig`: the library's and ``mtdao train``'s (one flag per
field, the docstrings their help). Standard library only, so a config loads without torchft."""

from __future__ import annotations

from dataclasses import dataclass, field

LIGHTHOUSE_VARIABLE = "MTDAO_LIGHTHOUSE"


def _setting(default, *, resumable: bool = True):
    """A field with the marks ``mtdao train``'s config reads: every setting here may differ
    between the replicas of one run, and all but the replica id between a run and its
    resumption."""
    return field(default=default, metadata={"resumable": resumable, "replica_local": True})


@dataclass(frozen=True)
class ReplicaConfig:
    """Fault tolerance (torchft replicas)."""

    replica_id: int | None = _setting(None, resumable=False)
    """This replica's number, 0 .. --workers - 1: its data shard (with --fault-tolerant)."""
    lighthouse: str | None = _setting(None)
    """The lighthouse's host:port (with --fault-tolerant; start one with mtdao lighthouse)."""
    connect_timeout: float = _setting(30.0)
    """Seconds to reach the lighthouse or a peer before giving up (with --fault-tolerant)."""
    quorum_timeout: float = _setting(600.0)
    """Seconds to wait for a quorum; keep it above the time between syncs (--fault-tolerant)."""
    bind_host: str = _setting("127.0.0.1")
    """The address this replica's listeners serve on (manager, store, collectives, heal state;
    with --fault-tolerant): loopback for replicas on one machine, this machine's address on the
    network the replicas share for several (see docs/security.md)."""
    auth_token_file: str | None = _setting(None)
    """A file holding the run's secret, the same for every replica (else $MTDAO_AUTH_TOKEN): a
    peer without it is neither averaged with nor healed from. Required unless --bind-host is
    loopback (with --fault-tolerant; see docs/security.md)."""

    @property
    def lighthouse_url(self) -> str:
        """``http://host:port`` of the lighthouse (given as ``host:port`` or a URL)."""
        return self.lighthouse if "://" in (self.lighthouse or "") else f"http://{self.lighthouse}"
