"""The defaults card (``mtdao compare --preset defaults-card``): every method at its own defaults,
across run lengths, sync periods and corpora.

A user runs ``mtdao train --method M`` on their data for as many steps as they can afford; the
card asks whether MT-DAO's default holds there. Each run differs from ``mtdao train``'s defaults
only in ``--method``, ``--steps``, ``--sync-period``, ``--data``, ``--seed`` and the model size
(micro, so that the grid fits a CPU): no learning rate is tuned per cell. Beside the baselines it
runs MT-DAO's earlier defaults and a candidate for the next one, so that a change of default is
judged on the same runs.

Corpora: the built-in one (the Python standard library's sources, where the defaults were tuned)
and two natural-language corpora never tuned on, when the machine has them: the vim
documentation and the GNU info manuals (made into text files by :mod:`mtdao.experiments.common.corpora`). A cell whose
corpus is missing is reported as such. DDP does not depend on the sync period: one DDP run per
corpus, length and seed serves both periods.

Running is here; the grid is :mod:`.grid`, the numbers are computed in :mod:`.summary`, the
report and plot drawn in :mod:`.report`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mtdao.experiments.common.corpora import corpus_paths
from mtdao.experiments.common.results import read_results, write_report
from mtdao.experiments.common.suite import run_suite
from mtdao.experiments.defaults_card.grid import FULL, QUICK, card_runs
from mtdao.experiments.defaults_card.report import plot_card, render
from mtdao.experiments.defaults_card.summary import KIND, SCHEMA, reuse_card, summarize_card
from mtdao.train.config import resolve


def run_defaults_card(args: argparse.Namespace) -> int:
    """``mtdao compare --preset defaults-card [--quick]``: train the card's runs, then report."""
    grid = QUICK if args.quick else FULL
    out = Path(args.out)
    data, missing = corpus_paths(grid.corpora, out / "corpora")
    for corpus, reason in missing.items():
        print(f"defaults card: corpus {corpus} left out: {reason}")
    runs = card_runs(grid, data, args.data_split)
    resolved = [resolve(config) for _, config in runs]  # bad settings fail before training
    evaluations = sum(config.total_steps() // config.job.eval_every for config in resolved)
    print(
        f"defaults card{' (quick)' if args.quick else ''}: {len(runs)} runs "
        f"({len(grid.cells())} cells x {len(grid.entries)} entries x {len(grid.seeds)} seeds, "
        f"DDP once per corpus, length and seed), {evaluations} evaluations, in {out}"
    )
    suite = run_suite(runs, out, jobs=args.jobs, threads=args.threads, train=not args.collect)
    summary = summarize_card(grid, data, missing, suite.results, suite.failures, args.data_split)
    if args.reuse:
        earlier = read_results(Path(args.reuse) / "results.json", KIND, SCHEMA)
        summary = reuse_card(summary, earlier, grid, data, suite, args.data_split, args.reuse)
    report = write_report(out, summary, render)
    plot_card(summary, out / "card.png")
    print(f"report: {report}  results: {out / 'results.json'}")
    return 1 if suite.failures else 0
