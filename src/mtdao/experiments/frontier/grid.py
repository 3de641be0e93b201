"""The points of ``mtdao frontier``: which method, K, codecs and state periods, as data.

A point is one ``mtdao train`` configuration but for its learning rate and seed. Codec recipes
name what each kind crosses the link as (parameters always as pseudo-gradients, with error
feedback whenever they are quantized); methods that keep their states local (DiLoCo) take the
recipe's parameter codec only. ``states`` is the period of the optimizer states: ``None`` for the
method's own rule, or an explicit ``--state-sync-period``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mtdao.train.command import config_to_argv
from mtdao.train.config import TrainConfig

# recipe -> codecs of (parameters, momenta, second moment); None: float32
RECIPES: dict[str, tuple[str | None, str | None, str | None]] = {
    "fp32": (None, None, None),
    "int8": ("int8", "int8", "int8"),  # INTELLECT-1: int8 pseudo-gradients
    "int4": ("int4", "int8", "int8"),  # 4-bit pseudo-gradients, error feedback
    "int2": ("int2", "int8", "int8"),  # MuLoCo-style 2-bit pseudo-gradients, error feedback
    "top8": ("top8", "int8", "int8"),  # SparseLoCo-style: 3% top-k with error feedback
    "top8-s4": ("top8", "int4", "int4"),  # ... and 4-bit states
    "top8-s2": ("top8", "int2", "int2"),  # ... and 2-bit states
}
# the tolerance screens: one kind quantized, the others float32
SCREENS = {
    **{f"p-{c}": (c, None, None) for c in ("int8", "int4", "int2", "top8")},
    **{f"m-{c}": (None, c, None) for c in ("int4", "int2", "top8")},
    **{f"v-{c}": (None, None, c) for c in ("int4", "int2")},
}
RECIPES.update(SCREENS)
METHODS_WITH_STATE_ROUNDS = ("local-adam", "desloc", "mtdao")


@dataclass(frozen=True)
class FrontierPoint:
    method: str
    sync_period: int | None = None  # None: DDP
    recipe: str = "fp32"
    states: int | None = None

    @property
    def name(self) -> str:
        if self.method == "ddp":
            return "ddp"
        parts = [self.method, f"k{self.sync_period}", self.recipe]
        if self.states is not None:
            parts.append(f"s{self.states}")
        return "-".join(parts)

    def fields(self) -> dict:
        """The TrainConfig fields this point sets."""
        if self.method == "ddp":
            return {"method": "ddp"}
        params, momenta, second_moment = RECIPES[self.recipe]
        sends_states = self.method in METHODS_WITH_STATE_ROUNDS
        spec = [f"params={params}"] if params else []
        if sends_states:
            spec += [f"momenta={momenta}"] if momenta else []
            spec += [f"second-moment={second_moment}"] if second_moment else []
        return {
            "method": self.method,
            "sync_period": self.sync_period,
            "sync_dtype": tuple(spec) or None,
            "error_feedback": params is not None,
            "state_sync_period": self.states if sends_states else None,
        }


def quick_grid() -> list[FrontierPoint]:
    """A few minutes on 2 cores: one K, the float32 and 2-bit rows of each method."""
    return [
        FrontierPoint("ddp"),
        FrontierPoint("local-adam", 32),
        FrontierPoint("diloco", 32),
        FrontierPoint("diloco", 32, "int2"),
        FrontierPoint("desloc", 32),
        FrontierPoint("mtdao", 32),
        FrontierPoint("mtdao", 32, "int2", states=128),
    ]


def full_grid() -> list[FrontierPoint]:
    """K from 32 to 512, every recipe, the states on their own rule or on longer periods."""
    points = [FrontierPoint("ddp")]
    for k in (32, 128, 512):
        points += [FrontierPoint("local-adam", k), FrontierPoint("local-adam", k, "int8")]
        points += [FrontierPoint("diloco", k, r) for r in ("fp32", "int8", "int4", "int2", "top8")]
        points += [FrontierPoint("desloc", k), FrontierPoint("desloc", k, "int8")]
        points += [FrontierPoint("mtdao", k), FrontierPoint("mtdao", k, "int8")]
        for recipe in ("int8", "int2", "top8", "top8-s4", "top8-s2"):
            points += [FrontierPoint("mtdao", k, recipe, states=m * k) for m in (2, 4)]
        if k == 32:  # what each kind tolerates, one at a time
            points += [FrontierPoint("mtdao", k, screen) for screen in SCREENS]
    # K = 64, where the 100x-300x budgets fall between K = 32 and K = 128
    points += [FrontierPoint("diloco", 64, "int8"), FrontierPoint("diloco", 64, "int4")]
    points += [FrontierPoint("mtdao", 64, "int8", states=m * 64) for m in (4, 8, 16)]
    points += [FrontierPoint("mtdao", 64, "int4", states=512)]
    # 500x-1000x, between K = 128 and K = 512: 4-bit pseudo-gradients at K = 128, or K = 256
    points += [FrontierPoint("diloco", 256, "int8")]
    points += [FrontierPoint("mtdao", 128, "int4", states=1024)]
    for recipe in ("int8", "int4"):
        points += [FrontierPoint("mtdao", 256, recipe, states=m * 256) for m in (2, 4)]
    points += [FrontierPoint("desloc", 256, "int8")]
    return points


GRIDS = {"quick": quick_grid, "full": full_grid}


def select(points: Sequence[FrontierPoint], names: Sequence[str] | None) -> list[FrontierPoint]:
    """The points named, in the order named (the order they train in); every point of the grid
    when ``names`` is empty."""
    if not names:
        return list(points)
    known = {p.name: p for p in points}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--points: unknown point(s) {', '.join(unknown)}; see --list")
    return [known[name] for name in dict.fromkeys(names)]


def changed_flags(config: TrainConfig) -> list[str]:
    """The ``mtdao train`` flags of ``config`` that differ from the defaults (seed and output
    directory aside): the point's exact argument list; add ``--seed S`` for one of its runs."""
    config = config.replace(seed=0, out=None, progress=True, resume=False)
    default = flag_groups(config_to_argv(TrainConfig.of()))
    changed = ["--method", config.sync.method]  # always first, default or not
    for flag, values in flag_groups(config_to_argv(config)):
        if (flag, values) not in default and flag != "--method":
            changed += [flag, *values]
    return changed


def flag_groups(argv: Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
    """``argv`` as (flag, its values) pairs, in order."""
    groups: list[tuple[str, list[str]]] = []
    for token in argv:
        if token.startswith("--"):
            groups.append((token, []))
        else:
            groups[-1][1].append(token)
    return [(flag, tuple(values)) for flag, values in groups]
