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

Output in ``--report``: frontier.png, report.md, frontier.json (every point's
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
from pathlib import Path

from mtdao.experiments.common.study_flags import (
    add_budget_arguments,
    parse_lr_pins,
    typed_command,
)
from mtdao.experiments.frontier.grid import GRIDS, select
from mtdao.experiments.frontier.study import Study, point_config
from mtdao.train.config import resolve

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
    settings = {
        # a --no-train re-render names the command that trains the runs it reports
        "command": typed_command("frontier", leave_out=["--no-train"]),
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
