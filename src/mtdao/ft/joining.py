"""A fault-tolerant replica of any training loop: :func:`fault_tolerant_replica`.

A healing replica receives its source's state where the source prepares a round, inside its
``optimizer.step()``: change state registered with ``track_state`` (a data position, RNG) before
``optimizer.step()`` in the loop, or derive it from ``sync.step_count``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch.distributed as dist

from mtdao.ft.config import LIGHTHOUSE_VARIABLE, ReplicaConfig
from mtdao.ft.plumbing import ReplicaRefused
from mtdao.ft.replicas import ReplicaGroups, RoundStart
from mtdao.ft.security.auth import read_token, run_key
from mtdao.ft.security.heal_checks import CONFIG_RECORD
from mtdao.sync.collectives import DEFAULT_BUCKET_BYTES

logger = logging.getLogger(__name__)


def fault_tolerant_replica(
    config: ReplicaConfig,
    *,
    shared_config: Mapping[str, Any] | None = None,
    collective_timeout: float = 300.0,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    shard_group: dist.ProcessGroup | None = None,
    allow_non_finite: bool = False,
) -> ReplicaGroups:
    """Replica ``config.replica_id`` of the run whose lighthouse is at ``config.lighthouse``
    (default ``$MTDAO_LIGHTHOUSE``): a communicator for
    :class:`~mtdao.sync.engine.LocalUpdateSync` (docs/library.md, "Fault-tolerant replicas in
    your own loop", says what each argument does). ``shared_config``: JSON-able settings every
    replica must share; ``collective_timeout``: seconds one collective or heal transfer may
    take; ``shard_group``: this replica's FSDP2 processes (every one calls this)."""
    if config.replica_id is None:
        raise ValueError("no replica id: give ReplicaConfig(replica_id=...) (or --replica-id)")
    lighthouse = config.lighthouse or os.environ.get(LIGHTHOUSE_VARIABLE)
    if not lighthouse:
        raise ValueError(
            f"no lighthouse: give ReplicaConfig(lighthouse='host:port') or set "
            f"${LIGHTHOUSE_VARIABLE}"
        )
    config = replace(config, lighthouse=lighthouse)
    key = run_key(read_token(config.auth_token_file), config.bind_host)
    shared = dict(shared_config or {})
    replicas = ReplicaGroups(
        config,
        key=key,
        config_digest=config_digest(shared) if shared else "",
        collective_timeout=collective_timeout,
        bucket_bytes=bucket_bytes,
        allow_non_finite=allow_non_finite,
        shard_group=shard_group,
    )
    speaks = shard_group is None or dist.get_rank(shard_group) == 0  # one line per replica
    replicas.on_quorum = JoinsAndHeals(config.replica_id) if speaks else None
    # before the engine's state: a replica that differs is refused before anything is loaded
    replicas.track_state(CONFIG_RECORD, SharedConfig(config.replica_id, shared))
    return replicas


class JoinsAndHeals:
    """Says when the replica joins, heals or its quorum's members change, as a warning (shown
    without logging set up)."""

    def __init__(self, replica_id: int) -> None:
        self.replica_id, self.members = replica_id, None  # of its last quorum

    def __call__(self, start: RoundStart, step: int) -> None:
        said, before, self.members = [], self.members, start.replicas
        members = ", ".join(map(str, start.replicas))
        if before is None:
            said.append(f"joined at step {step} with replicas {members}")
        elif set(start.replicas) != set(before):  # once per change: a steady run says nothing
            went = [f"replica {r} left" for r in before if r not in start.replicas]
            came = [f"replica {r} joined" for r in start.replicas if r not in before]
            said.append(f"quorum now replicas {members} ({', '.join(went + came)})")
        if (heal := start.heal) is not None:
            size = f"{heal.bytes / 1e6:.1f} MB" if heal.bytes >= 1e6 else f"{heal.bytes:,} bytes"
            said.append(
                f"healed from replica {heal.source}{'' if said else f' at step {step}'} "
                f"({size} in {heal.seconds:.1f} s)"
            )
        if said:
            logger.warning("replica %d: %s", self.replica_id, ", ".join(said))


def config_digest(shared: Mapping[str, Any]) -> str:
    """A digest of the settings every replica must share (carried by every round)."""
    text = json.dumps(dict(shared), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class SharedConfig:
    """The settings every replica must share, checked against a heal source's (nothing loaded)."""

    def __init__(self, replica_id: int, shared: Mapping[str, Any]) -> None:
        self.replica_id, self.shared = replica_id, dict(shared)

    def state_dict(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, "config": self.shared}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        theirs, mine = state["config"], self.shared
        names = [*mine, *(name for name in theirs if name not in mine)]
        differences = [
            f"{name}: {theirs.get(name)!r} there, {mine.get(name)!r} here"
            for name in names
            if theirs.get(name) != mine.get(name)
        ]
        if differences:
            raise ReplicaRefused(
                f"replica {self.replica_id}'s config differs from the quorum's (replica "
                f"{state['replica_id']}): " + "; ".join(differences)
            )
