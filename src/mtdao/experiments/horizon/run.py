"""Collects the horizon and variants study's runs into a report (results.json, report.md, plots).

The study is a set of ``mtdao train`` runs, one directory each under RUNS, named
``<block>_<label>_<steps>_lr<LR>_s<seed>`` and holding the runner's ``queue.json`` (experiment id,
LR, seed, the exact command) next to the run's ``results.json``. The plan (a Python file defining
EXPERIMENTS: id, flags, steps, seeds, and COMMON, the flags every run shares) says which runs
exist or are still to come. This command reads both, keeps what a report needs (seed-0 LR sweeps,
final losses of every seed at the best LR, mean evaluation curves, worker alignment), and renders
the report with :mod:`.report` (numbers: :mod:`.summary`, figures: :mod:`.plots`):

    python -m mtdao.experiments.horizon.run --runs STUDY/runs --plan STUDY/plan.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from mtdao.experiments.horizon.plots import plot_horizon, plot_screen, plot_traffic
from mtdao.experiments.horizon.report import render_horizon_report
from mtdao.experiments.horizon.summary import KIND, SCHEMA, nan_free

# Kept out of the shown flags: what differs per run of one experiment.
PER_RUN_FLAGS = {"--lr", "--seed", "--out", "--eval-every", "--steps", "--checkpoint-every"}
PROTOCOL = [
    "micro model (d64 L2 H2, byte vocabulary), 4 simulated workers x 16 sequences x 64 tokens, "
    "K = 32 unless stated, WSD schedule (warmup 5%, decay over the last 20% to 0.1 x peak), "
    "built-in data (the Python standard library's sources), 32,768 held-out tokens per "
    "evaluation, 25 evaluations per run, one thread per run",
    "LR: seed 0 sweeps a factor-2 grid (Adam 2e-3 .. 1.6e-2, ADOPT 1e-3 .. 8e-3), extended by "
    "factor 2 while the best is an edge (a diverged run counts as worse than any), then the two "
    "sqrt(2) midpoints around the best; the other seeds run at the best LR. 10k steps, the "
    "variants, the other sync periods and batch x4 start from a reference's optimum (the same "
    "method at 3k, MT-DAO default or paper, the method at batch 16) and its sqrt(2) neighbours, "
    "extended by sqrt(2) while an edge wins. The LR is chosen on seed 0, so seed 0 is slightly "
    "optimistic at its LR for every method alike",
    "variants, K = 512 and batch x4 are screened on seed 0 first; seeds 1 and 2 follow for a "
    "configuration that beats MT-DAO default of its setting beyond the seed spread",
    "seeds 0 1 2 at 1k and 3k steps, 0 1 at 10k; a difference counts only if it exceeds the sum of "
    "the two sample standard deviations",
    "second corpus for the final check, never tuned on: the vim documentation "
    "(/usr/share/vim/vim90/doc)",
    "no re-tuning either (each at its WSD 3k optimum): the cosine-schedule check (p7, the "
    "schedule `mtdao train` used by default until 2026-12-04) and the 10k runs of the warm-up variants "
    "(beta-wu, both-wu)",
]


def shown_flags(args: list[str]) -> list[str]:
    """The training flags of a run without its per-run values (LR, seed, output)."""
    flags, skip = [], False
    for arg in args[3:]:  # after "-m mtdao train"
        if skip:
            skip = False
        elif arg in PER_RUN_FLAGS:
            skip = True
        else:
            flags.append(arg)
    return flags


def read_runs(runs: Path) -> dict[str, list[dict]]:
    """Finished runs by experiment id: LR, seed, final loss (None: diverged), curve, alignment."""
    by_experiment: dict[str, list[dict]] = {}
    for meta_path in sorted(runs.glob("*/queue.json")):
        meta = json.loads(meta_path.read_text())
        results_path, failed = (
            meta_path.with_name("results.json"),
            meta_path.with_name("failed.json"),
        )
        if results_path.exists():
            results = json.loads(results_path.read_text())
            loss = nan_free(results["final_val_loss"])
            curve = [(e["step"], e["val_loss"]) for e in results["evals"]]
            cosines = [statistics.fmean(a["cosine"]) for a in results.get("alignment") or []]
            reduction = results.get("comm_reduction_vs_ddp")
        elif failed.exists() and json.loads(failed.read_text()).get("kind") == "diverged":
            loss, curve, cosines, reduction = None, [], [], None
        else:
            continue
        run = dict(lr=meta["lr"], seed=meta["seed"], loss=loss, curve=curve, cosines=cosines)
        run["reduction"] = reduction  # traffic: DDP's bytes per worker / the run's
        run["flags"] = shown_flags(meta["args"])
        by_experiment.setdefault(meta["experiment"], []).append(run)
    return by_experiment


def summarize(planned: dict, runs: list[dict], common: list[str]) -> dict:
    seed0 = sorted((r for r in runs if r["seed"] == 0), key=lambda r: r["lr"])
    sweep = [{"lr": r["lr"], "loss": r["loss"]} for r in seed0]
    experiment = {
        "id": planned["id"],
        "steps": planned["steps"],
        "flags": planned["flags"],
        "planned_seeds": planned["seeds"],
        "sweep": sweep,
    }
    if planned.get("lr_from"):  # runs at another experiment's best LR, by design not re-tuned
        experiment["lr_from"] = planned["lr_from"]
    finite = [p for p in sweep if p["loss"] is not None]
    if not finite:
        return experiment
    best = min(finite, key=lambda p: p["loss"])
    lrs = [p["lr"] for p in sweep]
    worse = {p["lr"] for p in sweep if p["loss"] is None or p["loss"] > best["loss"]}
    experiment["best_lr"] = best["lr"]
    experiment["bracketed"] = any(lr < best["lr"] and lr in worse for lr in lrs) and any(
        lr > best["lr"] and lr in worse for lr in lrs
    )
    neighbours = {best["lr"] / math.sqrt(2), best["lr"] * math.sqrt(2)}
    experiment["refined"] = all(
        any(math.isclose(lr, n, rel_tol=1e-3) for lr in lrs) for n in neighbours
    )
    at_best = sorted((r for r in runs if r["lr"] == best["lr"]), key=lambda r: r["seed"])
    at_best = [r for r in at_best if r["seed"] in planned["seeds"] and r["loss"] is not None]
    experiment["seeds"] = [r["seed"] for r in at_best]
    experiment["values"] = [r["loss"] for r in at_best]
    steps = sorted(set.intersection(*(set(s for s, _ in r["curve"]) for r in at_best)))
    experiment["curve"] = [
        [s, statistics.fmean(dict(r["curve"])[s] for r in at_best)] for s in steps
    ]
    cosines = [statistics.fmean(r["cosines"]) for r in at_best if r["cosines"]]
    experiment["cosine"] = statistics.fmean(cosines) if cosines else None
    reductions = [r["reduction"] for r in at_best if r.get("reduction")]
    experiment["reduction"] = reductions[0] if reductions else None
    return experiment


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, required=True, help="the study's run directories")
    parser.add_argument("--plan", type=Path, required=True, help="the study's plan file")
    parser.add_argument("--running", nargs="*", default=[], help="names of runs still running")
    parser.add_argument("--out", type=Path, default=Path("reports/horizon"))
    args = parser.parse_args(argv)
    namespace: dict = {}
    exec(compile(args.plan.read_text(), str(args.plan), "exec"), namespace)
    by_experiment = read_runs(args.runs)
    summary = {
        "kind": KIND,
        "schema": SCHEMA,
        "collected": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "finished_runs": sum(len(r) for r in by_experiment.values()),
        "running": sorted(args.running),
        "common_flags": namespace["COMMON"],
        "protocol": PROTOCOL,
        "experiments": [
            summarize(e, by_experiment.get(e["id"], []), namespace["COMMON"])
            for e in sorted(namespace["EXPERIMENTS"], key=_plan_order)
        ],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.out / "report.md").write_text(render_horizon_report(summary))
    plot_horizon(summary, args.out / "horizon.png")
    plot_screen(summary, args.out / "screen.png")
    plot_traffic(summary, args.out / "traffic.png")
    print(f"report: {args.out / 'report.md'}")
    return 0


def _plan_order(experiment: dict) -> tuple:
    block, label, steps = experiment["id"].split("/")
    return block, int(steps), label


if __name__ == "__main__":
    sys.exit(main())
