"""Who is in a quorum, proven: every member signs who it is.

torchft's lighthouse lets any process that reaches it into a quorum, and its step (the number of
commits) is what decides who heals from whom. So whenever the membership changes (torchft then
configures a new process group) every member posts a signed :class:`Claim` (its replica id,
commit count, training step and config digest, bound to the quorum and the member's place in it)
to the quorum's store and checks everyone else's. A member whose claim is missing or does not
verify is not one of the run's replicas: nobody forms a process group with it or takes its state.
Whether the members agree on step and config is checked at every round (:mod:`.round_identity`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from mtdao.sync.torchft.auth import RunKey


@dataclass(frozen=True)
class Claim:
    replica_id: int
    commits: int
    """torchft's step: rounds this replica committed."""
    step: int
    """The training step this replica has taken."""
    config: str
    """Digest of the settings every replica must share."""


def exchange_claims(
    store: Any, key: RunKey, context: str, rank: int, world_size: int, mine: Claim, wait_s: float
) -> list[Claim | None]:
    """Post this member's signed claim at ``rank`` and read every member's: a claim that is
    missing after ``wait_s`` seconds, or whose signature fails, is None."""
    body = json.dumps(asdict(mine), sort_keys=True)
    store.set(f"claim/{rank}", json.dumps({"claim": body, "sig": key.sign(context, rank, body)}))
    deadline = time.monotonic() + wait_s
    claims: list[Claim | None] = []
    for other in range(world_size):
        remaining = max(0.05, deadline - time.monotonic())
        try:
            store.wait([f"claim/{other}"], timedelta(seconds=remaining))
            posted = json.loads(store.get(f"claim/{other}"))
        except Exception:  # never posted (a timeout), or not JSON: unproven either way
            claims.append(None)
            continue
        claims.append(verified(posted, key, context, other))
    return claims


def verified(posted: Any, key: RunKey, context: str, rank: int) -> Claim | None:
    if not isinstance(posted, dict):
        return None
    if not key.verifies(posted.get("sig"), context, rank, posted.get("claim")):
        return None
    try:
        return Claim(**json.loads(posted["claim"]))
    except (TypeError, ValueError):
        return None
