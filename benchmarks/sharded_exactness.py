"""How far apart sharded, unsharded and simulated workers end: the runs of
tests/test_sharded_sync.py (a small Llama, 2 workers, 6 steps, K = 2, clipping at 0.05 active),
measured instead of asserted.

For each method: the largest absolute difference, over both workers, of every parameter, every
optimizer state and every per-worker loss, between 2 workers x 2 FSDP2 shards (4 gloo processes)
and the simulated run, and between 2 unsharded processes and the simulated run; and the traffic:
bytes per worker (identical in all three) and bytes per process.

    OMP_NUM_THREADS=1 python benchmarks/sharded_exactness.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_sharded_sync as runs  # noqa: E402


def largest_differences(real: dict, simulated: dict, worker: int) -> tuple[float, float, float]:
    params = states = 0.0
    for name, param in real["params"].items():
        params = max(params, (param - simulated["params"][name][worker]).abs().max().item())
        for key, value in real["states"][name].items():
            expected = simulated["states"][name][key]
            expected = expected if key == "step" else expected[worker]
            states = max(states, (value.double() - expected.double()).abs().max().item())
    losses = (real["losses"].double() - simulated["losses"].double()).abs().max().item()
    return params, states, losses


def main() -> None:
    torch.set_num_threads(1)
    processes = runs.run_processes(Path(tempfile.mkdtemp(prefix="sharded-exactness-")))
    simulated = runs.run_simulated()
    print("| method | vs simulated | parameters | optimizer states | losses | bytes per worker "
          "| bytes per process |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for method in runs.METHODS:
        for label, key, ranks in (
            ("2 x 2 shards", method, range(runs.WORKERS * runs.SHARDS)),
            ("2 unsharded", f"{method} unsharded", range(runs.WORKERS)),
        ):
            shards = runs.SHARDS if label.endswith("shards") else 1
            worst = [0.0, 0.0, 0.0]
            for rank in ranks:
                found = largest_differences(processes[rank][key], simulated[method], rank // shards)
                worst = [max(a, b) for a, b in zip(worst, found)]
            traffic = processes[0][key]["traffic"]["bytes"]
            same = traffic == simulated[method]["traffic"]["bytes"]
            per_process = round(traffic * processes[0][key]["share"])
            print(
                f"| {method} | {label} | {worst[0]:.1e} | {worst[1]:.1e} | {worst[2]:.1e} | "
                f"{traffic:,}{'' if same else ' (DIFFERS)'} | {per_process:,} |"
            )


if __name__ == "__main__":
    main()
