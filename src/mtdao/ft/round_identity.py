"""Every round opens with each member's step and config (and parity position): members that differ
sit it out, never averaged (docs/security.md, "Step and config at every round")."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from mtdao.ft.identity import ReplicaIdentity
    from mtdao.ft.parity import ParityCheck


def digest_number(config_digest: str) -> int:
    """A hex digest as a number that fits an int64 (its first 60 bits)."""
    return int(config_digest[:15], 16) if config_digest else 0


def exchange_positions(
    sum_in_round: Callable[[Tensor], Tensor],
    rank: int,
    members: int,
    step: int,
    config: int,
    parity: Sequence[int] = (),
) -> list[tuple[int, ...]]:
    """(step, config digest, *parity position) of every member of the round, in rank order."""
    table = torch.zeros(members, 2 + len(parity), dtype=torch.int64)
    table[rank] = torch.tensor([step, config, *parity], dtype=torch.int64)
    table = sum_in_round(table.reshape(-1)).reshape(members, -1)
    return [tuple(int(value) for value in row) for row in table.tolist()]


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
    sum_in_round: Callable[[Tensor], Tensor],
    replicas: list[int],
    rank: int,
    step: int,
    identity: ReplicaIdentity,
    parity: ParityCheck,
) -> tuple[list[int], str | None]:
    """(the replicas that sit this round out, why this one does: None when it takes part); the
    same exchange carries each member's parity position after the round before."""
    config = digest_number(identity.config_digest)
    positions = exchange_positions(
        sum_in_round, rank, len(replicas), step, config, parity.position()
    )
    reasons = sitting_out([position[:2] for position in positions])
    parities = [list(position[2:]) for position in positions]
    reasons = {**parity.judge(parities, replicas, rank, sum_in_round), **reasons}
    return [replicas[r] for r in reasons], reasons.get(rank)
