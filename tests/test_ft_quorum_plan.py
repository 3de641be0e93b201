"""Who heals from whom and where a round meets, decided over the proven members only: an
outsider's claimed step decides nothing (torchft picks the member claiming the highest step as
every replica's heal source and the host of the round's rendezvous)."""

from __future__ import annotations

import pytest

from mtdao.ft.quorum_plan import plan_quorum
from mtdao.ft.security.proofs import Claim

pytest.importorskip("torchft")


def member(replica: int, commits: int, config: str = "c", shards: int = 1) -> Claim:
    return Claim(
        replica_id=replica,
        member=f"{replica}:uuid",
        commits=commits,
        step=4 * commits,
        config=config,
        shards=shards,
        store=f"host{replica}:100",
        heal=(f"http://host{replica}:200/heal/", f"http://host{replica}:201/heal/"),
    )


def test_the_proven_members_at_the_highest_commit_count_are_the_sources():
    proven = [member(0, 40), member(1, 40), member(2, 0)]
    joiner = plan_quorum(proven, "2:uuid", 0, "meet")
    assert joiner.heals and joiner.max_commits == 40
    assert sorted(joiner.members[r].replica_id for r in joiner.sources) == [0, 1]
    assert joiner.store == "host0:100/meet"  # an up-to-date member's store
    for me in ("0:uuid", "1:uuid"):
        source = plan_quorum(proven, me, 0, "meet")
        assert source.serves and not source.heals and source.max_commits == 40


def test_joiners_are_spread_over_the_sources_and_fall_back_on_the_others():
    proven = [member(0, 9), member(1, 9), member(2, 3), member(3, 0)]
    first = [plan_quorum(proven, f"{r}:uuid", 0, "m").sources for r in (2, 3)]
    assert [s[0] for s in first] == [0, 1]  # each its own source first
    assert [sorted(s) for s in first] == [[0, 1], [0, 1]]  # and the other one behind it
    assert plan_quorum(proven, "2:uuid", 1, "m").sources[0] == 1  # process 1 elsewhere


def test_a_first_quorum_heals_everyone_from_one_member():
    proven = [member(0, 0), member(1, 0), member(2, 0)]
    plans = [plan_quorum(proven, f"{r}:uuid", 0, "m") for r in range(3)]
    assert [p.heals for p in plans] == [False, True, True]
    assert plans[0].serves and all(p.sources == [0] for p in plans[1:])


def test_a_source_with_this_replicas_config_comes_first():
    proven = [member(0, 9, config="other"), member(1, 9), member(2, 0)]
    assert plan_quorum(proven, "2:uuid", 0, "m").sources == [1, 0]


def test_a_joiner_whose_replica_id_is_taken_is_refused():
    proven = [member(0, 9), member(1, 9), Claim(**{**member(1, 0).__dict__, "member": "1:b"})]
    plan = plan_quorum(proven, "1:b", 0, "m")
    assert plan.refusal == (
        "replica id 1 is already taken in the quorum (replicas 0, 1, 1); give each replica its "
        "own --replica-id"
    )
    assert plan_quorum(proven, "1:uuid", 0, "m").refusal is None  # the running one goes on


@pytest.mark.parametrize(
    "other_commits, other_member, keeper",
    [(5, "1:z", "1:uuid"), (9, "1:z", "1:z")],
    ids=["most-commits-keeps-it", "a-tie-keeps-the-greater-member"],
)
def test_of_two_committed_members_with_one_replica_id_all_plans_keep_the_same_one(
    other_commits, other_member, keeper
):
    """Two running replicas started with one --replica-id (not only a joiner) would train under
    one id: the one with most commits (then the greater member) stays, the other is refused, and
    each reaches that verdict alone, from the same proven claims."""
    other = Claim(**{**member(1, other_commits).__dict__, "member": other_member})
    proven = [member(0, 9), member(1, 9), other]
    refusals = {me: plan_quorum(proven, me, 0, "m").refusal for me in ("1:uuid", other_member)}
    refused = next(me for me in refusals if me != keeper)
    assert refusals[keeper] is None
    assert refusals[refused] == (
        "replica id 1 is already taken in the quorum (replicas 0, 1, 1); give each replica its "
        "own --replica-id"
    )
    assert plan_quorum(proven, "0:uuid", 0, "m").refusal is None


def refusing(claim: Claim, *members: str) -> Claim:
    return Claim(**{**claim.__dict__, "refused": tuple(members)})


def test_a_member_whose_heal_state_was_refused_is_no_source_and_heals_itself():
    """A faulty member ahead in commits whose state a joiner refused: every member plans the
    same quorum without it as a source; the healthy ones are up to date and it heals."""
    faulty, joiner = member(0, 50), refusing(member(3, 0), "0:uuid")
    proven = [faulty, member(1, 9), member(2, 9), joiner]
    plans = {r: plan_quorum(proven, f"{r}:uuid", 0, "m") for r in range(4)}
    assert {p.max_commits for p in plans.values()} == {9}
    assert not plans[1].heals and not plans[2].heals and plans[1].serves
    assert plans[0].heals and plans[3].heals
    for healing in (plans[0], plans[3]):
        assert sorted(healing.members[r].replica_id for r in healing.sources) == [1, 2]
    assert {p.store for p in plans.values()} == {"host1:100/m"}  # a trusted member's store


def test_on_a_first_quorum_the_refused_member_heals_from_a_trusted_one():
    proven = [member(0, 3), refusing(member(1, 0), "0:uuid"), member(2, 0)]
    plans = [plan_quorum(proven, f"{r}:uuid", 0, "m") for r in range(3)]
    assert [p.heals for p in plans] == [True, False, True]
    assert all(p.sources == [1] for p in (plans[0], plans[2])) and plans[1].serves


def test_when_every_member_was_refused_the_commit_counts_decide_again():
    proven = [refusing(member(0, 9), "1:uuid"), refusing(member(1, 4), "0:uuid")]
    assert plan_quorum(proven, "1:uuid", 0, "m").sources == [0]


def test_a_proven_quorum_below_the_lighthouses_min_replicas_forms_no_group():
    """The lighthouse counted 3 (--min-replicas 3), but replica 1 died before it confirmed: the
    2 members that proved their claims average nothing (it once committed a round of 2)."""
    proven = [member(0, 9), member(2, 9)]
    plans = [plan_quorum(proven, f"{r}:uuid", 0, "m", min_replicas=3) for r in (0, 2)]
    for plan in plans:
        assert plan.failure == (
            "2 replicas proved their claims (replicas 0, 2), the lighthouse's --min-replicas is 3"
        )
        assert plan.refusal is None  # it trains on and asks again at the next quorum
    for min_replicas in (1, 2):
        assert plan_quorum(proven, "0:uuid", 0, "m", min_replicas=min_replicas).failure is None
    alone = plan_quorum(proven[:1], "0:uuid", 0, "m", min_replicas=2)
    assert (
        alone.failure
        == "1 replica proved its claim (replica 0), the lighthouse's --min-replicas is 2"
    )


def test_a_shard_mismatch_is_named_before_a_count_below_min_replicas():
    proven = [member(0, 9), member(2, 9, shards=2)]
    plan = plan_quorum(proven, "0:uuid", 0, "m", min_replicas=3)
    assert plan.failure == "replica 2 has --shards 2, this replica 1"
