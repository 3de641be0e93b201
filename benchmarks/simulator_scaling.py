"""How the cost of simulating M workers grows with M (ideal: tokens/s per worker flat in M), what
the optimizer implementation and the number of workers per vmapped call change in it, and the
memory each simulated worker takes.

Runs the simulator's training step (vmapped forward/backward over stacked workers, one optimizer
step for all workers, averaging every K steps) for each M on the same model and per-worker batch,
once per optimizer path (``--paths``: foreach, fused, or auto = the default choice) and per
``--workers-per-call`` (how many workers one vmapped call runs; ``all``: every worker in one),
interleaving every setup over several rounds. Prints the median time per step; tokens/s relative
to the first M (same path and workers per call), with that ratio's spread over the rounds (each
round's pair); each path's time relative to the first path, and the same for the optimizer step
with its averaging (``sync.step()``); and the resident memory per worker: the peak resident set
of a fresh process running two steps of that setup, less the process's own before it builds the
workers, over M.

    python benchmarks/simulator_scaling.py --model micro --workers 1 4 16
    OMP_NUM_THREADS=1 python benchmarks/simulator_scaling.py --model micro \\
        --workers 1 16 64 128 256 --rounds 3 --steps 5
    OMP_NUM_THREADS=1 python benchmarks/simulator_scaling.py --model micro --workers 1 64 256 \\
        --workers-per-call all 16 --rounds 3 --steps 3
    OMP_NUM_THREADS=1 python benchmarks/simulator_scaling.py --model tiny --workers 4 16 \\
        --paths foreach fused --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

import mtdao
from mtdao.model import Llama, model_config
from mtdao.sync import LocalUpdateSync, SimulatedWorkers, stack_workers, unified
from mtdao.train.workers import language_model_loss

PATH_OPTIONS = {"auto": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def workers_per_call(text: str) -> int | None:
    """``all`` (one call for every worker) or a positive int."""
    if text == "all":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"workers per call must be 'all' or an int >= 1: {text!r}")
    return value


def call_label(per_call: int | None) -> str:
    return "all" if per_call is None else str(per_call)


def build(model_name: str, workers: int, seq_len: int, sync_period: int, path: str, per_call):
    torch.manual_seed(0)
    model = Llama(model_config(model_name, vocab_size=256, max_seq_len=seq_len))
    stacked = stack_workers(model, workers, workers_per_call=per_call)
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


def resident_bytes(field: str) -> int:
    """VmRSS (resident now) or VmHWM (its peak) of this process, from Linux's /proc."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # in kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure_memory(args) -> None:
    """In a fresh process: the peak resident bytes that building and training one setup add
    (after a one-worker step, which loads what any run loads: kernels, libraries)."""
    m, path, per_call = args.measure_memory
    time_steps(build(args.model, 1, args.seq_len, args.sync_period, path, None), 1, 8, 1)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak starts again from what is resident now
    before = resident_bytes("VmRSS")
    setup = build(
        args.model, int(m), args.seq_len, args.sync_period, path, workers_per_call(per_call)
    )
    time_steps(setup, args.batch_size, args.seq_len, 2)
    print(json.dumps({"added_bytes": resident_bytes("VmHWM") - before}))


def memory_per_worker(args, m: int, path: str, per_call: int | None) -> float:
    command = [
        sys.executable,
        __file__,
        "--model",
        args.model,
        "--batch-size",
        str(args.batch_size),
    ]
    command += ["--seq-len", str(args.seq_len), "--sync-period", str(args.sync_period)]
    command += ["--measure-memory", str(m), path, call_label(per_call)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["added_bytes"] / m


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="micro")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--paths", nargs="+", choices=sorted(PATH_OPTIONS), default=["auto"])
    parser.add_argument(
        "--workers-per-call",
        type=workers_per_call,
        nargs="+",
        default=[None],
        help="workers one vmapped call runs, each value a setup ('all', the default and the "
        "library's: every worker in one call)",
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--sync-period", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory per worker")
    parser.add_argument("--measure-memory", nargs=3, metavar=("M", "PATH", "PER_CALL"),
                        help=argparse.SUPPRESS)  # fmt: skip
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    if args.measure_memory:
        measure_memory(args)
        return

    keys = [
        (m, path, c) for m in args.workers for path in args.paths for c in args.workers_per_call
    ]
    setups = {
        key: build(args.model, key[0], args.seq_len, args.sync_period, key[1], key[2])
        for key in keys
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
    memory = {} if args.no_memory else {key: memory_per_worker(args, *key) for key in keys}

    print(
        f"model={args.model} batch/worker={args.batch_size} seq={args.seq_len} "
        f"threads={torch.get_num_threads()} (median of {args.rounds} rounds x {args.steps} steps; "
        "spread: the rounds' fastest and slowest)"
    )
    first_m, first_path = args.workers[0], args.paths[0]
    print(
        f"{'M':>4} {'path':>8} {'uses':>8} {'per call':>8} {'s/step':>9} {'tokens/s':>10} "
        f"{'vs M=' + str(first_m):>8} {'spread':>10} {'vs ' + first_path:>11} {'opt ms':>8} "
        f"{'vs ' + first_path:>11} {'MB/worker':>9} {'warm-up s':>10}"
    )
    rows = []
    for key in keys:
        m, path, per_call = key
        step_s = statistics.median(seconds[key])
        rate = m * args.batch_size * args.seq_len / step_s
        base_step_s = statistics.median(seconds[(first_m, path, per_call)])
        base_rate = first_m * args.batch_size * args.seq_len / base_step_s
        versus_first = step_s / statistics.median(seconds[(m, first_path, per_call)])
        optimizer_s = statistics.median(optimizer_seconds[key])
        optimizer_versus_first = optimizer_s / statistics.median(
            optimizer_seconds[(m, first_path, per_call)]
        )
        uses = chosen_path(setups[key][1])
        base_samples = seconds[(first_m, path, per_call)]  # the same rounds: paired ratios
        relative = [m * b / (first_m * s) for s, b in zip(seconds[key], base_samples)]
        rows.append(
            {
                "workers": m,
                "path": path,
                "uses": uses,
                "workers_per_call": per_call,
                "seconds_per_step": step_s,
                "tokens_per_s": rate,
                "relative_tokens_per_s": rate / base_rate,
                "relative_tokens_per_s_spread": [min(relative), max(relative)],
                "time_vs_first_path": versus_first,
                "optimizer_seconds_per_step": optimizer_s,
                "optimizer_time_vs_first_path": optimizer_versus_first,
                "resident_bytes_per_worker": memory.get(key),
                "samples": seconds[key],
                "warmup_seconds": first_steps[key],
            }
        )
        spread = f"{min(relative):.2f}-{max(relative):.2f}"
        megabytes = f"{memory[key] / 1e6:9.1f}" if key in memory else f"{'-':>9}"
        print(
            f"{m:>4} {path:>8} {uses:>8} {call_label(per_call):>8} {step_s:>9.4f} {rate:>10.0f} "
            f"{rate / base_rate:>8.2f} {spread:>10} {versus_first:>10.3f}x "
            f"{1e3 * optimizer_s:>8.1f} {optimizer_versus_first:>10.3f}x {megabytes} "
            f"{first_steps[key]:>10.2f}"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    main()
