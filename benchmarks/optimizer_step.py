"""Time one optimizer step of the MT-DAO optimizers against torch.optim.AdamW(foreach=True).

All optimizers step the same parameters with the same fixed gradients and are measured side by side
in one process: after a warm-up, each round times every optimizer once (``--repeats`` steps each,
in an order that rotates between rounds). Each optimizer is reported as a ratio to AdamW, from
the median over rounds and from the fastest round; on a shared machine, where other work slows
some rounds down, the fastest round is the steadier figure.

    python benchmarks/optimizer_step.py                      # ~25M params in 100 tensors, CPU
    python benchmarks/optimizer_step.py --device cuda --json runs/optimizer_step.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch

from mtdao import MTSGD, MTAdam, MTAdopt

WEIGHT_DECAY = 0.1  # the same for all, so that all pay for the decay pass
CANDIDATES: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "AdamW(foreach=True)": lambda ps: torch.optim.AdamW(
        ps, lr=1e-3, weight_decay=WEIGHT_DECAY, foreach=True
    ),
    "MTAdam N=1 omegas=(1,)": lambda ps: MTAdam(
        ps, lr=1e-3, betas=(0.9,), omegas=(1.0,), weight_decay=WEIGHT_DECAY
    ),
    "MTAdam N=1 omegas=(0.9,)": lambda ps: MTAdam(ps, lr=1e-3, weight_decay=WEIGHT_DECAY),
    "MTAdam N=2 omegas=(.45,.45)": lambda ps: MTAdam(
        ps, lr=1e-3, betas=(0.9, 0.999), omegas=(0.45, 0.45), weight_decay=WEIGHT_DECAY
    ),
    "MTAdopt N=1 omegas=(0.9,)": lambda ps: MTAdopt(ps, lr=1e-3, weight_decay=WEIGHT_DECAY),
    "MTSGD N=1": lambda ps: MTSGD(ps, lr=1e-3, weight_decay=WEIGHT_DECAY),
}
BASELINE = "AdamW(foreach=True)"


def make_parameters(total: int, count: int, device: torch.device) -> list[torch.Tensor]:
    size = total // count
    generator = torch.Generator().manual_seed(0)
    params = []
    for _ in range(count):
        p = torch.randn(size, generator=generator).mul_(0.02).to(device).requires_grad_(True)
        p.grad = torch.randn(size, generator=generator).to(device)
        params.append(p)
    return params


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(optimizer: torch.optim.Optimizer, steps: int, device: torch.device) -> float:
    """Seconds per step, averaged over ``steps`` back-to-back steps."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    synchronize(device)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-millions", type=float, default=25.0)
    parser.add_argument("--tensors", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median over)")
    parser.add_argument("--repeats", type=int, default=3, help="steps per optimizer per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per optimizer")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, help="CPU intra-op threads (default: torch's)")
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda requested but CUDA is not available")
    total = int(args.params_millions * 1e6)
    params = make_parameters(total, args.tensors, device)
    optimizers = {name: make(params) for name, make in CANDIDATES.items()}
    for optimizer in optimizers.values():  # allocate state, pass ADOPT's first (v-only) call
        time_steps(optimizer, args.warmup, device)

    names = list(optimizers)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(time_steps(optimizers[name], args.repeats, device))

    medians = {name: statistics.median(times) for name, times in samples.items()}
    fastest = {name: min(times) for name, times in samples.items()}
    environment = {
        "torch": torch.__version__,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    print(
        f"{sum(p.numel() for p in params) / 1e6:.1f}M float32 params in {len(params)} tensors, "
        f"{environment['device']}, {environment['threads']} threads, torch {environment['torch']}; "
        f"{args.rounds} interleaved rounds x {args.repeats} steps"
    )
    print(f"{'':30s} {'ms/step':>20s}   {'ratio to AdamW':>16s}")
    print(f"{'optimizer':30s} {'median':>9s} {'fastest':>9s}   {'median':>7s} {'fastest':>8s}")
    for name in names:
        print(
            f"{name:30s} {1e3 * medians[name]:9.1f} {1e3 * fastest[name]:9.1f}   "
            f"{medians[name] / medians[BASELINE]:6.2f}x {fastest[name] / fastest[BASELINE]:7.2f}x"
        )
    if args.json:
        result = {
            "config": vars(args),
            "environment": environment,
            "seconds_per_step_median": medians,
            "seconds_per_step_fastest": fastest,
            "samples": samples,
            "ratio_to_adamw_median": {n: medians[n] / medians[BASELINE] for n in names},
            "ratio_to_adamw_fastest": {n: fastest[n] / fastest[BASELINE] for n in names},
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
