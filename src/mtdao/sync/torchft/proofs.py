"""Who is in a round, proven: every member of a quorum signs where it stands.

torchft's lighthouse lets any process that reaches it into a quorum, and its step (the number of
commits) is what decides who heals from whom. So at each quorum every member posts a signed
:class:`Claim` (its replica id, commit count, training step and config digest, bound to the quorum
and the member's place in it) to the quorum's store and checks everyone else's. A member whose claim
is missing or does not verify is not one of the run's replicas: nobody forms a process group with
it or takes its state. Among the proven members, the most common (step, config) at the highest
commit count is the round's *reference*; a proven member at that commit count but another step or
config is *stale*: it is left out of the round and heals at the next quorum.
"""

from __future__ import annotations

import json
import time
from collections import Counter
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


@dataclass(frozen=True)
class Reference:
    commits: int
    step: int
    config: str

    def holds(self, claim: Claim) -> bool:
        return (claim.commits, claim.step, claim.config) == (self.commits, self.step, self.config)


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
    if not isinstance(posted, dict) or not key.verifies(posted.get("sig"), context, rank,
                                                        posted.get("claim")):  # fmt: skip
        return None
    try:
        return Claim(**json.loads(posted["claim"]))
    except (TypeError, ValueError):
        return None


def reference(claims: list[Claim | None]) -> Reference | None:
    """The (step, config) most proven members at the highest commit count share; a tie goes to
    the later step. None when no member is proven."""
    proven = [c for c in claims if c is not None]
    if not proven:
        return None
    top = max(c.commits for c in proven)
    counts = Counter((c.step, c.config) for c in proven if c.commits == top)
    (step, config), _ = max(counts.items(), key=lambda item: (item[1], item[0][0]))
    return Reference(top, step, config)


def staleness(mine: Claim, ref: Reference) -> str | None:
    """Why this member may not take part in the round (None: it may). A member behind on
    commits heals from a reference member before the round, so only one at the reference's
    commit count can be stale."""
    if mine.commits != ref.commits:
        return None
    if mine.config != ref.config:
        return "its config differs from the quorum's"
    if mine.step != ref.step:
        return f"it is at step {mine.step}, the quorum at step {ref.step}"
    return None
