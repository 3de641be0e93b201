"""The defaults card's grid, as data: its entries (each method at its defaults, MT-DAO's earlier
defaults and candidates beside), its cells (corpus, run length, sync period) and seeds, and the
runs that fill it. The command (:mod:`.run`), the numbers (:mod:`.summary`) and the report read
it from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mtdao.train.config import TextSettings, TrainConfig


@dataclass(frozen=True)
class Entry:
    """One row of the card: a method and the flags that make it what it is."""

    name: str
    method: str
    settings: dict[str, Any] = field(default_factory=dict)
    """TrainConfig fields beside the defaults (empty: the method exactly as it ships)."""
    note: str = ""
    own_rounds: bool = False
    """Runs at the method's default rounds, not the cell's K: one run serves every K, as DDP's."""

    @property
    def takes_sync_period(self) -> bool:
        return self.method != "ddp" and not self.own_rounds


# The defaults before 2026-12-04 warmed the learning rate up over 5% of --steps (15 steps of a
# 300-step run); today's default warm-up is 150 steps (the same run from 3000 steps on).
FRACTION_WARMUP = dict(warmup=0.05)

ENTRIES = (
    Entry("ddp", "ddp"),
    Entry("local-adam", "local-adam"),
    Entry(
        "mtdao",
        "mtdao",
        note="the current default: its own rounds whatever K (the parameters every 4 steps as "
        "int4 pseudo-gradients with error feedback, the states as int8 every 32) since "
        "2026-12-07, WSD and the LR warm-up 150 steps since 2026-12-04",
        own_rounds=True,
    ),
    Entry(
        "mtdao-float32",
        "mtdao",
        note="default from 2026-12-04 to 2026-12-07: every K steps in float32",
    ),
    # The earlier defaults ran under the cosine schedule, every method's default until 2026-12-04;
    # a schedule is judged against the baselines under it too (a default schedule is fair only if
    # it is each method's own best, as the learning rate is).
    Entry(
        "mtdao-lr-warmup-0.05",
        "mtdao",
        FRACTION_WARMUP,
        "default on 2026-12-04: the same optimizer and schedule, the LR warm-up 5% of --steps",
    ),
    Entry(
        "mtdao-cosine",
        "mtdao",
        dict(schedule="cosine", **FRACTION_WARMUP),
        "default from 2026-12-02 to 2026-12-04: the same optimizer under the cosine schedule",
    ),
    Entry(
        "mtdao-warmup-0.3",
        "mtdao",
        dict(beta_warmup=0.3, beta_ramp=0.0, lr=8e-3, schedule="cosine", **FRACTION_WARMUP),
        "default from 2026-12-01 to 2026-12-02: 0.99 / 0.9, beta warm-up over 30% of --steps, "
        "lr 8e-3, cosine",
    ),
    Entry(
        "mtdao-0.95-0.7",
        "mtdao",
        dict(betas=(0.95,), omegas=(0.7,), lr=8e-3, schedule="cosine", **FRACTION_WARMUP),
        "default before 2026-12-01: 0.95 / 0.7, no warm-up, lr 8e-3, cosine",
    ),
    Entry(
        "ddp-lr-warmup-0.05",
        "ddp",
        FRACTION_WARMUP,
        "DDP's default on 2026-12-04 (WSD, the LR warm-up 5% of --steps)",
    ),
    Entry(
        "local-adam-lr-warmup-0.05",
        "local-adam",
        FRACTION_WARMUP,
        "Local Adam's default on 2026-12-04 (WSD, the LR warm-up 5% of --steps)",
    ),
    Entry(
        "ddp-cosine",
        "ddp",
        dict(schedule="cosine", **FRACTION_WARMUP),
        "DDP's default before 2026-12-04",
    ),
    Entry(
        "local-adam-cosine",
        "local-adam",
        dict(schedule="cosine", **FRACTION_WARMUP),
        "Local Adam's default before 2026-12-04",
    ),
)
ENTRY_NAMES = tuple(entry.name for entry in ENTRIES)
PERIOD_FREE_ENTRIES = frozenset(entry.name for entry in ENTRIES if not entry.takes_sync_period)
CURRENT_ENTRIES = ("ddp", "local-adam", "mtdao")


@dataclass(frozen=True)
class Grid:
    corpora: tuple[str, ...]
    steps: tuple[int, ...]
    sync_periods: tuple[int, ...]
    seeds: tuple[int, ...]
    entries: tuple[str, ...] = ENTRY_NAMES
    long_steps: tuple[int, ...] = ()
    """Extra lengths run on the first corpus and the first sync period only."""
    approach_steps: tuple[int, ...] = ()
    """Extra lengths below ``reference_steps`` run by the current entries only: the steps each
    needs to reach DDP's loss at ``reference_steps`` is interpolated between its runs' lengths
    (:mod:`mtdao.experiments.defaults_card.steps_to_loss`)."""
    reference_steps: int | None = None
    """The length whose DDP loss the other entries are timed to reach (None: not timed)."""

    def cells(self) -> list[tuple[str, int, int]]:
        """(corpus, steps, K) in length order per corpus and K, the long lengths last."""
        lengths = sorted({*self.steps, *self.approach_steps})
        cells = [(c, n, k) for c in self.corpora for n in lengths for k in self.sync_periods]
        return cells + [(self.corpora[0], n, self.sync_periods[0]) for n in self.long_steps]

    def runs_entry(self, steps: int, entry: str) -> bool:
        """Whether ``entry`` runs at length ``steps`` (the approach lengths: current entries)."""
        return steps not in self.approach_steps or entry in CURRENT_ENTRIES


FULL = Grid(
    corpora=("builtin", "vim", "gnu-info"),
    steps=(300, 1000, 3000),
    sync_periods=(32, 128),
    seeds=(0, 1, 2),
    long_steps=(10000,),
    approach_steps=(2400,),
    reference_steps=3000,
)
QUICK = Grid(
    corpora=("builtin",),
    steps=(300,),
    sync_periods=(32,),
    seeds=(0,),
    entries=CURRENT_ENTRIES,
)
MODEL = "micro"


def run_name(corpus: str, steps: int, sync_period: int, entry: str, seed: int) -> str:
    period = "" if entry in PERIOD_FREE_ENTRIES else f"-K{sync_period}"
    return f"{corpus}-{steps}{period}-{entry}-s{seed}"


def card_runs(
    grid: Grid, data: dict[str, str], data_split: str = TextSettings.data_split
) -> list[tuple[str, TrainConfig]]:
    """Every run of ``grid`` on the corpora found (``data``: corpus -> --data, sharded by
    ``data_split``), in the order an interrupted card shows the most: the first seed of every
    cell before any other seed, and within a seed the current entries before MT-DAO's earlier
    defaults and candidates; then runs of up to 1000 steps before those of 3000 and the longer
    ones, the first sync period before the others, short runs first. So a card stopped early
    still answers every horizon at one seed."""
    entries = [entry for entry in ENTRIES if entry.name in grid.entries]

    def order(planned):
        (corpus, steps, sync_period), seed, entry = planned
        tier = 0 if steps <= 1000 else 1 if steps <= 3000 else 2
        beside = entry.name not in CURRENT_ENTRIES  # an earlier default or a candidate
        return (
            seed != grid.seeds[0],
            beside,
            tier,
            sync_period != grid.sync_periods[0],
            steps,
        )

    planned = [
        (cell, seed, entry)
        for seed in grid.seeds
        for cell in grid.cells()
        for entry in entries
        if cell[0] in data and grid.runs_entry(cell[1], entry.name)
    ]
    runs: dict[str, TrainConfig] = {}
    for (corpus, steps, sync_period), seed, entry in sorted(planned, key=order):
        name = run_name(corpus, steps, sync_period, entry.name, seed)
        period = dict(sync_period=sync_period) if entry.takes_sync_period else {}
        runs.setdefault(
            name,
            TrainConfig.of(
                method=entry.method,
                model=MODEL,
                steps=steps,
                **period,
                data=data[corpus],
                data_split=data_split,
                seed=seed,
                progress=False,
                **entry.settings,
            ),
        )
    return list(runs.items())
