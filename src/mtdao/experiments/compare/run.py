"""``mtdao compare``: every method on the same model, data, token budget and seeds, then a report.

Fairness: each method gets its own learning rate. ``--lr-sweep A B C`` trains the first seed of
every method at each LR, picks each method's best final validation loss, and runs the other seeds
at that LR (the sweep table is in the report); ``--lr METHOD=VALUE`` pins one method instead.
MT-DAO's own knobs (``--betas``, ``--omegas``, the warm-ups) apply to mtdao and qh-ddp only,
``--sync-policy`` to mtdao only (qh-ddp averages gradients every step). ``--preset NAME`` sets a
whole comparison (:mod:`.presets`; paper-16m: the paper's smallest setting), flags beside it win.

Output in ``--out``: runs/<method>-lr<LR>-seed<S>/ (one training run each; finished runs are
reused, so rerunning an interrupted comparison trains only what is missing), results.json, report.md and four plots. Running is
here; the numbers are computed in :mod:`.summary`, report.md drawn in
:mod:`.report`, the figures in :mod:`.plots`.
"""

from __future__ import annotations

import argparse
import math
import shlex
from pathlib import Path
from typing import Any

from mtdao.experiments.common.formatting import format_lr
from mtdao.experiments.common.study_flags import add_budget_arguments, base_config, parse_lr_pins
from mtdao.experiments.common.suite import run_suite
from mtdao.experiments.compare.presets import add_preset_argument, apply_preset
from mtdao.flags import argv_from_namespace
from mtdao.methods.table import METHODS, MULTI_TIMESCALE_METHODS, SYNC_POLICIES
from mtdao.train.config import TrainConfig, default_lr, resolve

EPILOG = """
examples:
  mtdao compare --methods ddp local-adam mtdao --steps 40 --eval-tokens 4096 --seeds 0
                                   # a smoke run: 3 runs of 40 steps, 4 evaluations each
  mtdao compare --lr-sweep 8e-3 1.6e-2 --jobs 2 --threads 1     # the reported comparison
  mtdao compare --methods ddp local-adam mtdao --lr mtdao=8e-3 --betas 0.95 --omegas 0.7
  mtdao compare --preset paper-16m --out runs/paper-16m          # the paper's 16M setting (GPU)
  mtdao compare --preset defaults-card --quick --jobs 2 --threads 1  # the defaults card's subset

It prints how many runs, steps and evaluations are coming before it trains; rerun the same
command after an interruption: finished runs in --out are kept, not trained again.
"""


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="run every method on the same budget and seeds; write report.md and plots",
        description="Compare DDP, QH-DDP, Local Adam, DiLoCo, DES-LOC and MT-DAO at equal tokens.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="methods to run")
    add_budget_arguments(parser, out="runs/compare", seeds=[0, 1, 2])
    add("--sync-period", type=int, default=32, help="K for the local methods (default: 32)")
    add(
        "--lr-sweep",
        type=float,
        nargs="+",
        metavar="LR",
        help="pick each unpinned method's LR from these on the first seed",
    )
    add("--betas", type=float, nargs="+", help="mtdao/qh-ddp momentum decays")
    add("--omegas", type=float, nargs="+", help="mtdao/qh-ddp mixing weights")
    add("--omega-warmup", type=float, default=0.0, help="mtdao/qh-ddp omega warm-up fraction")
    add(
        "--beta-warmup",
        type=float,
        help="mtdao/qh-ddp slow-beta warm-up fraction (default: mtdao train's)",
    )
    add("--sync-policy", choices=SYNC_POLICIES, help="mtdao's period rule (default: unified)")
    add_preset_argument(parser)
    parser.set_defaults(func=run_compare, parser=parser)


def method_config(args: argparse.Namespace, method: str, seed: int, lr: float) -> TrainConfig:
    """The run of ``method`` at ``lr`` and ``seed``; identical budget for every method."""
    config = base_config(args, seed).replace(method=method, sync_period=args.sync_period, lr=lr)
    if method in MULTI_TIMESCALE_METHODS:
        config = config.replace(
            betas=tuple(args.betas) if args.betas else None,
            omegas=tuple(args.omegas) if args.omegas else None,
            omega_warmup=args.omega_warmup,
            beta_warmup=args.beta_warmup,
        )
    if method == "mtdao":
        config = config.replace(sync_policy=args.sync_policy)
    return config


def run_name(method: str, lr: float, seed: int) -> str:
    return f"{method}-lr{format_lr(lr)}-seed{seed}"


def sweep_learning_rates(args, methods, out: Path) -> tuple[dict[str, Any], dict, dict]:
    """Seed ``seeds[0]`` of each method at every sweep LR; returns (sweep table, results, failures)."""
    from mtdao.experiments.compare.summary import lr_key

    seed, lrs = args.seeds[0], sorted(set(args.lr_sweep))
    runs = [
        (run_name(m, lr, seed), method_config(args, m, seed, lr)) for m in methods for lr in lrs
    ]
    print(f"LR sweep: {len(methods)} methods x {len(lrs)} LRs on seed {seed}")
    suite = run_suite(runs, out, jobs=args.jobs, threads=args.threads)
    losses: dict[str, dict[str, float | None]] = {}
    best: dict[str, float | None] = {}
    for method in methods:
        losses[method] = {}
        for lr in lrs:
            results = suite.results.get(run_name(method, lr, seed))
            loss = results.get("final_val_loss") if results else None
            losses[method][lr_key(lr)] = math.inf if results and loss is None else loss
        finite = [(loss, lr) for lr in lrs if _finite(loss := losses[method][lr_key(lr)])]
        best[method] = min(finite)[1] if finite else None
    sweep = {"seed": seed, "lrs": lrs, "losses": losses, "best": best}
    return sweep, suite.results, suite.failures


def _finite(value) -> bool:
    return value is not None and math.isfinite(value)


def run_compare(args: argparse.Namespace) -> int:
    from mtdao.experiments.common.results import stamped, write_report
    from mtdao.experiments.compare.plots import write_compare_plots
    from mtdao.experiments.compare.report import render
    from mtdao.experiments.compare.summary import KIND, SCHEMA, summarize_compare

    if args.preset == "defaults-card":
        from mtdao.experiments.defaults_card.run import run_defaults_card

        apply_preset(args)
        return run_defaults_card(args)
    if args.quick or args.collect or args.reuse:
        raise ValueError("--quick, --collect and --reuse belong to --preset defaults-card")
    apply_preset(args)
    methods = list(dict.fromkeys(args.methods))
    seeds = list(dict.fromkeys(args.seeds))
    args.seeds = seeds
    pins = parse_lr_pins(args.lr, methods)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    resolve(method_config(args, methods[0], seeds[0], 1e-3))  # bad flags fail before training

    chosen, sweep, all_results, failures = choose_learning_rates(args, methods, pins, out)
    requested, methods = methods, [m for m in methods if m in chosen]

    runs = [
        (run_name(m, chosen[m], s), method_config(args, m, s, chosen[m]))
        for m in methods
        for s in seeds
    ]
    print(f"comparison: {len(methods)} methods x {len(seeds)} seeds in {out}")
    suite = run_suite(runs, out, jobs=args.jobs, threads=args.threads)
    all_results.update(suite.results)
    failures.update(suite.failures)
    runs_by_method = {
        m: [
            suite.results[name]
            for s in seeds
            if (name := run_name(m, chosen[m], s)) in suite.results
        ]
        for m in methods
    }
    runs_by_method.update({m: [] for m in requested if m not in chosen})  # reported as missing
    if not any(runs_by_method.values()):
        raise ValueError(f"no run finished; see the train.log files under {out / 'runs'}")
    summary = summarize_compare(
        runs_by_method,
        settings=resolved_settings(args, methods, chosen, pins, sweep, all_results),
        sweep=sweep,
        failures=failures,
        compute_runs=all_results.values(),
    )
    report = write_report(out, stamped(KIND, SCHEMA, summary), render)
    write_compare_plots(out, summary)
    print(f"report: {report}  results: {out / 'results.json'}  plots: {out}/*.png")
    if failures:
        print(f"{len(failures)} run(s) failed: {', '.join(failures)}")
    return 1 if failures else 0


def choose_learning_rates(args, methods, pins, out: Path) -> tuple[dict, Any, dict, dict]:
    """Each method's LR: pinned, else the sweep's best on the first seed (a method none of whose
    sweep runs finished is left out), else the default. Returns (chosen LRs, the sweep table or
    None, the sweep's results and failures)."""
    sweep, all_results, failures = None, {}, {}
    chosen = {m: pins[m] for m in methods if m in pins}
    swept = [m for m in methods if m not in pins]
    if args.lr_sweep and swept:
        sweep, all_results, failures = sweep_learning_rates(args, swept, out)
        for method in swept:
            if sweep["best"][method] is not None:
                chosen[method] = sweep["best"][method]
            else:
                print(f"{method}: no LR of the sweep finished; it is left out of the comparison")
    elif swept:
        chosen.update({m: default_lr(m, args.optimizer) for m in swept})
    return chosen, sweep, all_results, failures


def resolved_settings(args, methods, chosen, pins, sweep, all_results) -> dict[str, Any]:
    """Every setting the report states, as resolved (not as typed)."""
    example = next(iter(all_results.values()), {})
    config = base_config(args, args.seeds[0])
    if sweep:
        selection = (
            f"best final val loss of seed {sweep['seed']} over "
            f"{', '.join(format_lr(lr) for lr in sweep['lrs'])} per method"
        )
    else:
        selection = "each method's default for " + args.optimizer
    if pins:
        selection += "; pinned: " + ", ".join(f"{m} {format_lr(v)}" for m, v in pins.items())
    return {
        "methods": methods,
        "preset": args.preset,
        "model": args.model,
        "parameters": example.get("parameters"),
        "data": args.data,
        "data_split": args.data_split,
        "tokenizer": args.tokenizer,
        "optimizer": args.optimizer,
        "schedule": config.lr_schedule.schedule,
        "workers": args.workers,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "tokens": args.steps * config.tokens_per_step,
        "sync_period": args.sync_period,
        "eval_every": config.job.eval_every,
        "eval_tokens": args.eval_tokens,
        "seeds": args.seeds,
        "lrs": chosen,
        "lr_selection": selection,
        "betas": args.betas,
        "omegas": args.omegas,
        "omega_warmup": args.omega_warmup,
        "beta_warmup": args.beta_warmup,
        "sync_policy": args.sync_policy,
        "jobs": args.jobs,
        "threads": args.threads,
        "command": command_line(args),
    }


def command_line(args: argparse.Namespace) -> str:
    """``mtdao compare`` with every resolved flag, to rerun exactly this comparison."""
    return shlex.join(["mtdao", "compare", *argv_from_namespace(args.parser, args)])
