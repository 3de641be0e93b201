"""Time one optimizer step of the MT-DAO optimizers against torch.optim.AdamW(fused=True).

All optimizers step the same parameters with the same fixed gradients and are measured side by side
in one process: after a warm-up, each round times every optimizer once (``--repeats`` steps each,
in an order that rotates between rounds), and a plain copy of a parameter-sized buffer. Each
optimizer is reported as a ratio to fused AdamW three ways: of the median times, of the fastest
times, and the median over rounds of the ratio within a round. On a shared machine, where other
work slows some rounds down, the fastest round and the within-round ratio are the steadier figures.

The update is memory-bound, so each optimizer is also given as a bandwidth: the bytes an ideal
single pass moves (read x, g and every state; write x and every state) over the time per step,
beside the bandwidth of the copy (read + write), the practical limit of this machine.

Each optimizer steps its own copy of the parameters (all with the same gradients): the flat layout
(``flat=True``, the CUDA default, :mod:`mtdao.optim.flat`) moves the parameters' data into its
buffers, which two optimizers would take from each other at every step. The rows without a layout
in their name take the device's default (on the CPU the tensors where they are, on CUDA flat).

``--breakdown`` adds rows that split the default MTAdam step. With the tensors where they are: its
kernel (on the CPU the C++ kernel, elsewhere the compiled ones) called directly on the same tensors
(the rest of the step is the optimizer's bookkeeping: step counters, bucketing, coefficients), and
called on a single flat copy of all tensors (the difference to the former is the cost of many
tensors over one). In flat buffers: the gather of the gradients into the buffer alone, and the
kernel alone over the buffers (the rest is the bookkeeping).

    python benchmarks/optimizer_step.py                      # ~25M params in 100 tensors, CPU
    python benchmarks/optimizer_step.py --breakdown          # where a fused step's time goes
    python benchmarks/optimizer_step.py --device cuda --json runs/optimizer_step.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mtdao import MTSGD, MTAdam, MTAdopt
from mtdao.optim.fused import ADAM, adam_coefficients, coefficient_tensor, run_kernels

WEIGHT_DECAY = 0.1  # the same for all, so that all pay for the decay pass
BASELINE = "AdamW(fused=True)"
COPY = "copy (memory limit)"


@dataclass(frozen=True)
class Candidate:
    make: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
    states: int  # parameter-sized optimizer states, each read and written once per step


def adamw(**kwargs) -> Candidate:
    return Candidate(
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=WEIGHT_DECAY, **kwargs), states=2
    )


def mt(optimizer_class, states: int, **kwargs) -> Candidate:
    return Candidate(
        lambda ps: optimizer_class(ps, lr=1e-3, weight_decay=WEIGHT_DECAY, **kwargs), states
    )


N2 = dict(betas=(0.9, 0.999), omegas=(0.45, 0.45))
CANDIDATES: dict[str, Candidate] = {
    BASELINE: adamw(fused=True),
    "AdamW(foreach=True)": adamw(foreach=True),
    "MTAdam N=1 omegas=(1,)": mt(MTAdam, 2, betas=(0.9,), omegas=(1.0,), fused=True),
    "MTAdam N=1 omegas=(0.9,)": mt(MTAdam, 2, fused=True),
    "MTAdam N=2 omegas=(.45,.45)": mt(MTAdam, 3, fused=True, **N2),
    "MTAdopt N=1": mt(MTAdopt, 2, fused=True),
    "MTSGD N=1": mt(MTSGD, 1, fused=True),
    "MTAdam N=1 (0.9,) per-tensor": mt(MTAdam, 2, fused=True, flat=False),
    "MTAdam N=1 (0.9,) flat": mt(MTAdam, 2, fused=True, flat=True),
    "MTAdam N=1 (0.9,) foreach": mt(MTAdam, 2, foreach=True, flat=False),
    "MTAdam N=2 foreach": mt(MTAdam, 3, foreach=True, flat=False, **N2),
}


def make_parameters(total: int, count: int, device: torch.device) -> list[torch.Tensor]:
    size = total // count
    params = []
    for index in range(count):
        generator = torch.Generator(device).manual_seed(index)
        options = dict(generator=generator, device=device)
        p = torch.randn(size, **options).mul_(0.02).requires_grad_(True)
        p.grad = torch.randn(size, **options)
        params.append(p)
    return params


def own_copy(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters' values in tensors of their own, with the same gradient tensors."""
    copies = []
    for p in params:
        copy = p.detach().clone().requires_grad_(True)
        copy.grad = p.grad
        copies.append(copy)
    return copies


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(call: Callable[[], object], steps: int, device: torch.device) -> float:
    """Seconds per call, averaged over ``steps`` back-to-back calls."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        call()
    synchronize(device)
    return (time.perf_counter() - start) / steps


BREAKDOWN_OF = "MTAdam N=1 omegas=(0.9,)"


def breakdown_calls(optimizer: MTAdam) -> dict[str, Callable[[], object]]:
    """Where a fused step's time goes (after a step: the optimizer has its states)."""
    if optimizer._flat_groups:
        return flat_breakdown_calls(optimizer)
    return per_tensor_breakdown_calls(optimizer)


def flat_breakdown_calls(optimizer: MTAdam) -> dict[str, Callable[[], object]]:
    """The gather of the gradients into the flat buffer alone, and the kernel alone over the
    buffers."""
    (bucket,) = [b for flat_group in optimizer._flat_groups.values() for b in flat_group.buckets]
    group = optimizer.param_groups[0]
    hyper = {k: group[k] for k in ("betas", "omegas", "beta2", "eps", "weight_decay")}
    params, grads, momenta, second_moment = bucket.tensors()
    spec = ADAM.spec(1, params, momenta[0])
    c = coefficient_tensor(adam_coefficients(step=10, **hyper), group["lr"], params)

    @torch.no_grad()
    def kernel_only() -> None:
        run_kernels(ADAM, spec, [params], [grads], [[u] for u in momenta], [second_moment], c)

    return {
        BREAKDOWN_OF + ": gather only": bucket.gather_gradients,
        BREAKDOWN_OF + ": kernel only": kernel_only,
    }


def per_tensor_breakdown_calls(optimizer: MTAdam) -> dict[str, Callable[[], object]]:
    """The same kernel calls without the optimizer's bookkeeping, and the same update on a
    single flat copy of the tensors."""
    group = optimizer.param_groups[0]
    params = group["params"]
    states = [optimizer.state[p] for p in params]
    hyper = {k: group[k] for k in ("betas", "omegas", "beta2", "eps", "weight_decay")}
    coefficients = adam_coefficients(step=10, **hyper)
    c = coefficient_tensor(coefficients, group["lr"], params[0])
    spec = ADAM.spec(1, params[0], states[0]["exp_avg_0"])
    tensors = [
        [p.detach() for p in params],
        [p.grad for p in params],
        [[s["exp_avg_0"] for s in states]],
        [s["exp_avg_sq"] for s in states],
    ]
    flat = [torch.cat([t.reshape(-1) for t in column]) for column in tensors[:2]]
    flat += [[torch.cat([t.reshape(-1) for t in tensors[2][0]])], torch.cat(tensors[3])]

    @torch.no_grad()
    def kernels_only() -> None:
        run_kernels(ADAM, spec, *tensors, c)

    @torch.no_grad()
    def one_flat_buffer() -> None:
        run_kernels(ADAM, spec, [flat[0]], [flat[1]], [flat[2]], [flat[3]], c)

    return {
        BREAKDOWN_OF + ": kernels only": kernels_only,
        BREAKDOWN_OF + ": one flat buffer": one_flat_buffer,
    }


def bytes_per_step(states: int, numel: int, element_size: int) -> int:
    """x read + written, g read, each state read + written."""
    return (3 + 2 * states) * numel * element_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-millions", type=float, default=25.0)
    parser.add_argument("--tensors", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (median over)")
    parser.add_argument("--repeats", type=int, default=3, help="steps per optimizer per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per optimizer")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, help="CPU intra-op threads (default: torch's)")
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help=f"also time {BREAKDOWN_OF}'s kernel alone, on its tensors and on one flat copy",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda requested but CUDA is not available")
    total = int(args.params_millions * 1e6)
    params = make_parameters(total, args.tensors, device)
    numel = sum(p.numel() for p in params)
    source, target = torch.randn(numel, device=device), torch.empty(numel, device=device)
    calls: dict[str, Callable[[], object]] = {COPY: lambda: target.copy_(source)}
    first_step: dict[str, float] = {}
    for name, candidate in CANDIDATES.items():
        optimizer = candidate.make(own_copy(params))
        # the first step allocates state and, for fused MT-DAO, compiles (or loads) its kernel
        first_step[name] = time_calls(optimizer.step, 1, device)
        time_calls(optimizer.step, args.warmup, device)  # and passes ADOPT's v-only call
        calls[name] = optimizer.step
        if args.breakdown and name == BREAKDOWN_OF:
            for part, call in breakdown_calls(optimizer).items():
                time_calls(call, args.warmup, device)
                calls[part] = call

    names = list(calls)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(time_calls(calls[name], args.repeats, device))

    medians = {name: statistics.median(times) for name, times in samples.items()}
    fastest = {name: min(times) for name, times in samples.items()}
    paired = {
        name: statistics.median(t / b for t, b in zip(times, samples[BASELINE]))
        for name, times in samples.items()
    }
    moved = {name: bytes_per_step(c.states, numel, 4) for name, c in CANDIDATES.items()}
    moved[COPY] = moved[BREAKDOWN_OF + ": gather only"] = 2 * numel * 4
    for name in names:  # other breakdown rows move what the step they break down moves
        moved.setdefault(name, moved[BREAKDOWN_OF])
    bandwidth = {name: moved[name] / fastest[name] / 1e9 for name in names}
    environment = {
        "torch": torch.__version__,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    print(
        f"{numel / 1e6:.1f}M float32 params in {len(params)} tensors, {environment['device']}, "
        f"{environment['threads']} threads, torch {environment['torch']}; "
        f"{args.rounds} interleaved rounds x {args.repeats} steps"
    )
    width = max(len(name) for name in names)
    print(
        f"{'':{width}s} {'ms/step':>17s}   {'ratio to fused AdamW':>29s}   {'GB/s':>6s} {'first':>7s}"
    )
    print(
        f"{'optimizer':{width}s} {'median':>8s} {'fastest':>8s}   {'median':>9s} {'fastest':>9s} "
        f"{'in-round':>9s}   {'fastest':>6s} {'step, s':>7s}"
    )
    for name in names:
        print(
            f"{name:{width}s} {1e3 * medians[name]:8.1f} {1e3 * fastest[name]:8.1f}   "
            f"{medians[name] / medians[BASELINE]:8.2f}x {fastest[name] / fastest[BASELINE]:8.2f}x "
            f"{paired[name]:8.2f}x   {bandwidth[name]:6.1f} {first_step.get(name, float('nan')):7.2f}"
        )
    if args.json:
        result = {
            "config": vars(args),
            "environment": environment,
            "seconds_per_step_median": medians,
            "seconds_per_step_fastest": fastest,
            "first_step_seconds": first_step,
            "bytes_per_step": moved,
            "bandwidth_gb_per_s_fastest": bandwidth,
            "samples": samples,
            "ratio_to_fused_adamw_median": {n: medians[n] / medians[BASELINE] for n in names},
            "ratio_to_fused_adamw_fastest": {n: fastest[n] / fastest[BASELINE] for n in names},
            "ratio_to_fused_adamw_within_round_median": paired,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
