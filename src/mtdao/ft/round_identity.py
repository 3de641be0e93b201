"""Every round opens with each member's step and config (and parity position): members that differ
sit it out, never averaged (docs/security.md, "Step and config at every round")."""

from __future__ import annotations

from collections import Counter

from mtdao.ft.parity import ParityCheck, Sum, summed_rows


def digest_number(config_digest: str) -> int:
    """A hex digest as a number that fits an int64 (its first 60 bits)."""
    return int(config_digest[:15], 16) if config_digest else 0


def sitting_out(positions: list[tuple[int, int]]) -> dict[int, str]:
    """{quorum rank: why it sits the round out} for the members away from the reference."""
    counts = Counter(positions)
    reference = max(counts, key=lambda position: (counts[position], position[0]))
    reasons = {}
    for rank, (step, config) in enumerate(positions):
        if config != reference[1]:
            reasons[rank] = "its config differs from the quorum's"
        elif step != reference[0]:
            reasons[rank] = f"it is at step {step}, the quorum at step {reference[0]}"
    return reasons


def check(
    sum_in_round: Sum,
    replicas: list[int],
    rank: int,
    step: int,
    config_digest: str,
    parity: ParityCheck,
) -> tuple[list[int], str | None]:
    """(the replicas that sit this round out, why this one does: None when it takes part); the
    same exchange carries each member's parity position after the round before."""
    config = digest_number(config_digest)
    row = [step, config, *parity.position()]
    positions = summed_rows(sum_in_round, rank, len(replicas), row)
    reasons = sitting_out([(position[0], position[1]) for position in positions])
    parities = [position[2:] for position in positions]
    reasons = {**parity.judge(parities, replicas, rank, sum_in_round), **reasons}
    return [replicas[r] for r in reasons], reasons.get(rank)
