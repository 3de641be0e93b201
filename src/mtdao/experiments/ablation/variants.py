"""The lines of the ablation plot: Local Adam, and MT-DAO per slow momentum and period rule.

The run (:mod:`.run`), its summary and its report all take :class:`Variant` from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# One hue per slow momentum (the first is MT-DAO's red in every figure); line style per policy.
SLOW_BETA_COLORS = ("#d62728", "#7b1fa2", "#1f77b4", "#8c564b", "#17becf")


@dataclass(frozen=True)
class Variant:
    """One line of the ablation plot: a method and its momentum / period settings."""

    name: str
    slug: str
    method: str
    betas: tuple[float, ...] | None = None
    omegas: tuple[float, ...] | None = None
    sync_policy: str | None = None
    color: str = "#ff7f0e"
    linestyle: str = "-"


def build_variants(
    slow_betas: Sequence[float], omega: float, policies: Sequence[str]
) -> list[Variant]:
    variants = [Variant("Local Adam", "local-adam", "local-adam")]
    styles = {"unified": "-", "half-life": "--", "desloc": ":"}
    shades = [SLOW_BETA_COLORS[i % len(SLOW_BETA_COLORS)] for i in range(len(slow_betas))]
    for beta, shade in zip(slow_betas, shades):
        for policy in policies:
            variants.append(
                Variant(
                    name=f"MT-DAO beta {beta:g}, {policy}",
                    slug=f"mtdao-b{beta:g}-w{omega:g}-{policy}",
                    method="mtdao",
                    betas=(beta,),
                    omegas=(omega,),
                    sync_policy=policy,
                    color=shade,
                    linestyle=styles.get(policy, "-."),
                )
            )
    return variants
