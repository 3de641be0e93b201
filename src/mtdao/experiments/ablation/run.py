"""``mtdao ablation``: how much each method loses against DDP as the sync period K grows.

Variants, each trained at every K in ``--periods``: Local Adam, and MT-DAO with each slow momentum
in ``--slow-betas`` (weight ``--omega``) under each period rule in ``--policies`` (unified: every
state every K; half-life: slow states less often). One DDP run per seed is the reference; the
degradation of a run is its final validation loss minus DDP's mean.

The paper's ablation holds the momentum and second-moment periods at 16 while the parameter
period grows: ``--state-period 16`` does that; without it every state follows the chosen rule, so "unified"
moves all periods together with K.

Output in ``--out``: runs/, results.json, report.md, degradation_vs_k.png. The variants are
built in :mod:`.variants`, the numbers computed in :mod:`.summary`, the report
and plot drawn in :mod:`.report`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mtdao.experiments.ablation.variants import Variant, build_variants
from mtdao.experiments.common.study_flags import add_budget_arguments, base_config, parse_lr_pins
from mtdao.experiments.common.suite import run_suite
from mtdao.methods.table import SYNC_POLICIES
from mtdao.train.config import TrainConfig, default_lr

EPILOG = """
examples:
  mtdao ablation --steps 40 --periods 8 32 --slow-betas 0.99 --policies unified --eval-tokens 4096
                                   # a smoke run: 5 runs of 40 steps, 4 evaluations each
  mtdao ablation --jobs 2                                          # K = 8 32 128 512
  mtdao ablation --slow-betas 0.95 0.99 0.995 --policies unified --seeds 0 1

It prints how many runs, steps and evaluations are coming before it trains; rerun the same
command after an interruption: finished runs in --out are kept, not trained again.
"""
LR_METHODS = ("ddp", "local-adam", "mtdao")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "ablation",
        help="loss degradation vs sync period K: Local Adam vs MT-DAO's slow momenta",
        description="Sync-period ablation: final loss minus DDP's as K grows, per variant.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--periods", type=int, nargs="+", default=[8, 32, 128, 512], help="sync periods K")
    add("--slow-betas", type=float, nargs="+", default=[0.99, 0.995], help="MT-DAO slow momenta")
    add("--omega", type=float, default=0.9, help="MT-DAO weight of the slow momentum (0.9)")
    add(
        "--policies",
        nargs="+",
        choices=SYNC_POLICIES,
        default=["unified", "half-life"],
        help="MT-DAO period rules (default: unified half-life)",
    )
    add(
        "--state-period",
        type=int,
        help="hold every optimizer state's period at N while K grows (the paper's ablation: 16)",
    )
    add_budget_arguments(parser, out="runs/ablation", seeds=[0])
    parser.set_defaults(func=run_ablation)


def run_name(variant: Variant, period: int, seed: int) -> str:
    return f"{variant.slug}-K{period}-seed{seed}"


def variant_config(
    base: TrainConfig, variant: Variant, period: int, lr: float, state_period: int | None = None
) -> TrainConfig:
    return base.replace(
        method=variant.method,
        sync_period=period,
        lr=lr,
        betas=variant.betas,
        omegas=variant.omegas,
        sync_policy=variant.sync_policy,
        state_sync_period=state_period,
    )


def ablation_runs(
    args: argparse.Namespace,
    variants: Sequence[Variant],
    periods: Sequence[int],
    seeds: Sequence[int],
    lrs: dict[str, float],
) -> list[tuple[str, TrainConfig]]:
    """DDP once per seed, then every variant at every K and seed."""
    runs = [
        (f"ddp-seed{s}", base_config(args, s).replace(method="ddp", lr=lrs["ddp"])) for s in seeds
    ]
    for variant in variants:
        for period in periods:
            for seed in seeds:
                config = variant_config(
                    base_config(args, seed), variant, period, lrs[variant.method], args.state_period
                )
                runs.append((run_name(variant, period, seed), config))
    return runs


def ablation_settings(
    args: argparse.Namespace, periods, seeds, lrs, ddp_run: dict[str, Any]
) -> dict[str, Any]:
    """Every setting the report states, as resolved."""
    return {
        "model": args.model,
        "parameters": ddp_run.get("parameters"),
        "optimizer": args.optimizer,
        "workers": args.workers,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "tokens": ddp_run["tokens"],
        "periods": periods,
        "seeds": seeds,
        "lrs": lrs,
        "omega": args.omega,
        "state_period": args.state_period,
        "data": args.data,
        "data_split": args.data_split,
    }


def run_ablation(args: argparse.Namespace) -> int:
    from mtdao.experiments.ablation.report import write_ablation_outputs
    from mtdao.experiments.ablation.summary import KIND, SCHEMA, summarize_ablation
    from mtdao.experiments.common.results import stamped
    from mtdao.train.metrics import write_json

    periods = sorted(set(args.periods))
    seeds = list(dict.fromkeys(args.seeds))
    if any(k < 1 for k in periods):
        raise ValueError(f"--periods must be positive, got {periods}")
    variants = build_variants(args.slow_betas, args.omega, list(dict.fromkeys(args.policies)))
    pins = parse_lr_pins(args.lr, LR_METHODS)
    lrs = {m: pins.get(m, default_lr(m, args.optimizer)) for m in LR_METHODS}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    runs = ablation_runs(args, variants, periods, seeds, lrs)
    print(
        f"ablation: {len(variants)} variants x {len(periods)} periods x {len(seeds)} seeds + DDP in {out}"
    )
    suite = run_suite(runs, out, jobs=args.jobs, threads=args.threads)
    ddp_runs = [suite.results[f"ddp-seed{s}"] for s in seeds if f"ddp-seed{s}" in suite.results]
    if not ddp_runs:
        raise ValueError(f"the DDP reference did not finish; see {out / 'runs'}")
    per_variant = {
        v.name: {
            k: [suite.results[n] for s in seeds if (n := run_name(v, k, s)) in suite.results]
            for k in periods
        }
        for v in variants
    }
    settings = ablation_settings(args, periods, seeds, lrs, ddp_runs[0])
    summary = summarize_ablation(ddp_runs, per_variant, variants, settings, suite.failures)
    write_json(out / "results.json", stamped(KIND, SCHEMA, {**summary, "runs": suite.results}))
    report, plot = write_ablation_outputs(out, summary)
    print(f"report: {report}  plot: {plot}")
    if suite.failures:
        print(f"{len(suite.failures)} run(s) failed: {', '.join(suite.failures)}")
    return 1 if suite.failures else 0
