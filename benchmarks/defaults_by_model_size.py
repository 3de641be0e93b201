"""Does MT-DAO's gap to DDP grow or shrink with the model? The defaults card's K = 32 cell, at
other model sizes.

    OMP_NUM_THREADS=1 python benchmarks/defaults_by_model_size.py --models micro tiny \
        --steps 3000 --seeds 0 1 2 --jobs 2 --threads 1 --out runs/model-size

Every run is ``mtdao train --method M --model SIZE --steps N --sync-period K --seed S`` and
nothing else (each method at its own defaults, learning rate included, on the built-in corpus),
as the defaults card runs it (``mtdao compare --preset defaults-card``). Finished runs are kept
in ``--out`` and not trained again. Prints, per model, each method's final validation loss (mean
± std over seeds) and MT-DAO's relative gap to DDP and to Local Adam with the card's
significance rule; ``--report`` also writes that table as markdown.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mtdao.experiments.common.formatting import LABELS, SIGNIFICANCE_RULE, gap, pm, stats
from mtdao.experiments.common.suite import run_suite
from mtdao.model.presets import MODEL_PRESETS
from mtdao.train.config import TrainConfig

METHODS = ("ddp", "local-adam", "mtdao")


def run_name(model: str, steps: int, sync_period: int, method: str, seed: int) -> str:
    return f"{model}-builtin-{steps}-K{sync_period}-{method}-s{seed}"


def planned_runs(args: argparse.Namespace) -> list[tuple[str, TrainConfig]]:
    """Seed by seed, so that an interrupted study has every model at its first seeds."""
    runs = []
    for seed in args.seeds:
        for model in args.models:
            for method in METHODS:
                config = TrainConfig.of(method=method, model=model, steps=args.steps,
                                     sync_period=args.sync_period, seed=seed, progress=False)  # fmt: skip
                runs.append((run_name(model, args.steps, args.sync_period, method, seed), config))
    return runs


def table(args: argparse.Namespace, results: dict[str, dict]) -> str:
    lines = [
        f"K = {args.sync_period}, {args.steps} steps, built-in corpus, every method at its "
        f"defaults; {SIGNIFICANCE_RULE}.",
        "",
        "| model | parameters | seeds | DDP | Local Adam | MT-DAO | MT-DAO vs DDP | "
        "MT-DAO vs Local Adam |",
        "|---|---|---|---|---|---|---|---|",
    ]
    per_seed: list[str] = []
    for model in args.models:
        by_method = {}
        for method in METHODS:
            names = [run_name(model, args.steps, args.sync_period, method, s) for s in args.seeds]
            by_method[method] = stats(
                results[n].get("final_val_loss") for n in names if n in results
            )
        if any(by_method[m] is None for m in METHODS):
            lines.append(f"| {model} | | | (not every method finished a seed) | | | | |")
            continue
        cells = [pm(by_method[m]) for m in METHODS]
        parameters = next(
            results[n]["parameters"] for n in results if n.startswith(f"{model}-")
            and "parameters" in results[n]
        )  # fmt: skip
        seeds = min(by_method[m]["n"] for m in METHODS)
        lines.append(
            f"| {model} | {parameters:,} | {seeds} | " + " | ".join(cells) + " | "
            f"{gap(by_method['mtdao'], by_method['ddp'])} | "
            f"{gap(by_method['mtdao'], by_method['local-adam'])} |"
        )
        per_seed.append(f"- {model}: " + "; ".join(
            f"{LABELS[m]} " + ", ".join(f"{v:.4f}" for v in by_method[m]["values"]) for m in METHODS
        ))  # fmt: skip
    return "\n".join(
        [*lines, "", "Final validation loss of each seed, in seed order:", "", *per_seed]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["micro", "tiny"], choices=MODEL_PRESETS)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--sync-period", type=int, default=32)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("runs/model-size"))
    parser.add_argument("--collect", action="store_true", help="report on finished runs only")
    parser.add_argument("--report", type=Path, help="also write the table here (markdown)")
    args = parser.parse_args(argv)
    suite = run_suite(planned_runs(args), args.out, jobs=args.jobs, threads=args.threads,
                      train=not args.collect)  # fmt: skip
    text = table(args, suite.results)
    print(text)
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(f"# MT-DAO's gap to DDP by model size\n\n    python {' '.join(sys.argv)}\n\n"
                               f"{text}\n")  # fmt: skip
    return 1 if suite.failures else 0


if __name__ == "__main__":
    sys.exit(main())
