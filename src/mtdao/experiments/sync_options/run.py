"""``mtdao sync-options``: what each way of sending a round costs in loss, against the float32
blocking round, and what it saves in traffic.

Every option is MT-DAO with one change to its rounds (``--sync-delay``, ``--sync-fragments``,
``--sync-dtype``, ``--error-feedback``, or a combination), trained over the same seeds as the
float32 blocking reference, at K = 32 with the states on the period rule's periods and with the
states every 16 steps (``--state-sync-period 16``, the paper's ablation setting). A difference
counts only under the significance rule of :mod:`mtdao.experiments.common.formatting`.

Output in ``--out``: runs/, results.json, report.md, options.png. The numbers are computed in
:mod:`.summary`, the report and plot drawn in :mod:`.report`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from mtdao.experiments.common.formatting import NOT_RUN
from mtdao.experiments.common.study_flags import add_budget_arguments, base_config
from mtdao.experiments.common.suite import (
    SuiteResult,
    load_results,
    run_dir_of,
    run_suite,
    stale_settings,
)
from mtdao.experiments.sync_options.report import plot_options, render_report
from mtdao.experiments.sync_options.summary import summarize
from mtdao.train.config import TrainConfig

REFERENCE = "fp32"
# option name -> the TrainConfig fields it changes; the first is the reference
OPTIONS: dict[str, dict] = {
    REFERENCE: {},
    "delay4": dict(sync_delay=4),
    "delay16": dict(sync_delay=16),
    "frag4": dict(sync_fragments=4),
    "bf16": dict(sync_dtype=("bf16",)),
    "fp8": dict(sync_dtype=("fp8",)),
    "int8": dict(sync_dtype=("int8",)),
    "int8-ef": dict(sync_dtype=("int8",), error_feedback=True),
    "combo": dict(sync_delay=4, sync_fragments=4, sync_dtype=("int8",), error_feedback=True),
}
# setting name -> state sync period (None: the period rule's)
SETTINGS: dict[str, int | None] = {"k32": None, "state16": 16}


def option_flags(option: str) -> str:
    """The ``mtdao train`` flags an option adds, for the report."""
    flags = []
    for name, value in OPTIONS[option].items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        else:
            flags.append(f"{flag} {' '.join(value) if isinstance(value, tuple) else value}")
    return " ".join(flags)


def run_name(setting: str, option: str, seed: int) -> str:
    return f"{setting}-{option}-seed{seed}"


def option_runs(args: argparse.Namespace) -> list[tuple[str, TrainConfig]]:
    """Every (setting, option, seed) run; an option whose delay is not below the setting's
    shortest period is left out of that setting."""
    runs = []
    for setting in args.settings:
        state_period = SETTINGS[setting]
        for option in args.options:
            shortest = min(p for p in (args.sync_period, state_period) if p is not None)
            if OPTIONS[option].get("sync_delay", 0) >= shortest:
                continue
            for seed in args.seeds:
                config = base_config(args, seed).replace(
                    method="mtdao",
                    sync_period=args.sync_period,
                    state_sync_period=state_period,
                    **OPTIONS[option],
                )
                runs.append((run_name(setting, option, seed), config))
    return runs


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "sync-options",
        help="loss and traffic of overlapped, fragmented and quantized rounds vs float32 rounds",
        description="MT-DAO with each sync option against the float32 blocking round: final "
        "validation loss over seeds (significance rule), traffic against DDP.",
    )
    add_budget_arguments(parser, out="runs/sync-options", seeds=[0, 1, 2])
    add = parser.add_argument
    add("--sync-period", type=int, default=32, help="K (default: 32)")
    add(
        "--options",
        nargs="+",
        choices=list(OPTIONS),
        default=list(OPTIONS),
        help="options to run (the reference, fp32, is always included)",
    )
    add(
        "--settings",
        nargs="+",
        choices=list(SETTINGS),
        default=list(SETTINGS),
        help="k32: states on the period rule; state16: --state-sync-period 16 (default: both)",
    )
    add(
        "--no-train",
        action="store_true",
        help="train nothing: report the runs already finished in --out (the others as missing)",
    )
    parser.set_defaults(func=run_sync_options)


def finished_runs(runs: list[tuple[str, TrainConfig]], out: Path) -> SuiteResult:
    """The runs already finished in ``out`` (refusing one trained with other settings)."""
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


def run_sync_options(args: argparse.Namespace) -> int:
    if args.lr:
        raise ValueError("--lr: sync-options runs every option at the harness's default LR")
    args.options = [REFERENCE] + [o for o in args.options if o != REFERENCE]
    out = Path(args.out)
    runs = option_runs(args)
    if args.no_train:
        suite = finished_runs(runs, out)
    else:
        suite = run_suite(runs, out, jobs=args.jobs, threads=args.threads)
    command = shlex.join(["mtdao", *sys.argv[1:]]) if sys.argv[1:2] == ["sync-options"] else ""
    summary = summarize(
        suite.results,
        options={name: option_flags(name) for name in args.options},
        settings=args.settings,
        seeds=args.seeds,
        command=command or "mtdao sync-options",
        failures=suite.failures,
    )
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    (out / "report.md").write_text(render_report(summary))
    plot_options(out, summary)
    print(f"report: {out / 'report.md'}  plot: {out / 'options.png'}")
    return 0 if not suite.failures else 1
