"""``mtdao train`` run after run in the processes of one torchrun job (tests/test_train_torchrun.py;
not collected by pytest): ``torchrun ... torchrun_train_runs.py FLAGS_JSON...``, each argument a
JSON list of ``mtdao train`` flags. A process's start costs more than a short run's steps.

The process group the first run sets up serves those that follow: set up again on torchrun's
store, whose keys still hold the first group's addresses, a group may connect to a closed one.
Each process ends as ``mtdao`` ends one under torchrun (``end_worker_process``)."""

from __future__ import annotations

import json
import sys
from unittest import mock

from mtdao.cli import main
from mtdao.train import distributed


def run_all(runs: list[list[str]]) -> int:
    with mock.patch.object(distributed, "leave_process_group"):
        for flags in runs:
            if code := main(["train", *flags]):
                return code
    distributed.leave_process_group()
    return 0


if __name__ == "__main__":
    distributed.end_worker_process(run_all([json.loads(flags) for flags in sys.argv[1:]]))
