"""Step time and per-process memory of sharded workers: --shards 1 against --shards 2 (CPU).

Four launches of ``mtdao train`` on the same data and model, repeated ``--rounds`` times in
alternating order (the machine is shared and noisy; figures are medians):

    M1 S1   one worker, one process (the simulator with one worker)
    M1 S2   one worker sharded over 2 processes (torchrun, FSDP2)
    M2 S1   two workers, one process each (torchrun)
    M2 S2   two workers of 2 processes each (torchrun, 4 processes)
    M2 S1 options, M2 S2 options: the same with every round option of section 11 on
            (--sync-delay 2 --sync-fragments 2 --sync-dtype int8 --error-feedback)

Step time is ``train_time_s / steps`` from results.json (forward, backward, FSDP collectives,
averaging and the optimizer; no evaluation, no start-up); memory is ``memory_per_process``
(bytes of parameters and optimizer states that process 0 holds); bytes per worker and per process
are results.json's (what process 0 sent: its shards, encoded). Every launch's results.json is
kept under ``--out``.

    OMP_NUM_THREADS=1 python benchmarks/sharded_costs.py --steps 40 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

OPTIONS = ["--sync-delay", "2", "--sync-fragments", "2", "--sync-dtype", "int8", "--error-feedback"]
CASES = {
    "M1 S1": (1, 1, []),
    "M1 S2": (1, 2, []),
    "M2 S1": (2, 1, []),
    "M2 S2": (2, 2, []),
    "M2 S1 options": (2, 1, OPTIONS),
    "M2 S2 options": (2, 2, OPTIONS),
}


def launch(workers: int, shards: int, options: list[str], args, out: Path) -> dict:
    processes = workers * shards
    flags = ["--workers", str(workers), "--shards", str(shards), "--model", args.model]
    flags += ["--steps", str(args.steps), "--sync-period", "8", "--method", "mtdao"]
    flags += ["--eval-every", str(args.steps), "--eval-tokens", "4096", "--device", "cpu"]
    flags += ["--no-progress", "--out", str(out), *options]
    if args.data:
        flags += ["--data", args.data]
    if processes == 1:
        command = [sys.executable, "-m", "mtdao", "train", *flags]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc-per-node", str(processes), "-m", "mtdao", "train", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, env=env, check=True, capture_output=True, timeout=1800)
    return json.loads((out / "results.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--data", default=None, help="as mtdao train --data (default builtin)")
    parser.add_argument("--out", type=Path, default=Path("runs/sharded-costs"))
    args = parser.parse_args()
    step_s: dict[str, list[float]] = {case: [] for case in CASES}
    memory: dict[str, dict] = {}
    sent: dict[str, tuple] = {}
    for index in range(args.rounds):
        order = list(CASES.items())[:: 1 if index % 2 == 0 else -1]
        for case, (workers, shards, options) in order:
            out = args.out / f"round{index}-{case.replace(' ', '')}"
            results = launch(workers, shards, options, args, out)
            step_s[case].append(results["train_time_s"] / results["steps"])
            memory[case] = results["memory_per_process"]
            sent[case] = (results["bytes_per_worker"], results["bytes_per_process"])
            print(f"round {index} {case}: {step_s[case][-1] * 1e3:.1f} ms/step", flush=True)
    print(f"\n{args.model}, {args.steps} steps, {args.rounds} rounds (medians)")
    print(
        "| case | processes | ms per step | parameter bytes | optimizer state bytes "
        "| bytes per worker | bytes per process |"
    )
    print("|---|---|---|---|---|---|---|")
    for case, (workers, shards, _) in CASES.items():
        bytes_held, (per_worker, per_process) = memory[case], sent[case]
        print(
            f"| {case} | {workers * shards} | {statistics.median(step_s[case]) * 1e3:.1f} | "
            f"{bytes_held['parameter_bytes']:,} | {bytes_held['optimizer_state_bytes']:,} | "
            f"{per_worker:,} | {'-' if per_process is None else f'{per_process:,}'} |"
        )


if __name__ == "__main__":
    main()
