"""A quorum of proven members for one process of one replica: its rank, who heals from whom, and
where the round's group meets, decided by proven commit counts, never a claimed step
(docs/security.md, "What a peer must prove")."""

from __future__ import annotations

from dataclasses import dataclass

from mtdao.ft.security.auth import RunKey
from mtdao.ft.security.proofs import Claim


@dataclass
class QuorumPlan:
    members: list[Claim]  # the proven members in quorum rank order
    rank: int  # this replica's quorum rank
    max_commits: int  # the commit count of the up-to-date members: every member's after this quorum
    sources: list[int]  # where this replica heals from, in order (empty: it is up to date)
    serves: bool  # whether this replica serves its state (it is up to date, and someone heals)
    store: str  # ``host:port/prefix`` where this process's group of the round meets
    refusal: str | None = None  # why this replica may not join (id taken, other shards)
    failure: str | None = None  # why this replica forms no group (shards differ, too few)

    @property
    def replica_ids(self) -> list[int]:
        return [c.replica_id for c in self.members]

    @property
    def heals(self) -> bool:
        return bool(self.sources)


def plan_quorum(
    proven: list[Claim], me: str, group_rank: int, rendezvous: str, min_replicas: int = 1
) -> QuorumPlan:
    """The plan for process ``group_rank`` of proven member ``me``, its group meeting under
    prefix ``rendezvous`` in the chosen store; fewer than ``min_replicas`` (the lighthouse's)
    proven members form no group."""
    members = sorted(proven, key=lambda claim: claim.member)
    rank = next(r for r, claim in enumerate(members) if claim.member == me)
    mine = members[rank]
    trusted = trusted_sources(members)
    max_commits = max(members[r].commits for r in trusted)
    up_to_date = [r for r in trusted if members[r].commits == max_commits]
    primary = up_to_date[group_rank % len(up_to_date)]
    first_quorum = max_commits == 0  # all but one heal from it (torchft's init sync)
    healing = [
        r for r in range(len(members)) if r not in up_to_date or (first_quorum and r != primary)
    ]
    ready = [r for r in range(len(members)) if r not in healing]
    sources: list[int] = []
    if rank in healing:
        first = (healing.index(rank) + group_rank) % len(ready)
        rotated = ready[first:] + ready[:first]
        # a source with this replica's config first: one with another would refuse it
        sources = sorted(rotated, key=lambda r: members[r].config != mine.config)
    plan = QuorumPlan(
        members=members,
        rank=rank,
        max_commits=max_commits,
        sources=sources,
        serves=rank in ready and bool(healing),
        store=f"{members[primary].store}/{rendezvous}",
    )
    _check_membership(plan, mine, up_to_date)
    if plan.failure is None and len(members) < min_replicas:  # the lighthouse counted others
        ids = ", ".join(map(str, plan.replica_ids))
        proved = f"{len(members)} replicas proved their claims (replicas {ids})"
        if len(members) == 1:
            proved = f"1 replica proved its claim (replica {ids})"
        plan.failure = f"{proved}, the lighthouse's --min-replicas is {min_replicas}"
    return plan


def trusted_sources(members: list[Claim]) -> list[int]:
    """The ranks of the members none refused a heal state from (all, if none is left)."""
    refused = {member for claim in members for member in claim.refused}
    trusted = [r for r, claim in enumerate(members) if claim.member not in refused]
    return trusted or list(range(len(members)))


def rendezvous(key: RunKey, digest: str, proven: list[Claim]) -> str:
    """The store prefix of the round's group: only secret holders can name it, and members that
    proved different sets meet apart."""
    members = sorted(claim.member for claim in proven)
    return f"mtdao/{key.sign('rendezvous', digest, *members)[:32]}"


def _check_membership(plan: QuorumPlan, mine: Claim, up_to_date: list[int]) -> None:
    members = plan.members
    joining = mine.commits == 0
    ids = plan.replica_ids
    same = [c for c in members if c.replica_id == mine.replica_id]
    keeper = max(same, key=lambda c: (c.commits, c.member))  # every member picks the same one
    if len(same) > 1 and (joining or mine is not keeper):
        plan.refusal = (
            f"replica id {mine.replica_id} is already taken in the quorum (replicas "
            f"{', '.join(map(str, sorted(ids)))}); give each replica its own --replica-id"
        )
        return
    others = {c.replica_id: c.shards for c in members if c.shards != mine.shards}
    if not others:
        return
    theirs = ", ".join(f"replica {r} has --shards {n}" for r, n in sorted(others.items()))
    reference = reference_shard_count([members[r].shards for r in up_to_date])
    plan.failure = f"{theirs}, this replica {mine.shards}"  # no member forms a group
    if joining and reference != mine.shards:
        plan.refusal = (
            f"this replica has --shards {mine.shards}, but {theirs} in the quorum: the "
            "processes of replicas pair up shard by shard, so every replica needs the same "
            "--shards"
        )


def reference_shard_count(counts: list[int]) -> int | None:
    """The number of processes most up-to-date replicas have (None: no majority)."""
    common = max(set(counts), key=counts.count)
    return common if 2 * counts.count(common) > len(counts) else None
