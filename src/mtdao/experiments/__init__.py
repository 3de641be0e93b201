"""The lab beside the library: one folder per study, each a client of the library's API.

A study's folder holds its command (``run.py``: flags, grid, runs), the numbers (``summary.py``,
pure functions of the runs' results), its report (``report.py``) and, where it draws, its
figures (``plots.py``). What more than one study uses (running a suite of configs, stating
figures, drawing, held-out corpora, writing results.json and the report rendered from it) is in
:mod:`mtdao.experiments.common`. The networks and drills they run on are test infrastructure:
:mod:`mtdao.testing`.
"""
