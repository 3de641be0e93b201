"""One frontier study's runs: each point's config and run name, the LR sweeps, the seeds added
to the points on a front, and the runs an earlier report (``--reuse``) or other LRs already hold.
:mod:`.run` builds a :class:`Study` from the command line and writes its report."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from mtdao.experiments.common.formatting import NOT_RUN, format_lr
from mtdao.experiments.common.results import read_results
from mtdao.experiments.common.study_flags import base_config
from mtdao.experiments.common.suite import (
    RUNS_DIR,
    SuiteResult,
    load_results,
    run_dir_of,
    run_suite,
    stale_settings,
)
from mtdao.experiments.frontier.grid import FrontierPoint, changed_flags
from mtdao.experiments.frontier.summary import (
    KIND,
    SCHEMA,
    fronts_by_method,
    point_row,
    runs_of_rows,
)
from mtdao.train.config import TrainConfig, default_lr


def point_config(args, point: FrontierPoint, lr: float, seed: int) -> TrainConfig:
    config = base_config(args, seed).replace(lr=lr, **point.fields())
    if point.method == "mtdao":
        config = config.replace(
            betas=tuple(args.betas) if args.betas else None,
            omegas=tuple(args.omegas) if args.omegas else None,
        )
    return config


def run_name(point: FrontierPoint, lr: float, seed: int) -> str:
    return f"{point.name}-lr{format_lr(lr)}-seed{seed}"


def finished_runs(runs: list[tuple[str, TrainConfig]], out: Path) -> SuiteResult:
    """The runs already finished in ``out`` (refusing one trained with other settings); the
    others are reported not run."""
    suite = SuiteResult()
    for name, config in runs:
        results = load_results(run_dir_of(out, name))
        if results is None:
            suite.failures[name] = NOT_RUN
        elif stale_settings(results, config):
            raise ValueError(
                f"{run_dir_of(out, name)}: {'; '.join(stale_settings(results, config))}"
            )
        else:
            suite.results[name] = results
    return suite


class Study:
    """The runs of one frontier study: trains them in phases and remembers their results."""

    def __init__(
        self, args: argparse.Namespace, points: list[FrontierPoint], factors: dict[str, list[float]]
    ) -> None:
        self.args, self.points, self.factors = args, points, factors
        self.out = Path(args.out)
        self.results: dict[str, dict] = {}
        self.failures: dict[str, str] = {}
        self.earlier_rows = earlier_rows(Path(args.reuse), args) if args.reuse else []
        self.earlier = runs_of_rows(self.earlier_rows)
        self.reused: set[str] = set()

    def train(self, runs: list[tuple[str, TrainConfig]], only_finished: bool = False) -> None:
        """Train ``runs`` (or, with ``--no-train``, report them missing); ``only_finished``:
        take those already finished and neither train nor miss the others."""
        runs = [(name, config) for name, config in runs if name not in self.results]
        if self.earlier:
            for name, config in runs:
                earlier = self.earlier.get((tuple(changed_flags(config)), config.training.seed))
                if earlier is not None and load_results(run_dir_of(self.out, name)) is None:
                    self.results[name] = earlier
                    self.reused.add(name)
            runs = [(name, config) for name, config in runs if name not in self.reused]
        if self.args.no_train or only_finished:
            suite = finished_runs(runs, self.out)
        else:
            suite = run_suite(runs, self.out, jobs=self.args.jobs, threads=self.args.threads)
        self.results.update(suite.results)
        if not only_finished:
            self.failures.update(suite.failures)

    def loss(self, name: str) -> float:
        value = self.results.get(name, {}).get("final_val_loss")
        return value if value is not None and math.isfinite(value) else math.inf

    def choose_lrs(self, pins: dict[str, float]) -> dict[str, dict]:
        """Sweep each method's reference point on the first seed; the best LR per method. A
        method with one candidate LR needs no sweep: its reference trains with the other points."""
        seed, references = self.args.seeds[0], {}
        for point in self.points:
            references.setdefault(point.method, point)
        sweeps, runs = {}, []
        for method, point in references.items():
            base = pins.get(method, default_lr(method, self.args.optimizer))
            lrs = sorted({round(base * f, 10) for f in self.factors[method]})
            sweeps[method] = {"point": point.name, "lrs": lrs}
            if len(lrs) > 1:
                runs += [
                    (run_name(point, lr, seed), point_config(self.args, point, lr, seed))
                    for lr in lrs
                ]
        self.train(runs)
        for method, sweep in sweeps.items():
            point = references[method]
            losses = {lr: self.loss(run_name(point, lr, seed)) for lr in sweep["lrs"]}
            sweep["best"] = min(losses, key=losses.get)
        return sweeps

    def rows(self, lr_of: dict[str, float], seeds_of: dict[str, list[int]]) -> list[dict]:
        rows = []
        for point in self.points:
            lr = lr_of[point.name]
            seeds = [
                s
                for s in seeds_of.get(point.name, [self.args.seeds[0]])
                if run_name(point, lr, s) in self.results
            ]
            runs = [self.results[run_name(point, lr, s)] for s in seeds]
            config = point_config(self.args, point, lr, self.args.seeds[0])
            entry = {
                "name": point.name,
                "method": point.method,
                "lr": lr,
                "argv": changed_flags(config),
            }
            rows.append(point_row(entry, runs, seeds))
        return rows

    def run(self, pins: dict[str, float]) -> dict:
        sweeps = self.choose_lrs(pins)
        lr_of = self.choose_point_lrs(sweeps)
        seeds = list(self.args.seeds)

        def runs_of(points, seeds):
            return [
                (run_name(p, lr_of[p.name], s), point_config(self.args, p, lr_of[p.name], s))
                for p in points
                for s in seeds
            ]

        self.train(runs_of(self.points, seeds))
        seeds_of = {p.name: seeds for p in self.points}
        extra = [s for s in self.args.frontier_seeds if s not in seeds]
        if extra:
            # A point's extra seeds move its mean and so the fronts: until every point on a front
            # of the means has them, seed those that lack them (each pass seeds at least one
            # point or stops). A point off the fronts keeps the extra seeds it has.
            seeds_of = {p.name: seeds + extra for p in self.points}
            seeded: set[str] = set()
            while True:
                self.train(runs_of(self.points, extra), only_finished=True)
                fronts = fronts_by_method(self.rows(lr_of, seeds_of))
                on_front = {row["name"] for front in fronts.values() for row in front} - seeded
                if not on_front:
                    break
                self.train(runs_of([p for p in self.points if p.name in on_front], extra))
                seeded |= on_front
        # every sweep's losses, those that needed no runs of their own included
        for sweep in sweeps.values():
            point = next(p for p in self.points if p.name == sweep["point"])
            sweep["losses"] = {
                format_lr(lr): self.loss(run_name(point, lr, seeds[0])) for lr in sweep["lrs"]
            }
            sweep["outside"] = self.outside_sweep(point, sweep["lrs"], seeds[0])
        rows = self.rows(lr_of, seeds_of)
        return {"sweeps": sweeps, "rows": rows, "other_lr_rows": self.other_lr_rows(lr_of)}

    def choose_point_lrs(self, sweeps: dict[str, dict]) -> dict[str, float]:
        """Each point's LR: its method's best, or (--lr-per-point) the best of its own runs at
        the method's sweep LRs on the first seed."""
        if not self.args.lr_per_point:
            return {p.name: sweeps[p.method]["best"] for p in self.points}
        seed = self.args.seeds[0]
        self.train(
            [
                (run_name(p, lr, seed), point_config(self.args, p, lr, seed))
                for p in self.points
                for lr in sweeps[p.method]["lrs"]
            ]
        )
        return {
            p.name: min(sweeps[p.method]["lrs"], key=lambda lr: self.loss(run_name(p, lr, seed)))
            for p in self.points
        }

    def outside_sweep(self, point: FrontierPoint, lrs: list[float], seed: int) -> dict:
        """Finished runs of a reference point at LRs its sweep does not try: the report shows
        them, so that a better LR found elsewhere is not hidden by the sweep's factors."""
        return {
            format_lr(lr): runs[seed].get("final_val_loss", math.inf)
            for lr, runs in self.runs_at_other_lrs(point, lrs).items()
            if seed in runs
        }

    def other_lr_rows(self, lr_of: dict[str, float]) -> list[dict]:
        """Each point at every LR but its own with finished runs (a sweep's, or runs of an
        earlier choice of LR): kept, so that a re-render at a new LR loses none of them."""
        rows = []
        for point in self.points:
            for lr, runs in self.runs_at_other_lrs(point, [lr_of[point.name]]).items():
                seeds = sorted(runs)
                config = point_config(self.args, point, lr, seeds[0])
                entry = {"name": point.name, "method": point.method, "lr": lr}
                entry["argv"] = changed_flags(config)
                rows.append(point_row(entry, [runs[s] for s in seeds], seeds))
        return rows

    def runs_at_other_lrs(self, point: FrontierPoint, lrs: list[float]) -> dict[float, dict]:
        """``{lr: {seed: results}}``: the finished runs of ``point`` at LRs not in ``lrs``, from
        --out (a run trained with other settings is refused) or else the earlier report."""
        found: dict[float, dict[int, dict]] = {}

        def add(lr: float, seed: int, results: dict) -> None:
            if not any(math.isclose(lr, other, rel_tol=1e-6) for other in lrs):
                key = next((k for k in found if math.isclose(k, lr, rel_tol=1e-6)), lr)
                found.setdefault(key, {})[seed] = results

        for row in self.earlier_rows:
            if row["name"] == point.name and row.get("lr") is not None:
                for seed in row["seeds"]:
                    add(row["lr"], seed, self.earlier[tuple(row["argv"]), seed])
        for run_dir in sorted((self.out / RUNS_DIR).glob(f"{point.name}-lr*-seed*")):
            results = load_results(run_dir)
            config = (results or {}).get("config", {})
            lr, seed = config.get("lr"), config.get("seed")
            if lr is None or seed is None or run_name(point, lr, seed) != run_dir.name:
                continue  # unfinished, or a longer point name's run
            stale = stale_settings(results, point_config(self.args, point, lr, seed))
            if stale:
                raise ValueError(f"{run_dir}: {'; '.join(stale)}")
            add(lr, seed, results)
        return dict(sorted(found.items()))


# settings a run's flags may leave out (at their default) but that a default change would move
REUSE_SETTINGS = ("model", "workers", "batch_size", "seq_len", "data_split", "schedule", "warmup")


def earlier_rows(report: Path, args: argparse.Namespace) -> list[dict]:
    """An earlier report's rows, at its chosen LRs and at the others it kept."""
    path = report / "results.json" if report.is_dir() else report
    try:
        results = read_results(path, KIND, SCHEMA)
    except (OSError, ValueError) as error:
        raise ValueError(f"--reuse {report}: {error}") from None
    earlier = results["settings"]
    differ = [
        f"{key} {earlier.get(key)} there, {getattr(args, key)} here"
        for key in REUSE_SETTINGS
        if earlier.get(key) != getattr(args, key)
    ]
    if differ:
        raise ValueError(f"--reuse {report}: its runs were trained otherwise: {'; '.join(differ)}")
    return [*results["rows"], *results.get("other_lr_rows", [])]
