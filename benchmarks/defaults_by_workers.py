"""Does MT-DAO's gap to DDP grow with the number of workers? Every method at its defaults at
M = 4, 16 and 64 workers.

    OMP_NUM_THREADS=1 python benchmarks/defaults_by_workers.py --corpora vim builtin \
        --workers 4 16 64 --seeds 0 --jobs 2 --threads 1 --out runs/workers \
        --report reports/workers-scaling

Every run is ``mtdao train --method METHOD --model micro --steps 3000 --workers M --batch-size B
--data CORPUS --seed S`` and nothing else (K = 32 and every other setting at the method's
defaults), but MT-DAO's, which adds ``--sync-period 32`` (:data:`PINNED`): its default rounds
differ (:data:`~mtdao.methods.defaults.DEFAULT_ROUNDS`, the option ``K4-int4-state-period32``), and
the study compares K = 32 across M. The global batch is fixed at 64 sequences (B = 64 / M: each
step costs the same and DDP is the same optimizer at every M); ``--per-worker-batch B`` fixes each
worker's batch instead (the global batch then grows with M). Finished runs are kept in ``--out``
and not trained again. Prints, per corpus and M, each method's final validation loss (mean ± std
over the seeds that finished) and MT-DAO's relative gap to DDP and to Local Adam under the defaults
card's significance rule; ``--report DIR`` also writes report.md, results.json and workers.png
there.

``--options LABEL ...`` also trains MT-DAO (or DiLoCo) with one setting changed from its defaults
(:data:`OPTIONS`: the study's screen of what might keep the default's quality as M grows) in
every corpus, M and seed given, and reports each against the method's defaults and DDP over the
same seeds; with ``--collect`` only the cells that finished are shown.

``--reuse REPORT.json`` continues a study whose earlier runs are not in ``--out`` (trained on
another machine): the final losses, bytes and traffic of an earlier report's results.json stand in
for the runs of the same name that ``--out`` lacks (its steps and batch rule must be the same), and
those runs are not trained again.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mtdao.experiments.common.corpora import corpus_paths
from mtdao.experiments.common.figures import color, saved_figure
from mtdao.experiments.common.formatting import LABELS, SIGNIFICANCE_RULE, gap, pm, stats
from mtdao.experiments.common.results import write_report
from mtdao.experiments.common.suite import run_suite
from mtdao.train.config import TrainConfig

METHODS = ("ddp", "local-adam", "diloco", "desloc", "mtdao")
GLOBAL_BATCH = 64  # sequences a step over all workers, unless --global-batch
KIND, SCHEMA = "workers-scaling", 1  # results.json's study and layout (tests re-render from it)
OUTER_SCHEDULE = {"outer_momentum_warmup": 10, "outer_momentum_decay": 0.2}


def quantized_rounds(sync_period: int, state_sync_period: int, params: str) -> dict[str, Any]:
    """The parameters every ``sync_period`` steps as ``params`` pseudo-gradients with error
    feedback, the states as int8 every ``state_sync_period``: an option's settings."""
    return {
        "sync_period": sync_period,
        "state_sync_period": state_sync_period,
        "sync_dtype": (f"params={params}", "momenta=int8", "second-moment=int8"),
        "error_feedback": True,
    }


OUTER_SGD = {"outer_step": "nesterov", "outer_momentum": 0.0}

# MT-DAO's column (and its options' base) at every M: K = 32 in float32, its default until 2026-12-07
PINNED = {"mtdao": {"sync_period": 32}}
# label -> (method, the settings changed from its defaults, as TrainConfig fields)
OPTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "state-period4": ("mtdao", {"state_sync_period": 4}),
    "state-period8": ("mtdao", {"state_sync_period": 8}),
    "state-period16": ("mtdao", {"state_sync_period": 16}),
    "betas0.995": ("mtdao", {"betas": (0.995,), "beta_ramp": 9.0}),
    "betas0.999": ("mtdao", {"betas": (0.999,), "beta_ramp": 9.0}),
    # a worker's second moment sees its own small batch's noise: a longer memory at large M?
    "beta2-0.99": ("mtdao", {"beta2": 0.99}),
    "beta2-0.997": ("mtdao", {"beta2": 0.997}),
    "omegas0.97": ("mtdao", {"omegas": (0.97,)}),
    "omegas0.99": ("mtdao", {"omegas": (0.99,)}),
    "lr0.004": ("mtdao", {"lr": 0.004}),
    "lr0.016": ("mtdao", {"lr": 0.016}),
    "lr0.032": ("mtdao", {"lr": 0.032}),
    "radial-momenta": ("mtdao", {"radial_directional": ("momenta",)}),
    "radial-params": ("mtdao", {"radial_directional": ("params",)}),
    "nesterov": ("mtdao", {"outer_step": "nesterov"}),
    "nesterov-schedule": ("mtdao", {"outer_step": "nesterov", **OUTER_SCHEDULE}),
    "outer-schedule": ("diloco", OUTER_SCHEDULE),
    "K11": ("mtdao", {"sync_period": 11}),  # about --state-sync-period 8's traffic
    "K128": ("mtdao", {"sync_period": 128}),
    "K128-state-period32": ("mtdao", {"sync_period": 128, "state_sync_period": 32}),
    # more rounds in about the default's bytes: each round quantized (the frontier's codecs)
    "K8-int8": ("mtdao", {"sync_period": 8, "sync_dtype": ("int8",), "error_feedback": True}),
    "state-period8-int8": (
        "mtdao",
        {"state_sync_period": 8, "sync_dtype": ("momenta=int8", "second-moment=int8")},
    ),
    "K4-int4-state-period16": ("mtdao", quantized_rounds(4, 16, "int4")),
    "K4-int4": ("mtdao", {"sync_period": 4, "sync_dtype": ("int4",), "error_feedback": True}),
    "K2-int2-state-period16": ("mtdao", quantized_rounds(2, 16, "int2")),
    "K4-int4-state-period32": ("mtdao", quantized_rounds(4, 32, "int4")),
    "K2-int4-state-period32": ("mtdao", quantized_rounds(2, 32, "int4")),
    # K = 128 retried as the rule above: 8 times the parameter rounds in 4 bits, half its bytes
    "K16-int4-state-period128": ("mtdao", quantized_rounds(16, 128, "int4")),
    # is the gap at 64 workers the locality of the rounds, or each worker's Adam normalizing its
    # own one-sequence gradient? Everything averaged after every step leaves only the latter
    "K1-state-period1": ("mtdao", {"sync_period": 1, "state_sync_period": 1}),
    "K4-int4-state-period32-lr0.016": ("mtdao", {**quantized_rounds(4, 32, "int4"), "lr": 0.016}),
    # the default rounds with a second moment that averages as many sequences at 1 a worker as
    # β2 = 0.95 does at 16 (1 / (1 - β2) steps times the per-worker batch), and half way there
    "K4-int4-state-period32-beta2-0.99": (
        "mtdao",
        {**quantized_rounds(4, 32, "int4"), "beta2": 0.99},
    ),
    "K4-int4-state-period32-beta2-0.997": (
        "mtdao",
        {**quantized_rounds(4, 32, "int4"), "beta2": 0.997},
    ),
    # the round's average scaled up (an outer SGD step past the average, no momentum): the
    # averaged update is less noisy than each worker's, so it may take a larger step than they do
    "K4-int4-state-period32-outer-lr1.5": (
        "mtdao",
        {**quantized_rounds(4, 32, "int4"), **OUTER_SGD, "outer_lr": 1.5},
    ),
    "K4-int4-state-period32-outer-lr2": (
        "mtdao",
        {**quantized_rounds(4, 32, "int4"), **OUTER_SGD, "outer_lr": 2.0},
    ),
    "K4-int4-state-period32-outer-lr1.25": (
        "mtdao",
        {**quantized_rounds(4, 32, "int4"), **OUTER_SGD, "outer_lr": 1.25},
    ),
    # with each worker's one-sequence gradient no longer clipped on its own
    "K4-int4-state-period32-outer-lr1.5-noclip": (
        "mtdao",
        {**quantized_rounds(4, 32, "int4"), **OUTER_SGD, "outer_lr": 1.5, "grad_clip": 0.0},
    ),
    # the outer step's momentum smooths the rounds' averages over about two rounds; 0.75 with
    # momentum 0.5 steps 1.5 times a steady average, like the rule
    "K4-int4-state-period32-outer-lr0.75-momentum0.5": (
        "mtdao",
        {**quantized_rounds(4, 32, "int4"), **OUTER_SGD, "outer_lr": 0.75, "outer_momentum": 0.5},
    ),
    "K4-int4-state-period32-outer-lr1.5-beta2-0.99": (
        "mtdao",
        {**quantized_rounds(4, 32, "int4"), **OUTER_SGD, "outer_lr": 1.5, "beta2": 0.99},
    ),
    # the default rounds with the parameters' pseudo-gradients in 8 bits: what 4 bits cost
    "K4-int8-state-period32": ("mtdao", quantized_rounds(4, 32, "int8")),
    "K4-int4-state-period32-lr0.006": ("mtdao", {**quantized_rounds(4, 32, "int4"), "lr": 0.006}),
    "K4-int4-state-period32-lr0.011": ("mtdao", {**quantized_rounds(4, 32, "int4"), "lr": 0.011}),
    # less of the raw one-sequence gradient in each local step
    "K4-int4-state-period32-omegas0.97": (
        "mtdao",
        {**quantized_rounds(4, 32, "int4"), "omegas": (0.97,)},
    ),
    "K8-int8-state-period32": (
        "mtdao",
        {
            "sync_period": 8,
            "state_sync_period": 32,
            "sync_dtype": ("int8",),
            "error_feedback": True,
        },
    ),
}


def flags(changes: dict[str, Any]) -> str:
    """The settings as ``mtdao train``'s flags."""

    def shown(value: Any) -> str:
        return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)

    def flag(name: str, value: Any) -> str:
        flag = f"--{name.replace('_', '-')}"
        return flag if value is True else f"{flag} {shown(value)}"  # a switch takes no value

    return " ".join(flag(k, v) for k, v in changes.items())


def batch_of(args: argparse.Namespace, workers: int) -> int:
    if args.per_worker_batch:
        return args.per_worker_batch
    if args.global_batch % workers:
        raise SystemExit(
            f"--workers {workers} does not divide the global batch of {args.global_batch}"
        )
    return args.global_batch // workers


def run_name(corpus: str, workers: int, batch: int, method: str, seed: int, steps: int) -> str:
    return f"{corpus}-{steps}-M{workers}x{batch}-{method}-s{seed}"


def option_variant(label: str) -> str:
    """An option's name in its runs' names: its method, then its label."""
    return f"{OPTIONS[label][0]}-{label}"


def variants(args: argparse.Namespace) -> list[tuple[str, str, dict[str, Any]]]:
    """(name in a run's name, method, changed settings): each method at its defaults, then each
    option."""
    defaults = [(method, method, {}) for method in args.methods]
    options = [(option_variant(o), *OPTIONS[o]) for o in args.options]
    return defaults + options


def planned_runs(args: argparse.Namespace, data: dict[str, str]) -> list[tuple[str, TrainConfig]]:
    """Seed by seed, then corpus and M in the order given, so that an interrupted study has its
    first cells complete."""
    runs = []
    for seed in args.seeds:
        for corpus in args.corpora:
            for workers in args.workers:
                batch = batch_of(args, workers)
                for variant, method, changes in variants(args):
                    changes = {**PINNED.get(method, {}), **changes}
                    config = TrainConfig.of(
                        method=method, model="micro", steps=args.steps, workers=workers,
                        batch_size=batch, data=data[corpus], seed=seed, progress=False, **changes,
                    )  # fmt: skip
                    name = run_name(corpus, workers, batch, variant, seed, args.steps)
                    runs.append((name, config))
    return runs


def finished_runs(args, results: dict[str, dict], corpus: str, workers: int, variant: str):
    """{seed: results} of the runs of one cell that finished with a final loss."""
    batch = batch_of(args, workers)
    names = {s: run_name(corpus, workers, batch, variant, s, args.steps) for s in args.seeds}
    return {
        s: results[n]
        for s, n in names.items()
        if n in results and results[n].get("final_val_loss") is not None
    }


def reused_runs(args: argparse.Namespace, path: Path) -> dict[str, dict]:
    """{run name: the figures the tables read} of the runs an earlier report finished."""
    report = json.loads(path.read_text())
    if report.get("kind") != KIND or report.get("schema") != SCHEMA:
        raise SystemExit(f"--reuse {path}: not a results.json of this study (schema {SCHEMA})")
    for setting in ("steps", "per_worker_batch", "global_batch"):
        if report[setting] != getattr(args, setting):
            raise SystemExit(
                f"--reuse {path}: its runs have {setting} {report[setting]}, this study "
                f"{getattr(args, setting)}"
            )
    runs: dict[str, dict] = {}
    for cell in report["cells"]:
        for method, entry in cell["methods"].items():
            for seed, loss in entry["by_seed"].items():
                name = run_name(cell["corpus"], cell["workers"], cell["batch_size"], method,
                                int(seed), args.steps)  # fmt: skip
                runs[name] = {"final_val_loss": loss, "bytes_per_worker": entry["bytes_per_worker"]}
    for row in report.get("options", []):
        batch = batch_of(args, row["workers"])
        for seed, loss in row["by_seed"].items():
            name = run_name(row["corpus"], row["workers"], batch, option_variant(row["option"]),
                            int(seed), args.steps)  # fmt: skip
            runs[name] = {"final_val_loss": loss, "comm_reduction_vs_ddp": row["traffic_vs_ddp"]}
    return runs


def cells(args: argparse.Namespace, results: dict[str, dict]) -> list[dict]:
    """One cell per corpus and M: each method's stats over the seeds that finished."""
    table = []
    for corpus in args.corpora:
        for workers in args.workers:
            batch = batch_of(args, workers)
            entry = {"corpus": corpus, "workers": workers, "batch_size": batch, "methods": {}}
            for method in args.methods:
                runs = finished_runs(args, results, corpus, workers, method)
                finished = {s: run["final_val_loss"] for s, run in runs.items()}
                entry["methods"][method] = {
                    "stats": stats(finished.values()),
                    "by_seed": finished,
                    "bytes_per_worker": next(
                        (run.get("bytes_per_worker") for run in runs.values()), None
                    ),
                }
            table.append(entry)
    return table


def option_cells(args: argparse.Namespace, results: dict[str, dict]) -> list[dict]:
    """One row per corpus, M and option that has a finished run, with the seeds it finished."""
    rows = []
    for corpus in args.corpora:
        for workers in args.workers:
            for label in args.options:
                method, changes = OPTIONS[label]
                runs = finished_runs(args, results, corpus, workers, option_variant(label))
                if not runs:
                    continue
                rows.append({
                    "corpus": corpus, "workers": workers, "method": method, "option": label,
                    "flags": flags(changes),
                    "by_seed": {s: run["final_val_loss"] for s, run in runs.items()},
                    "traffic_vs_ddp": runs[min(runs)].get("comm_reduction_vs_ddp"),
                })  # fmt: skip
    return rows


def over_seeds(cell: dict, method: str, seeds: list[int]) -> dict | None:
    """``method``'s stats in ``cell`` over ``seeds`` (None unless each of them finished)."""
    entry = cell["methods"].get(method, {"by_seed": {}})  # a method the study left out
    by_seed = {int(s): v for s, v in entry["by_seed"].items()}
    if any(s not in by_seed for s in seeds):
        return None
    return stats(by_seed[s] for s in seeds)


def paired(cell: dict, mine: str, theirs: str) -> tuple[dict | None, dict | None]:
    """The stats of two methods in ``cell`` over the seeds both finished: a gap between different
    seeds would mix the seeds' spread into it."""
    seeds = [
        {int(s) for s in cell["methods"].get(m, {"by_seed": {}})["by_seed"]} for m in (mine, theirs)
    ]
    common = sorted(seeds[0] & seeds[1])
    if not common:
        return None, None
    return over_seeds(cell, mine, common), over_seeds(cell, theirs, common)


def options_markdown(rows: list[dict], table: list[dict]) -> list[str]:
    """The options' table: each against its method's defaults and DDP, over the same seeds."""
    if not rows:
        return []
    lines = [
        "",
        "One setting changed from a method's defaults (the same runs otherwise); each compared "
        "with the method's defaults and DDP over the seeds it finished:",
        "",
        "| corpus | M | method | changed | seeds | final loss | vs its defaults | vs DDP "
        "| traffic vs DDP |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        where = (row["corpus"], row["workers"])
        cell = next(c for c in table if (c["corpus"], c["workers"]) == where)
        seeds = sorted(int(s) for s in row["by_seed"])
        mine, traffic = stats(row["by_seed"].values()), row["traffic_vs_ddp"]
        defaults, ddp = (over_seeds(cell, method, seeds) for method in (row["method"], "ddp"))
        lines.append(
            f"| {row['corpus']} | {row['workers']} | {LABELS[row['method']]} | `{row['flags']}` | "
            f"{', '.join(map(str, seeds))} | {pm(mine)} | {gap(mine, defaults)} | {gap(mine, ddp)} | "
            + (f"{traffic:.1f}x less |" if traffic else "— |")
        )
    return lines


def markdown(args: argparse.Namespace, table: list[dict], options: list[dict] = ()) -> str:
    batch_rule = (
        f"{args.per_worker_batch} sequences per worker"
        if args.per_worker_batch
        else f"a global batch of {args.global_batch} sequences ({args.global_batch} / M per worker)"
    )
    later = max(PLOTTED_OPTIONS)  # the default's options: its rounds, then what it adds
    rounds = OPTIONS[PLOTTED_OPTIONS[1]][1]
    step = {k: v for k, v in OPTIONS[PLOTTED_OPTIONS[later]][1].items() if k not in rounds}
    lines = [
        f"Micro model, K = 32, {args.steps} steps, {batch_rule}, every method at its defaults "
        f"(MT-DAO at K = 32 in float32, its default until 2026-12-07; today's default is the "
        f"option `{flags(rounds)}`, from {later} workers with `{flags(step)}`); "
        f"final validation loss, mean ± std over the seeds named; MT-DAO's gaps over the seeds "
        f"both methods finished; {SIGNIFICANCE_RULE}.",
        "",
        "| corpus | M | seeds | " + " | ".join(LABELS[m] for m in args.methods)
        + " | MT-DAO vs DDP | MT-DAO vs Local Adam |",
        "|---|---|---|" + "---|" * len(args.methods) + "---|---|",
    ]  # fmt: skip
    per_seed = []
    for cell in table:
        by = {m: cell["methods"][m]["stats"] for m in args.methods}
        seeds = sorted({s for m in args.methods for s in cell["methods"][m]["by_seed"]})
        if not seeds:
            continue
        lines.append(
            f"| {cell['corpus']} | {cell['workers']} | {', '.join(map(str, seeds))} | "
            + " | ".join(pm(by[m]) for m in args.methods)
            + f" | {gap(*paired(cell, 'mtdao', 'ddp'))} | "
            f"{gap(*paired(cell, 'mtdao', 'local-adam'))} |"
        )
        per_seed.append(
            f"- {cell['corpus']}, M = {cell['workers']}: "
            + "; ".join(
                f"{LABELS[m]} "
                + ", ".join(f"s{s} {v:.4f}" for s, v in cell["methods"][m]["by_seed"].items())
                for m in args.methods
                if cell["methods"][m]["by_seed"]
            )
        )
    return "\n".join(
        [*lines, *options_markdown(list(options), table), "", "Final validation loss of each seed:",
         "", *per_seed]
    )  # fmt: skip


def render(results: dict) -> str:
    """report.md from results.json alone."""
    settings = argparse.Namespace(
        **{k: results[k] for k in ("methods", "steps", "per_worker_batch", "global_batch")}
    )
    return (
        f"# MT-DAO's gap to DDP by number of workers\n\n    {results['command']}\n\n"
        f"![final loss vs workers](workers.png)\n\n"
        f"{markdown(settings, results['cells'], results.get('options', []))}\n"
    )


# MT-DAO's default at each M, drawn beside its K = 32 column: its rounds, and from 32 workers its
# step past the average (mtdao.methods.defaults.OUTER_LR_BY_WORKERS)
PLOTTED_OPTIONS = {1: "K4-int4-state-period32", 32: "K4-int4-state-period32-outer-lr1.5"}
PLOTTED_LABEL = "MT-DAO K = 4, int4 (its default)"


def default_option(workers: int) -> str:
    """The option that is MT-DAO's default with ``workers`` workers."""
    return [o for fewest, o in PLOTTED_OPTIONS.items() if workers >= fewest][-1]


def plotted(method: str) -> str:
    """A method's name in the plot: MT-DAO's line is K = 32 (PINNED), its option another."""
    return LABELS[method] + (" K = 32" if method in PINNED else "")


def plot(args: argparse.Namespace, table: list[dict], options: list[dict], path: Path) -> None:
    """Final loss against M per method (one panel per corpus), MT-DAO's gaps beside them; MT-DAO
    with its default option at each M dotted where it ran."""
    rows, size = len(args.corpora), (10, 3.6 * len(args.corpora))
    with saved_figure(path, rows, 2, figsize=size, squeeze=False, save_dpi=120) as (figure, axes):
        for row, corpus in enumerate(args.corpora):
            mine = [c for c in table if c["corpus"] == corpus]
            loss_axis, gap_axis = axes[row]
            for method in args.methods:
                points = [
                    (c["workers"], c["methods"][method]["stats"])
                    for c in mine
                    if c["methods"][method]["stats"]
                ]
                if not points:
                    continue
                xs = [m for m, _ in points]
                loss_axis.errorbar(
                    xs, [s["mean"] for _, s in points], yerr=[s["std"] for _, s in points],
                    marker="o", capsize=3, color=color(method), label=plotted(method),
                )  # fmt: skip
            for other, style in (("ddp", "-"), ("local-adam", "--")):
                points = [(c["workers"], *paired(c, "mtdao", other)) for c in mine]
                points = [(m, a, b) for m, a, b in points if a and b]
                if points:
                    gap_axis.plot(
                        [m for m, _, _ in points],
                        [100 * (a["mean"] - b["mean"]) / b["mean"] for _, a, b in points],
                        style, marker="o", color=color(other),
                        label=f"{plotted('mtdao')} − {LABELS[other]}",
                    )  # fmt: skip
            for axis in (loss_axis, gap_axis):
                axis.set_xscale("log", base=2)
                axis.set_xticks(args.workers, [str(m) for m in args.workers])
                axis.set_xlabel("workers M")
            option_points = []
            for option in options:
                if (option["corpus"], option["option"]) != (
                    corpus,
                    default_option(option["workers"]),
                ):
                    continue
                cell = next(c for c in mine if c["workers"] == option["workers"])
                seeds = sorted(int(s) for s in option["by_seed"])
                ddp = over_seeds(cell, "ddp", seeds)
                loss = stats(option["by_seed"].values())["mean"]
                option_points.append((option["workers"], loss, ddp["mean"] if ddp else None))
            if option_points:
                label = PLOTTED_LABEL
                loss_axis.plot(
                    [m for m, _, _ in option_points], [loss for _, loss, _ in option_points],
                    ":", marker="o", color=color("mtdao"), label=label,
                )  # fmt: skip
                gaps = [(m, 100 * (loss - d) / d) for m, loss, d in option_points if d]
                gap_axis.plot(
                    [m for m, _ in gaps], [g for _, g in gaps], ":", marker="o", color=color("ddp"),
                    label=f"{label} − DDP",
                )  # fmt: skip
            gap_axis.axhline(0, color="#888888", linewidth=0.8)
            loss_axis.set_ylabel("final validation loss")
            gap_axis.set_ylabel("relative gap (%)")
            loss_axis.set_title(f"{corpus}: final loss vs workers")
            gap_axis.set_title(f"{corpus}: MT-DAO's gap (below 0: better)")
            loss_axis.legend(fontsize=8)
            gap_axis.legend(fontsize=8)
        figure.tight_layout()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpora", nargs="+", default=["builtin", "vim"])
    parser.add_argument("--workers", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--options", nargs="+", default=[], choices=OPTIONS, metavar="OPTION",
                        help="also MT-DAO (DiLoCo) with one setting changed: "
                        + ", ".join(OPTIONS))  # fmt: skip
    parser.add_argument("--per-worker-batch", type=int, default=None)
    parser.add_argument(
        "--global-batch",
        type=int,
        help=f"sequences a step over all workers (default {GLOBAL_BATCH}; not with "
        "--per-worker-batch)",
    )
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("runs/workers"))
    parser.add_argument("--collect", action="store_true", help="report on finished runs only")
    parser.add_argument("--reuse", type=Path, metavar="REPORT.json", help="an earlier report's "
                        "results.json whose runs stand in for those --out lacks")  # fmt: skip
    parser.add_argument("--report", type=Path, help="also write report.md, results.json and "
                        "workers.png into this folder")  # fmt: skip
    args = parser.parse_args(argv)
    if args.global_batch is not None and args.per_worker_batch:
        parser.error("--global-batch and --per-worker-batch: give one")
    if args.global_batch is not None and args.global_batch < 1:
        parser.error(
            f"--global-batch must be a positive number of sequences, got {args.global_batch}"
        )
    args.global_batch = args.global_batch or GLOBAL_BATCH
    if "mtdao" not in args.methods:
        parser.error("--methods must include mtdao (the study compares it)")
    data, missing = corpus_paths(args.corpora, args.out / "corpora")
    if missing:
        parser.error("; ".join(f"corpus {name}: {why}" for name, why in missing.items()))
    reused = reused_runs(args, args.reuse) if args.reuse else {}  # refused before any training
    planned = planned_runs(args, data)
    # a run the earlier report holds is not trained again: --out's own copy, if any, still counts
    stand_ins = run_suite([r for r in planned if r[0] in reused], args.out, train=False)
    suite = run_suite([r for r in planned if r[0] not in reused], args.out, jobs=args.jobs,
                      threads=args.threads, train=not args.collect)  # fmt: skip
    results = {**reused, **stand_ins.results, **suite.results}
    table = cells(args, results)
    options = option_cells(args, results)
    text = markdown(args, table, options)
    print(text)
    if args.report:
        results = {"kind": KIND, "schema": SCHEMA, "command": "python " + " ".join(sys.argv),
                   "methods": args.methods, "steps": args.steps,
                   "per_worker_batch": args.per_worker_batch, "global_batch": args.global_batch,
                   "data": data, "cells": table, "options": options}  # fmt: skip
        write_report(args.report, results, render, to_text=lambda r: json.dumps(r, indent=1) + "\n")
        plot(args, table, options, args.report / "workers.png")
    return 1 if suite.failures else 0


if __name__ == "__main__":
    sys.exit(main())
