"""How the cost of simulating M workers grows with M (ideal: tokens/s flat in M).

Runs the simulator's training step (vmapped forward/backward over stacked workers, one optimizer
step for all workers, averaging every K steps) for M = 1, 4, 16 on the same model and per-worker
batch, interleaving the M values over several rounds, and prints tokens/s relative to M = 1.

    python benchmarks/simulator_scaling.py --model micro --workers 1 4 16
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


def build(model_name: str, workers: int, seq_len: int, sync_period: int):
    torch.manual_seed(0)
    model = Llama(model_config(model_name, vocab_size=256, max_seq_len=seq_len))
    stacked = stack_workers(model, workers)
    optimizer = mtdao.MTAdam(stacked.parameters(), lr=1e-3)
    sync = LocalUpdateSync(optimizer, unified(sync_period), SimulatedWorkers(workers))
    return stacked, optimizer, sync


def time_steps(setup, batch_size: int, seq_len: int, steps: int) -> float:
    stacked, optimizer, sync = setup
    m = stacked.num_workers
    inputs = torch.randint(0, 256, (m, batch_size, seq_len))
    targets = torch.randint(0, 256, (m, batch_size, seq_len))
    started = time.perf_counter()
    for _ in range(steps):
        stacked.losses(language_model_loss, inputs, targets).sum().backward()
        sync.step()
        optimizer.zero_grad(set_to_none=True)
    return (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="micro")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--sync-period", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    setups = {m: build(args.model, m, args.seq_len, args.sync_period) for m in args.workers}
    for setup in setups.values():  # warm-up (allocations, vmap tracing)
        time_steps(setup, args.batch_size, args.seq_len, 2)
    seconds: dict[int, list[float]] = {m: [] for m in args.workers}
    for _ in range(args.rounds):  # interleaved, so machine noise hits every M alike
        for m, setup in setups.items():
            seconds[m].append(time_steps(setup, args.batch_size, args.seq_len, args.steps))

    base = args.workers[0]
    rows = []
    print(
        f"model={args.model} batch/worker={args.batch_size} seq={args.seq_len} "
        f"threads={torch.get_num_threads()} (median of {args.rounds} rounds)"
    )
    print(f"{'M':>4} {'s/step':>9} {'tokens/s':>10} {'tokens/s vs M=' + str(base):>16}")
    base_rate = None
    for m in args.workers:
        step_s = statistics.median(seconds[m])
        rate = m * args.batch_size * args.seq_len / step_s
        base_rate = base_rate or rate
        rows.append(
            {
                "workers": m,
                "seconds_per_step": step_s,
                "tokens_per_s": rate,
                "relative_tokens_per_s": rate / base_rate,
            }
        )
        print(f"{m:>4} {step_s:>9.4f} {rate:>10.0f} {rate / base_rate:>16.2f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    main()
