"""``mtdao ablation``: how much each method loses against DDP as the sync period K grows.

Variants, each trained at every K in ``--periods``: Local Adam, and MT-DAO with each slow momentum
in ``--slow-betas`` (weight ``--omega``) under each period rule in ``--policies`` (unified: every
state every K; half-life: slow states less often). One DDP run per seed is the reference; the
degradation of a run is its final validation loss minus DDP's mean.

The paper's ablation (SPEC §5) holds the momentum and second-moment periods at 16 while K_x grows:
``--state-period 16`` does that; without it every state follows the chosen rule, so "unified"
moves all periods together with K.

Output in ``--out``: runs/, results.json, report.md, degradation_vs_k.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mtdao.experiments.report import SIGNIFICANCE_RULE, compare_losses, format_bytes, stats
from mtdao.experiments.suite import (
    add_budget_arguments,
    base_config,
    format_lr,
    parse_lr_pins,
    run_suite,
)
from mtdao.train.config import DEFAULT_LR, TrainConfig
from mtdao.train.methods import SYNC_POLICIES

EPILOG = """
examples:
  mtdao ablation --steps 40 --periods 8 32 --eval-tokens 4096     # a quick smoke run
  mtdao ablation --jobs 2                                          # K = 8 32 128 512
  mtdao ablation --slow-betas 0.95 0.99 0.995 --policies unified --seeds 0 1
"""
LR_METHODS = ("ddp", "local-adam", "mtdao")
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
    return dataclasses.replace(
        base,
        method=variant.method,
        sync_period=period,
        lr=lr,
        betas=variant.betas,
        omegas=variant.omegas,
        sync_policy=variant.sync_policy,
        state_sync_period=state_period,
    )


def run_ablation(args: argparse.Namespace) -> int:
    from mtdao.experiments.plots import plot_degradation_vs_k
    from mtdao.train.metrics import write_json

    periods = sorted(set(args.periods))
    seeds = list(dict.fromkeys(args.seeds))
    if any(k < 1 for k in periods):
        raise ValueError(f"--periods must be positive, got {periods}")
    variants = build_variants(args.slow_betas, args.omega, list(dict.fromkeys(args.policies)))
    pins = parse_lr_pins(args.lr, LR_METHODS)
    lrs = {m: pins.get(m, DEFAULT_LR[args.optimizer]) for m in LR_METHODS}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    runs = [
        (f"ddp-seed{s}", dataclasses.replace(base_config(args, s), method="ddp", lr=lrs["ddp"]))
        for s in seeds
    ]
    for variant in variants:
        for period in periods:
            for seed in seeds:
                config = variant_config(
                    base_config(args, seed), variant, period, lrs[variant.method], args.state_period
                )
                runs.append((run_name(variant, period, seed), config))
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
    settings = {
        "model": args.model,
        "parameters": ddp_runs[0].get("parameters"),
        "optimizer": args.optimizer,
        "workers": args.workers,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "tokens": ddp_runs[0]["tokens"],
        "periods": periods,
        "seeds": seeds,
        "lrs": lrs,
        "omega": args.omega,
        "state_period": args.state_period,
        "data": args.data,
    }
    summary = summarize_ablation(ddp_runs, per_variant, variants, settings, suite.failures)
    write_json(out / "results.json", {**summary, "runs": suite.results})
    curves = {
        name: {
            "periods": [k for k in periods if info["periods"].get(k)],
            "degradation": [
                info["periods"][k]["degradation"] for k in periods if info["periods"].get(k)
            ],
            "std": [info["periods"][k]["noise"] for k in periods if info["periods"].get(k)],
            "color": info["color"],
            "linestyle": info["linestyle"],
        }
        for name, info in summary["variants"].items()
    }
    plot_degradation_vs_k(
        curves,
        out / "degradation_vs_k.png",
        "Loss degradation vs sync period",
        f"{args.model} model, M = {args.workers}, {args.steps} steps, seeds "
        f"{', '.join(map(str, seeds))}; DDP final loss {summary['ddp']['final_val_loss']['mean']:.4f}",
    )
    report = out / "report.md"
    report.write_text(render_ablation_report(summary))
    print(f"report: {report}  plot: {out / 'degradation_vs_k.png'}")
    if suite.failures:
        print(f"{len(suite.failures)} run(s) failed: {', '.join(suite.failures)}")
    return 1 if suite.failures else 0


# -- summary and report ---------------------------------------------------------------------------


def degradation_slope(periods: Sequence[int], degradation: Sequence[float]) -> float | None:
    """Least-squares growth of the degradation per doubling of K; None with fewer than 2 points."""
    points = [(math.log2(k), d) for k, d in zip(periods, degradation) if math.isfinite(d)]
    if len(points) < 2:
        return None
    x, y = np.array(points).T
    return float(np.polyfit(x, y, 1)[0])


def summarize_ablation(
    ddp_runs: Sequence[Mapping[str, Any]],
    per_variant: Mapping[str, Mapping[int, Sequence[Mapping[str, Any]]]],
    variants: Sequence[Variant],
    settings: Mapping[str, Any],
    failures: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    ddp = stats(r["final_val_loss"] for r in ddp_runs)
    by_name = {v.name: v for v in variants}
    summary_variants = {}
    for name, runs_by_period in per_variant.items():
        cells = {}
        for period, runs in runs_by_period.items():
            if not runs:
                continue
            loss = stats(r["final_val_loss"] for r in runs)
            sent = stats(r["bytes_per_worker"] for r in runs)["mean"]
            ddp_bytes = stats(r["ddp_bytes_per_worker"] for r in runs)["mean"]
            cells[period] = {
                "final_val_loss": loss,
                "degradation": loss["mean"] - ddp["mean"],
                "noise": loss["std"] + ddp["std"],
                "versus_ddp": compare_losses(loss, ddp),
                "bytes_per_worker": sent,
                "traffic_vs_ddp": ddp_bytes / sent if sent else math.inf,
                "periods": runs[0].get("periods"),
            }
        ks = sorted(cells)
        variant = by_name[name]
        summary_variants[name] = {
            "method": variant.method,
            "betas": variant.betas,
            "omegas": variant.omegas,
            "sync_policy": variant.sync_policy,
            "color": variant.color,
            "linestyle": variant.linestyle,
            "periods": cells,
            "slope_per_doubling": degradation_slope(ks, [cells[k]["degradation"] for k in ks]),
        }
    return {
        "settings": dict(settings),
        "significance_rule": SIGNIFICANCE_RULE,
        "ddp": {"final_val_loss": ddp},
        "variants": summary_variants,
        "failures": dict(failures or {}),
    }


def ablation_verdict(summary: Mapping[str, Any]) -> str:
    variants = summary["variants"]
    periods = summary["settings"]["periods"]
    parts = []
    slopes = {
        n: v["slope_per_doubling"]
        for n, v in variants.items()
        if v["slope_per_doubling"] is not None
    }
    if slopes:
        parts.append(
            "Growth of the degradation per doubling of K (least-squares slope over log2 K): "
            + ", ".join(f"{n} {s:+.4f}" for n, s in slopes.items())
            + "."
        )
    # the paper's claim: a slower momentum degrades more slowly with K
    for policy in dict.fromkeys(
        v["sync_policy"] for v in variants.values() if v["method"] == "mtdao"
    ):
        ranked = sorted(
            (v["betas"][0], n)
            for n, v in variants.items()
            if v["sync_policy"] == policy and n in slopes
        )
        if len(ranked) >= 2:
            (slow_beta, slow), (fast_beta, fast) = ranked[-1], ranked[0]
            parts.append(_slope_sentence(variants, policy, (slow_beta, slow), (fast_beta, fast)))
    local = variants.get("Local Adam")
    mtdao_names = [n for n, v in variants.items() if v["method"] == "mtdao"]
    if local and mtdao_names:
        wins = []
        for k in periods:
            if k not in local["periods"]:
                continue
            best = min(
                (n for n in mtdao_names if k in variants[n]["periods"]),
                key=lambda n: variants[n]["periods"][k]["final_val_loss"]["mean"],
                default=None,
            )
            if best is None:
                continue
            outcome = compare_losses(
                variants[best]["periods"][k]["final_val_loss"],
                local["periods"][k]["final_val_loss"],
            )
            word = {"better": "beats", "worse": "loses to", "tie": "ties with"}[outcome]
            wins.append(f"K = {k}: the best MT-DAO variant ({best}) {word} Local Adam")
        if wins:
            parts.append("; ".join(wins) + ".")
    seeds = summary["settings"]["seeds"]
    parts.append(
        f"Significance rule: {SIGNIFICANCE_RULE}."
        + (
            " With one seed there is no noise estimate: every difference counts, so treat these as provisional."
            if len(seeds) == 1
            else ""
        )
    )
    return " ".join(parts)


def _slope_sentence(variants, policy, slow: tuple, fast: tuple) -> str:
    """Does the slower momentum's degradation grow more slowly with K? Judged with the
    significance rule on the change of degradation over the whole K range."""
    (slow_beta, slow_name), (fast_beta, fast_name) = slow, fast
    slow_info, fast_info = variants[slow_name], variants[fast_name]
    ks = sorted(set(slow_info["periods"]) & set(fast_info["periods"]))
    span = math.log2(ks[-1] / ks[0]) if len(ks) > 1 else 0.0
    difference = (slow_info["slope_per_doubling"] - fast_info["slope_per_doubling"]) * span
    noise = statistics.fmean(
        info["periods"][k]["noise"] for info in (slow_info, fast_info) for k in (ks[0], ks[-1])
    )
    numbers = (
        f"({slow_info['slope_per_doubling']:+.4f} vs {fast_info['slope_per_doubling']:+.4f} per "
        f"doubling, so {abs(difference):.2g} {'less' if difference < 0 else 'more'} over "
        f"K = {ks[0]}..{ks[-1]}" + ("; one seed, no noise estimate" if noise == 0 else "")
    )
    head = f"With {policy} periods, beta {slow_beta:g} "
    if abs(difference) <= noise:
        return (
            head + f"and beta {fast_beta:g} degrade alike {numbers}, within the noise {noise:.4f})."
        )
    if difference < 0:
        return (
            head + f"degrades more slowly than beta {fast_beta:g} {numbers}): as the paper reports."
        )
    return (
        head + f"degrades faster than beta {fast_beta:g} {numbers}): unlike the paper's ablation."
    )


def render_ablation_report(summary: Mapping[str, Any]) -> str:
    s = summary["settings"]
    variants = summary["variants"]
    periods = s["periods"]
    ddp = summary["ddp"]["final_val_loss"]
    lines = [
        f"# Sync-period ablation: {s['model']} model, M = {s['workers']}, {s['steps']} steps",
        "",
        "## Settings",
        "",
        f"- {s['workers']} workers x {s['batch_size']} sequences x {s['seq_len']} tokens per step, "
        f"{s['steps']} steps ({s['tokens']:,} tokens) per run; base optimizer {s['optimizer']}",
        f"- learning rates: {', '.join(f'{m} {format_lr(v)}' for m, v in s['lrs'].items())}; seeds "
        f"{', '.join(map(str, s['seeds']))}; MT-DAO slow-momentum weight omega {s['omega']:g}",
        f"- DDP reference final val loss: {_pm(ddp)}",
        _state_period_line(s.get("state_period")),
        "",
        "## Verdict",
        "",
        ablation_verdict(summary),
        "",
        "## Final validation loss (degradation vs DDP) by K",
        "",
    ]
    header = ["variant", *(f"K = {k}" for k in periods), "slope / doubling"]
    lines += ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for name, info in variants.items():
        cells = []
        for k in periods:
            cell = info["periods"].get(k)
            cells.append(
                "—"
                if cell is None
                else f"{_pm(cell['final_val_loss'])} ({cell['degradation']:+.4f})"
            )
        slope = info["slope_per_doubling"]
        lines.append(
            "| " + " | ".join([name, *cells, "—" if slope is None else f"{slope:+.4f}"]) + " |"
        )
    lines += ["", "## Traffic per worker (vs DDP)", ""]
    header = ["variant", *(f"K = {k}" for k in periods)]
    lines += ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for name, info in variants.items():
        cells = []
        for k in periods:
            cell = info["periods"].get(k)
            if cell is None:
                cells.append("—")
            else:
                ratio = cell["traffic_vs_ddp"]
                if math.isinf(ratio):
                    ratio_text = "nothing sent"
                else:
                    ratio_text = f"{ratio:.1f}x less" if ratio >= 1 else f"{1 / ratio:.1f}x more"
                cells.append(f"{format_bytes(cell['bytes_per_worker'])} ({ratio_text})")
        lines.append("| " + " | ".join([name, *cells]) + " |")
    lines += ["", "![degradation vs K](degradation_vs_k.png)", ""]
    if summary.get("failures"):
        lines += (
            ["## Failed runs", ""]
            + [f"- `{n}`: {e}" for n, e in summary["failures"].items()]
            + [""]
        )
    return "\n".join(lines)


def _pm(value: Mapping[str, Any]) -> str:
    if not math.isfinite(value["mean"]):
        return "diverged"
    return (
        f"{value['mean']:.4f}" if value["n"] == 1 else f"{value['mean']:.4f} ± {value['std']:.4f}"
    )


def _state_period_line(state_period: int | None) -> str:
    if state_period:
        return (
            f"- every optimizer state (Local Adam's too) averaged every {state_period} steps while "
            "the parameter period K grows, as in the paper's ablation"
        )
    return (
        "- every state follows the variant's period rule (the paper instead fixed the momentum "
        "and second-moment periods at 16 while K grew: `--state-period 16`)"
    )
