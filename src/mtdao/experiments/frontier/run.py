"""``mtdao frontier``: at each traffic budget, which method gives the best model?

Every point of a grid (:mod:`.grid`: DDP, Local Adam, DiLoCo, DES-LOC and MT-DAO over K,
codec recipes and state periods) trains at equal tokens (by default 3000 steps of the micro model,
4 workers); the report plots final validation loss against bytes per worker with each method's
Pareto frontier, and tabulates the best method at 10x to 1000x less traffic than DDP.

Learning rates: each method's first point of the grid (its reference) is trained on the first
seed at the method's LR times each ``--lr-factors`` (``METHOD=F,F,...`` gives one method its own
factors); the best becomes that method's LR for all its points (``--lr METHOD=VALUE`` sets the
base), or, with ``--lr-per-point``, every point trains at each of its method's LRs and keeps its
own best (a method's best LR at K = 32 need not be its best at K = 256). Seeds: every point runs on the first seed;
``--frontier-seeds`` are then added to the points on a method's Pareto frontier
(a point off the front reports the ones it already has).
``--betas``/``--omegas`` set MT-DAO's momenta (its defaults suit runs of 3000 steps or more).

Output in ``--report``: frontier.png, report.md, frontier.json (the issue's schema: every point's
exact ``mtdao train`` argument list, losses over seeds, bytes per worker, steady-state reduction)
and results.json (everything report.md is rendered from).
Runs live in ``--out``/runs/<point>-lr<LR>-seed<S>; finished runs are reused. ``--reuse REPORT``
also takes the runs an earlier report holds (same point flags, LR and seed) where ``--out`` has
none, so a report grows by new points after its run directories are gone. results.json also keeps
each point's finished runs at LRs its method did not choose (``other_lr_rows``): a re-render at a
new LR loses none of them, and report.md lists them beside the chosen row.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path

from mtdao.experiments.common.formatting import format_lr
from mtdao.experiments.common.results import read_results
from mtdao.experiments.common.suite import (
    RUNS_DIR,
    add_budget_arguments,
    base_config,
    load_results,
    parse_lr_pins,
    run_dir_of,
    run_suite,
    stale_settings,
)
from mtdao.experiments.frontier.grid import GRIDS, FrontierPoint, changed_flags, select
from mtdao.experiments.frontier.summary import (
    KIND,
    SCHEMA,
    fronts_by_method,
    point_row,
    runs_of_rows,
)
from mtdao.train.config import TrainConfig, default_lr, resolve

DEFAULT_LR_FACTORS = (1 / math.sqrt(2), 1.0, math.sqrt(2))
QUICK = dict(steps=300, eval_tokens=16384, lr_factors=[1.0])


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "frontier",
        help="final loss against traffic for every method, codec and K; Pareto frontiers",
        description=__doc__.splitlines()[0].replace("``", ""),  # no RST markup on a terminal
    )
    add_budget_arguments(parser, out="runs/frontier", seeds=[0], steps=3000)
    add = parser.add_argument
    add("--quick", action="store_true", help="the quick grid, 300 steps, no LR sweep")
    add("--points", nargs="+", help="train only these points of the grid (see --list)")
    add("--list", action="store_true", help="print the grid's points and exit")
    add(
        "--lr-factors",
        nargs="+",
        default=list(DEFAULT_LR_FACTORS),
        metavar="[METHOD=]F[,F...]",
        help="each method's reference point is swept at its LR times these; METHOD=F,F,... "
        "gives one method its own (default: 0.71 1 1.41)",
    )
    add(
        "--frontier-seeds",
        type=int,
        nargs="*",
        default=[1, 2],
        help="seeds added to the points on a method's Pareto frontier (default: 1 2)",
    )
    add(
        "--lr-per-point",
        action="store_true",
        help="every point, not only its method's reference, trains at each LR of its method's "
        "sweep on the first seed and keeps its best",
    )
    add("--betas", type=float, nargs="+", help="MT-DAO's momentum decays")
    add("--omegas", type=float, nargs="+", help="MT-DAO's mixing weights")
    add("--report", default="reports/frontier", help="report directory (reports/frontier)")
    add("--no-train", action="store_true", help="train nothing; report the finished runs")
    add(
        "--reuse",
        metavar="REPORT",
        help="take the runs an earlier frontier report holds (its results.json) instead of "
        "training them, where --out has none",
    )
    parser.set_defaults(func=run_frontier, frontier_parser=parser)


def parse_lr_factors(values, methods: list[str]) -> dict[str, list[float]]:
    """``["1", "local-adam=0.71,1,1.41"]`` -> each method's sweep factors: a ``METHOD=`` entry
    for that method alone (whatever the order), the bare ones (or, with none, the default
    factors) for every other method."""
    bare: list[float] = []
    own: dict[str, list[float]] = {}
    for value in values:
        method, _, numbers = str(value).rpartition("=")
        if method and method not in methods:
            raise ValueError(
                f"--lr-factors: unknown method {method!r}; the grid has {', '.join(methods)}"
            )
        try:
            factors = [float(number) for number in numbers.split(",")]
        except ValueError:
            raise ValueError(f"--lr-factors: {value!r} is not [METHOD=]F[,F...]") from None
        if not all(0 < factor < math.inf for factor in factors):
            raise ValueError(f"--lr-factors: {value!r}: a factor must be > 0")
        if method:
            own.setdefault(method, []).extend(factors)
        else:
            bare.extend(factors)
    return {method: own.get(method, bare or list(DEFAULT_LR_FACTORS)) for method in methods}


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


def apply_quick(args: argparse.Namespace) -> None:
    """--quick: the quick budget for every flag left at its default."""
    parser = args.frontier_parser
    for name, value in QUICK.items():
        if getattr(args, name) == parser.get_default(name):
            setattr(args, name, value)
    if args.eval_every is None:
        args.eval_every = max(1, args.steps // 6)
    if args.frontier_seeds == parser.get_default("frontier_seeds"):
        args.frontier_seeds = []


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
            from mtdao.experiments.sync_options.run import finished_runs

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


def run_frontier(args: argparse.Namespace) -> int:
    from mtdao.experiments.frontier.report import write_frontier_report

    if args.quick:
        apply_quick(args)
    grid = GRIDS["quick" if args.quick else "full"]()
    points = select(grid, args.points)
    if args.list:
        for point in points:
            print(point.name)
        return 0
    # a pin may name any method of the grid: the same --lr then serves every --points slice
    methods = list(dict.fromkeys(p.method for p in grid))
    pins = parse_lr_pins(args.lr, methods)
    factors = parse_lr_factors(args.lr_factors, methods)
    for point in points:  # bad flags fail before anything trains
        resolve(point_config(args, point, 1e-3, args.seeds[0]))
    study = Study(args, points, factors)
    outcome = study.run(pins)
    # the study's command: a --no-train re-render reports the runs the same command trains
    argv = [a for a in sys.argv[1:] if a != "--no-train"]
    command = shlex.join(["mtdao", *argv]) if argv[:1] == ["frontier"] else ""
    settings = {
        "command": command or "mtdao frontier",
        "model": args.model,
        "workers": args.workers,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "data_split": args.data_split,
        "schedule": args.schedule,
        "warmup": args.warmup,
        "seeds": list(args.seeds),
        "frontier_seeds": list(args.frontier_seeds),
        "grid": "quick" if args.quick else "full",
        "lr_factors": {
            method: factors[method] for method in dict.fromkeys(p.method for p in points)
        },
        "lr_per_point": bool(args.lr_per_point),
        "reused_runs": len(study.reused),
    }
    report = Path(args.report)
    write_frontier_report(report, settings, outcome, study.failures)
    print(f"report: {report / 'report.md'}  plot: {report / 'frontier.png'}")
    return 0 if not study.failures else 1
