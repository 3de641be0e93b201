"""How the cost of simulating M workers grows with M (ideal: tokens/s flat in M), and what the
optimizer implementation changes in it.

Runs the simulator's training step (vmapped forward/backward over stacked workers, one optimizer
step for all workers, averaging every K steps) for each M on the same model and per-worker batch,
once per optimizer path (``--paths``: foreach, fused, or auto = the default choice), interleaving
every (M, path) setup over several rounds, and prints the median time per step, tokens/s relative
to the first M, each path's time relative to the first path, and the same for the part of the step
spent in the optimizer step with its averaging (``sync.step()``).

    python benchmarks/simulator_scaling.py --model micro --workers 1 4 16
    OMP_NUM_THREADS=1 python benchmarks/simulator_scaling.py --model tiny --workers 4 16 \\
        --paths foreach fused --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import mtdao
from mtdao.model import Llama, model_config
from mtdao.sync import LocalUpdateSync, SimulatedWorkers, stack_workers, unified
from mtdao.train.workers import language_model_loss

PATH_OPTIONS = {"auto": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def build(model_name: str, workers: int, seq_len: int, sync_period: int, path: str):
    torch.manual_seed(0)
    model = Llama(model_config(model_name, vocab_size=256, max_seq_len=seq_len))
    stacked = stack_workers(model, workers)
    optimizer = mtdao.MTAdam(stacked.parameters(), lr=1e-3, **PATH_OPTIONS[path])
    sync = LocalUpdateSync(optimizer, unified(sync_period), SimulatedWorkers(workers))
    return stacked, optimizer, sync


def chosen_path(optimizer) -> str:
    """The implementation the optimizer uses for its (single) bucket of parameters."""
    group = optimizer.param_groups[0]
    params = group["params"]
    return optimizer._path(group, params, optimizer.state[params[0]]["exp_avg_0"])


def time_steps(setup, batch_size: int, seq_len: int, steps: int) -> tuple[float, float]:
    """Seconds per training step, and of that the optimizer step with its averaging."""
    stacked, optimizer, sync = setup
    m = stacked.num_workers
    inputs = torch.randint(0, 256, (m, batch_size, seq_len))
    targets = torch.randint(0, 256, (m, batch_size, seq_len))
    in_step = 0.0
    started = time.perf_counter()
    for _ in range(steps):
        stacked.losses(language_model_loss, inputs, targets).sum().backward()
        step_started = time.perf_counter()
        sync.step()
        in_step += time.perf_counter() - step_started
        optimizer.zero_grad(set_to_none=True)
    return (time.perf_counter() - started) / steps, in_step / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="micro")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--paths", nargs="+", choices=sorted(PATH_OPTIONS), default=["auto"])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--sync-period", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    keys = [(m, path) for m in args.workers for path in args.paths]
    setups = {
        key: build(args.model, key[0], args.seq_len, args.sync_period, key[1]) for key in keys
    }
    first_steps = {}
    for key, setup in setups.items():  # warm-up: allocations, vmap tracing, kernel compilation
        started = time.perf_counter()
        time_steps(setup, args.batch_size, args.seq_len, 2)
        first_steps[key] = time.perf_counter() - started
    seconds: dict[tuple, list[float]] = {key: [] for key in keys}
    optimizer_seconds: dict[tuple, list[float]] = {key: [] for key in keys}
    for _ in range(args.rounds):  # interleaved, so machine noise hits every setup alike
        for key, setup in setups.items():
            total, in_step = time_steps(setup, args.batch_size, args.seq_len, args.steps)
            seconds[key].append(total)
            optimizer_seconds[key].append(in_step)

    print(
        f"model={args.model} batch/worker={args.batch_size} seq={args.seq_len} "
        f"threads={torch.get_num_threads()} (median of {args.rounds} rounds x {args.steps} steps)"
    )
    header = f"{'M':>4} {'path':>8} {'uses':>8} {'s/step':>9} {'tokens/s':>10}"
    print(
        f"{header} {'vs M=' + str(args.workers[0]):>8} {'vs ' + args.paths[0]:>11} "
        f"{'opt ms':>8} {'vs ' + args.paths[0]:>11} {'warm-up s':>10}"
    )
    rows = []
    for m, path in keys:
        step_s = statistics.median(seconds[(m, path)])
        rate = m * args.batch_size * args.seq_len / step_s
        base_step_s = statistics.median(seconds[(args.workers[0], path)])
        base_rate = args.workers[0] * args.batch_size * args.seq_len / base_step_s
        versus_first = step_s / statistics.median(seconds[(m, args.paths[0])])
        optimizer_s = statistics.median(optimizer_seconds[(m, path)])
        optimizer_versus_first = optimizer_s / statistics.median(
            optimizer_seconds[(m, args.paths[0])]
        )
        uses = chosen_path(setups[(m, path)][1])
        rows.append(
            {
                "workers": m,
                "path": path,
                "uses": uses,
                "seconds_per_step": step_s,
                "tokens_per_s": rate,
                "relative_tokens_per_s": rate / base_rate,
                "time_vs_first_path": versus_first,
                "optimizer_seconds_per_step": optimizer_s,
                "optimizer_time_vs_first_path": optimizer_versus_first,
                "samples": seconds[(m, path)],
                "warmup_seconds": first_steps[(m, path)],
            }
        )
        print(
            f"{m:>4} {path:>8} {uses:>8} {step_s:>9.4f} {rate:>10.0f} {rate / base_rate:>8.2f} "
            f"{versus_first:>10.3f}x {1e3 * optimizer_s:>8.1f} {optimizer_versus_first:>10.3f}x "
            f"{first_steps[(m, path)]:>10.2f}"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    main()
