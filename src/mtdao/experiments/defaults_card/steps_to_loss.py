"""Steps to a loss across run lengths: how many steps a method needs to reach a target loss (DDP's
final loss at a reference length) when it is trained for that many steps, with that length's
own schedule.

The first evaluation of one long run that reaches the target would flatter a method whose
learning rate is still high there and penalise one that gains most from the final decay; a run
that *ends* at N steps has annealed, as a user's N-step run would. So each method runs at a few
lengths (each a separate run with its own warm-up, plateau and decay) and the lengths around the
first one that reaches the target are interpolated linearly in steps. Pure functions of final
losses, tested without training.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from mtdao.experiments.common.formatting import stats


def steps_to_reach(finals: Mapping[int, float | None], target: float) -> float | None:
    """The fewest steps whose run ends at or below ``target``: linear in steps between the two
    run lengths around the first that reaches it (lengths not run yet, None, are passed over);
    the shortest length when that one already does (an upper bound: the lengths start too
    late), and likewise a length that follows a diverged one; None when no length reaches it."""
    points = sorted((steps, loss) for steps, loss in finals.items() if loss is not None)
    for index, (steps, loss) in enumerate(points):
        if not loss <= target:  # NaN never reaches it
            continue
        if index == 0 or not math.isfinite(points[index - 1][1]):
            return float(steps)
        before_steps, before_loss = points[index - 1]
        fraction = (before_loss - target) / (before_loss - loss)
        return before_steps + fraction * (steps - before_steps)
    return None


def steps_to_reference_loss(
    finals_by_seed: Mapping[str, Mapping[int, float | None]],
    target: float,
    reference_steps: int,
) -> dict[str, Any]:
    """One method's steps to ``target`` per seed (its runs of every length up to
    ``reference_steps``), over the seeds whose reference-length run finished: how many reach it,
    and mean ± std of the steps of those that do, also as a fraction of the reference length."""
    by_seed: dict[str, float | None] = {}
    for seed, finals in finals_by_seed.items():
        lengths = {n: loss for n, loss in finals.items() if n <= reference_steps}
        if lengths.get(reference_steps) is None:
            continue  # its reference run has not finished: no verdict for this seed
        by_seed[seed] = steps_to_reach(lengths, target)
    reached = [steps for steps in by_seed.values() if steps is not None]
    summary = stats(reached)
    return {
        "by_seed": by_seed,
        "seeds": len(by_seed),
        "reached": len(reached),
        "stats": summary,
        "fraction": summary["mean"] / reference_steps if summary else None,
    }
