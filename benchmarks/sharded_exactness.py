"""How far apart sharded, unsharded and simulated workers end: the runs of
tests/test_sharded_sync.py (a small Llama, 2 workers, 6 steps, K = 2, clipping at 0.05 active),
measured instead of asserted.

For each method: the largest absolute difference, over both workers, of every parameter, every
optimizer state and every per-worker loss, between 2 workers x 2 FSDP2 shards (4 gloo processes)
and the simulated run, and between 2 unsharded processes and the simulated run; and the traffic:
bytes per worker (identical in all three) and bytes per process.

Then MT-DAO (K = 3) with each round option and all of them together, sharded against the
simulated run with the same options; for the quantized runs also the relative distance (over all
parameters) of the sharded and the simulated run from each other and from the float32 run with
the same other options.

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
            per_process = processes[0][key]["traffic"]["process_bytes"] or traffic
            print(
                f"| {method} | {label} | {worst[0]:.1e} | {worst[1]:.1e} | {worst[2]:.1e} | "
                f"{traffic:,}{'' if same else ' (DIFFERS)'} | {per_process:,} |"
            )
    options_table(processes, simulated)


def options_table(processes: list[dict], simulated: dict) -> None:
    print("\n| options | parameters | optimizer states | losses | bytes per worker (simulated) "
          "| bytes per process | sharded vs simulated | simulated vs float32 "
          "| sharded vs float32 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name in runs.OPTIONS:
        worst = [0.0, 0.0, 0.0]
        distances = [0.0, 0.0, 0.0]
        for rank, results in enumerate(processes):
            worker = rank // runs.SHARDS
            found = largest_differences(results[name], simulated[name], worker)
            worst = [max(a, b) for a, b in zip(worst, found)]
            if name in runs.FLOAT32_OF:
                float32 = simulated[f"{name} float32"]["params"]
                quantized = {n: p[worker] for n, p in simulated[name]["params"].items()}
                params = results[name]["params"]
                found = (
                    runs.relative_distance(params, simulated[name]["params"], worker),
                    runs.relative_distance(quantized, float32, worker),
                    runs.relative_distance(params, float32, worker),
                )
                distances = [max(a, b) for a, b in zip(distances, found)]
        traffic = processes[0][name]["traffic"]
        columns = (
            " | ".join(f"{d:.1e}" for d in distances) if name in runs.FLOAT32_OF else "- | - | -"
        )
        print(
            f"| {name} | {worst[0]:.1e} | {worst[1]:.1e} | {worst[2]:.1e} | "
            f"{traffic['bytes']:,} ({simulated[name]['traffic']['bytes']:,}) | "
            f"{traffic['process_bytes']:,} | {columns} |"
        )


if __name__ == "__main__":
    main()
