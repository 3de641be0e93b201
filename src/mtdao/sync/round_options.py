"""The rules of the round options, checked here once: the delay D, the fragments P and the codecs
that change a round without changing its policy.

The engine (:class:`~mtdao.sync.round_plan.RoundPlan`) checks them against its policy with
:func:`check_round_options`; the training config (``mtdao.train.config_checks``) checks the same
rules, through the same functions, against a method's settings before any policy is built.
Messages name those settings (`sync_delay`, `sync_fragments`, `sync_dtype`: the engine's
``delay``, ``fragments`` and ``codecs``); ``mtdao train`` shows them as its flags.
"""

from __future__ import annotations

from mtdao.sync.codecs.compression import SyncCodecs
from mtdao.sync.policy import SyncPolicy


def check_fragments(fragments: int) -> int:
    """P, the number of fragments: a positive integer."""
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
        raise ValueError(f"`sync_fragments` must be a positive integer, got {fragments!r}")
    return fragments


def check_delay_value(delay: int) -> int:
    """D, the delay in steps: an integer >= 0 (0: blocking rounds)."""
    if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
        raise ValueError(f"Invalid sync delay: {delay!r} (`sync_delay` must be an integer >= 0)")
    return delay


def refuse_without_rounds(
    who: str, *, delay: int = 0, fragments: int = 1, codecs: SyncCodecs | None = None
) -> None:
    """Refuse the first option that changes a round, for ``who``, which averages gradients every
    step (DDP) and so has no rounds to change."""
    quantized = codecs is not None and codecs.quantizes_anything
    options = (("`sync_delay`", delay > 0), ("`sync_fragments`", fragments > 1))
    changed = [flag for flag, on in (*options, ("`sync_dtype`", quantized)) if on]
    if changed:
        raise ValueError(
            f"{changed[0]}: {who} averages gradients every step; with gradient averaging there "
            "are no sync rounds to delay, split or quantize"
        )


def check_delay_lands(delay: int, shortest: int | None, period: str) -> None:
    """Refuse a delay that is not below the shortest sync period (None: nothing is averaged), so
    that a round lands before the next round of the same tensors starts. ``period`` says which
    period that is, as the message shows it ("`sync_period` 32")."""
    if shortest is not None and delay >= shortest:
        raise ValueError(
            f"`sync_delay` {delay} must be below {period}: a round has to land before the next "
            "round of the same tensors starts"
        )


def shortest_period(policy: SyncPolicy) -> int | None:
    """The shortest period of any rule of ``policy`` (None when it averages nothing)."""
    periods = [policy.params.period, policy.other_states.period]
    periods += [rule.period for rule in policy.states.values()]
    return min((p for p in periods if p is not None), default=None)


def check_round_options(
    policy: SyncPolicy,
    *,
    delay: int = 0,
    fragments: int = 1,
    codecs: SyncCodecs | None = None,
) -> int:
    """Every rule of the round options against ``policy``; returns the delay."""
    check_fragments(fragments)
    check_delay_value(delay)
    if policy.average_gradients:
        refuse_without_rounds(
            f"policy {policy.name!r}", delay=delay, fragments=fragments, codecs=codecs
        )
    shortest = shortest_period(policy)
    check_delay_lands(delay, shortest, f"every sync period (the shortest is {shortest})")
    return delay
