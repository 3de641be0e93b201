"""Check the fused optimizer step against the foreach path on a device, and time both.

For every variant, number of momenta and dtype: compile the kernels (the first two fused steps,
timed: the one-time cost a process pays; on the CPU the very first builds or loads the C++ kernel,
elsewhere it sets up the compiler), run the same steps with ``fused=True`` and ``foreach=True`` from
the same start,
compare parameters and states (torch's default tolerances for the dtype), and time a step of each
(median of interleaved repeats). Exits with status 1 if any comparison fails. This is the script a
GPU run uses; it runs on CPU as well.

    python benchmarks/fused_check.py --device cuda
    TORCH_EXTENSIONS_DIR=$(mktemp -d) python benchmarks/fused_check.py --device cpu \
        --variants adam --momenta 1 --dtypes float32    # C++ kernel: cold build cost
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_COMPILE_THREADS=1 \\
        python benchmarks/fused_check.py --variants adam --momenta 1    # cold compile cost
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time

import torch

from mtdao import MTSGD, MTAdam, MTAdopt

VARIANTS = {"adam": MTAdam, "adopt": MTAdopt, "sgd": MTSGD}
MOMENTA = {
    1: ((0.95,), (0.7,)),
    2: ((0.9, 0.99), (0.45, 0.45)),
    3: ((0.5, 0.9, 0.99), (0.2, 0.3, 0.4)),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_run(variant, num_momenta, dtype, device, sizes, **path):
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=generator).to(device, dtype).requires_grad_() for n in sizes]
    betas, omegas = MOMENTA[num_momenta]
    optimizer = VARIANTS[variant](
        params, lr=1e-3, betas=betas, omegas=omegas, weight_decay=0.1, **path
    )
    return params, optimizer


def set_gradients(params, step: int) -> None:
    generator = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator).to(p.device, p.dtype)


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the C++ compiler runs); on a shared
    machine a steadier measure of compile cost than wall time."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def check(variant, num_momenta, dtype, device, sizes, steps, repeats) -> dict:
    fused = make_run(variant, num_momenta, dtype, device, sizes, fused=True)
    foreach = make_run(variant, num_momenta, dtype, device, sizes, foreach=True)
    synchronize(device)
    started, started_cpu = time.perf_counter(), cpu_seconds()
    for step in range(2):  # compiles (or loads) the kernels; ADOPT's first step needs none
        set_gradients(fused[0], step)
        fused[1].step()
    synchronize(device)
    first_steps, first_steps_cpu = time.perf_counter() - started, cpu_seconds() - started_cpu
    for params, optimizer in (fused, foreach):
        for step in range(2 if optimizer is fused[1] else 0, steps):
            set_gradients(params, step)
            optimizer.step()
    failures = []
    for p, q in zip(fused[0], foreach[0]):
        pairs = [(p, q)] + [
            (fused[1].state[p][k], foreach[1].state[q][k]) for k in fused[1].state[p]
        ]
        for a, b in pairs:
            try:
                torch.testing.assert_close(a, b)
            except AssertionError as error:
                failures.append(str(error).splitlines()[0])
    times = {"fused": [], "foreach": []}
    for _ in range(repeats):
        for name, (_, optimizer) in (("fused", fused), ("foreach", foreach)):
            synchronize(device)
            started = time.perf_counter()
            optimizer.step()
            synchronize(device)
            times[name].append(time.perf_counter() - started)
    return {
        "first_steps_s": first_steps,
        "first_steps_cpu_s": first_steps_cpu,
        "fused_ms": 1e3 * statistics.median(times["fused"]),
        "foreach_ms": 1e3 * statistics.median(times["foreach"]),
        "failures": failures,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=sorted(VARIANTS))
    parser.add_argument(
        "--momenta", type=int, nargs="+", choices=sorted(MOMENTA), default=[1, 2, 3]
    )
    parser.add_argument(
        "--dtypes", nargs="+", choices=sorted(DTYPES), default=["float32", "bfloat16"]
    )
    parser.add_argument("--params-millions", type=float, default=25.0)
    parser.add_argument("--tensors", type=int, default=100)
    parser.add_argument("--steps", type=int, default=5, help="compared steps (at least 2)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps of each path")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda requested but CUDA is not available")
    size = int(args.params_millions * 1e6) // args.tensors
    sizes = [size + 3 * i for i in range(args.tensors)]  # unequal sizes, some not a multiple of 16
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"{name}, torch {torch.__version__}, {sum(sizes) / 1e6:.1f}M params in {len(sizes)} "
        f"tensors, {args.steps} steps compared, median of {args.repeats} timed steps"
    )
    print(
        f"{'variant':>8} {'N':>2} {'dtype':>9} {'compile s':>10} {'(CPU s)':>8} {'fused ms':>9} "
        f"{'foreach ms':>11} result"
    )
    failed = False
    for variant in args.variants:
        for num_momenta in args.momenta:
            for dtype_name in args.dtypes:
                result = check(
                    variant,
                    num_momenta,
                    DTYPES[dtype_name],
                    device,
                    sizes,
                    args.steps,
                    args.repeats,
                )
                verdict = "ok" if not result["failures"] else f"MISMATCH {result['failures'][0]}"
                failed |= bool(result["failures"])
                print(
                    f"{variant:>8} {num_momenta:>2} {dtype_name:>9} {result['first_steps_s']:>10.2f} "
                    f"{result['first_steps_cpu_s']:>8.2f} {result['fused_ms']:>9.2f} "
                    f"{result['foreach_ms']:>11.2f} {verdict}"
                )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
