"""The parts of the GPU campaign (``benchmarks/gpu_campaign.py``), each run in a process of its own.

A part is a function of a :class:`PartContext`: it measures or checks one thing on ``ctx.device``
(``cuda``, or ``cpu`` in a dry run, at toy sizes), records its figures with ``ctx.record`` /
``ctx.append`` (each call rewrites the part's JSON file, so a part killed at its time limit leaves
what it had) and watches ``ctx.left``, the seconds before its limit. An exception ends the part,
recorded as its error; the campaign goes on with the next.
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
METHODS = ("ddp", "qh-ddp", "local-adam", "diloco", "desloc", "mtdao")
PACKAGES = ("numpy", "matplotlib", "tqdm", "xxhash", "ninja", "triton", "torchft", "transformers")


class PartContext:
    """What a part needs: the device, its time limit, where to write, and its record."""

    def __init__(self, name: str, record_file: Path, budget_s: float, args) -> None:
        self.name = name
        self.record_file = record_file
        self.deadline = time.monotonic() + budget_s
        self.dry_run = args.dry_run
        self.device = "cpu" if args.dry_run else "cuda"
        self.scratch = Path(args.scratch) / name
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.data_flags = ["--data", args.data] if args.data else []
        self.data: dict[str, Any] = {}

    @property
    def left(self) -> float:
        return self.deadline - time.monotonic()

    def record(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.flush()

    def append(self, key: str, value: Any) -> None:
        self.data.setdefault(key, []).append(value)
        self.flush()

    def flush(self) -> None:
        write_json(self.record_file, self.data)

    def say(self, text: str) -> None:
        print(f"[{self.name} {self.left:6.1f} s left] {text}", flush=True)


def write_json(path: Path, value: Any) -> None:
    """Write ``value`` whole or not at all (a reader never sees half a file)."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(value, indent=1, default=str))
    temporary.replace(path)


def benchmark_module(name: str):
    """A script of benchmarks/ as a module (the campaign reuses them, it does not copy them)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return __import__(name)


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def python_env() -> dict[str, str]:
    """The environment of a subprocess that runs mtdao from this checkout (it is not installed
    where the campaign runs): ``python -m mtdao`` with the repository's src on PYTHONPATH."""
    paths = [str(REPO / "src"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}


def run_command(ctx: PartContext, command: list[str], log: Path, timeout: float, **env) -> int:
    """Run ``command`` (its output to ``log``), killed at ``timeout``; its exit code (-9 when
    killed)."""
    ctx.say(" ".join(command))
    with open(log, "w") as output:
        process = subprocess.Popen(
            command,
            stdout=output,
            stderr=subprocess.STDOUT,
            env={**python_env(), **env},
            cwd=REPO,
            start_new_session=True,
        )
        try:
            return process.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            kill_session(process)
            return -9


def kill_session(process: subprocess.Popen) -> None:
    """End ``process`` and every process it started (its own session)."""
    import signal

    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def log_tail(log: Path, characters: int = 1500) -> str:
    try:
        return log.read_text(errors="replace")[-characters:]
    except OSError:
        return ""


# -- 1. environment -------------------------------------------------------------------------------


def environment(ctx: PartContext) -> None:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
    }
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        info["gpu"] = properties.name
        info["capability"] = f"{properties.major}.{properties.minor}"
        info["gpu_memory_gb"] = round(properties.total_memory / 1e9, 1)
        info["cudnn"] = torch.backends.cudnn.version()
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    packages = {}
    for name in PACKAGES:
        try:
            packages[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            packages[name] = None
    info["packages"] = packages
    ctx.record("environment", info)
    ctx.say(f"torch {info['torch']}, CUDA {info['cuda']}, GPU {info.get('gpu', 'none')}")
    if ctx.device == "cuda" and not info["cuda_available"]:
        raise RuntimeError("no CUDA device: the GPU parts cannot run")


# -- 2. exactness of the flat path ------------------------------------------------------------------

EXACT_SHAPES = [(), (5,), (3, 4), (70_001,), (6, 4)]  # the last one is used transposed
EXACT_STEPS = 8
# float32 against the float64 reference over EXACT_STEPS steps; against the per-tensor float32 path
# (other arithmetic order: rounding)
REFERENCE_TOLERANCE = dict(rtol=1e-4, atol=1e-5)
PER_TENSOR_TOLERANCE = {
    "float32": dict(rtol=1e-5, atol=1e-6),
    "bfloat16": dict(rtol=1.6e-2, atol=1e-5),
}


def exactness(ctx: PartContext) -> None:
    import torch

    cases = [("adam", 1), ("adopt", 1), ("sgd", 1), ("adam", 2), ("adopt", 2), ("sgd", 2)]
    cases += [("adam", 3), ("adopt", 3), ("sgd", 3)]
    plan = [(v, n, "fused", "float32") for v, n in cases[:6]]
    plan += [(v, 1, "fused", "bfloat16") for v in ("adam", "adopt", "sgd")]
    plan += [(v, n, "foreach", "float32") for v, n in cases[:3]]
    plan += [(v, n, "fused", "float32") for v, n in cases[6:]]
    for variant, momenta, kernel, dtype in plan:
        label = f"{variant} N={momenta} {kernel} {dtype}"
        if ctx.left < 10:
            ctx.append("skipped", label)
            continue
        started = time.monotonic()
        row = exactness_case(ctx.device, variant, momenta, kernel, getattr(torch, dtype))
        row.update(case=label, seconds=round(time.monotonic() - started, 2))
        ctx.append("rows", row)
        ctx.say(f"{label}: {row}")


def exactness_case(device: str, variant: str, momenta: int, kernel: str, dtype) -> dict:
    """The flat path (``kernel``: fused or foreach) against the literal reference in float64 and
    against the per-tensor foreach path, over EXACT_STEPS steps of changing learning rates; the
    worst |error| / (atol + rtol |expected|) of each (at most 1 passes)."""
    import torch
    from torch import nn

    from mtdao import MTSGD, MTAdam, MTAdopt
    from mtdao.optim import reference

    optimizers = {"adam": MTAdam, "adopt": MTAdopt, "sgd": MTSGD}
    references = {
        "adam": reference.mt_adam_reference,
        "adopt": reference.mt_adopt_reference,
        "sgd": reference.mt_sgd_reference,
    }
    extra = {"adam": dict(beta2=0.99, eps=1e-8), "adopt": dict(beta2=0.999, eps=1e-6), "sgd": {}}
    betas, omegas = [
        ((0.9,), (0.7,)),
        ((0.9, 0.99), (0.5, 0.4)),
        ((0.5, 0.95, 0.999), (0.2, 0.3, 0.4)),
    ][momenta - 1]
    hyper = dict(betas=betas, omegas=omegas, weight_decay=0.1, **extra[variant])
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(shape, generator=generator) for shape in EXACT_SHAPES]
    initial[-1] = initial[-1].t()  # dense, not contiguous

    def parameters():
        return [nn.Parameter(x.to(device=device, dtype=dtype)) for x in initial]

    flat_params, per_tensor_params = parameters(), parameters()
    flat = optimizers[variant](flat_params, lr=1e-2, flat=True, fused=kernel == "fused", **hyper)
    per_tensor = optimizers[variant](per_tensor_params, lr=1e-2, flat=False, foreach=True, **hyper)
    expected = [p.detach().double().cpu() for p in flat_params]
    states = [reference.initial_state(x, momenta, variant != "sgd") for x in expected]
    for step in range(EXACT_STEPS):
        lr = 1e-2 * (1.0 + 0.5 * (step % 3))
        for optimizer in (flat, per_tensor):
            optimizer.param_groups[0]["lr"] = lr
        for i, (p, q) in enumerate(zip(flat_params, per_tensor_params)):
            noise = torch.randn(p.shape, generator=generator) * (20.0 if step == 5 else 1.0)
            p.grad = noise.to(device=device, dtype=dtype)
            q.grad = p.grad.clone()
            expected[i], states[i] = references[variant](
                expected[i], p.grad.double().cpu(), states[i], lr=lr, **hyper
            )
        flat.step()
        per_tensor.step()
    layout = "flat" if flat._flat_groups else "per-tensor"
    worst_reference = worst_per_tensor = 0.0
    for p, q, x, state in zip(flat_params, per_tensor_params, expected, states):
        if dtype == torch.float32:
            worst_reference = max(worst_reference, excess(p, x, **REFERENCE_TOLERANCE))
            for key, value in state.items():
                if key != "step":
                    worst_reference = max(
                        worst_reference, excess(flat.state[p][key], value, **REFERENCE_TOLERANCE)
                    )
        tolerance = PER_TENSOR_TOLERANCE[str(dtype).split(".")[-1]]
        worst_per_tensor = max(worst_per_tensor, excess(p, q, **tolerance))
        for key, value in flat.state[p].items():
            if key != "step":
                worst_per_tensor = max(
                    worst_per_tensor, excess(value, per_tensor.state[q][key], **tolerance)
                )
    return {
        "layout": layout,
        "vs_reference": worst_reference if dtype == torch.float32 else None,
        "vs_per_tensor": worst_per_tensor,
        "passed": layout == "flat" and worst_reference <= 1.0 and worst_per_tensor <= 1.0,
    }


def excess(actual, expected, rtol: float, atol: float) -> float:
    """max |actual - expected| / (atol + rtol |expected|): at most 1 where torch's assert_close
    with these tolerances passes."""
    actual = actual.detach().double().cpu()
    expected = expected.detach().double().cpu()
    if actual.numel() == 0:
        return 0.0
    ratio = (actual - expected).abs() / (atol + rtol * expected.abs())
    return float(ratio.max()) if ratio.isfinite().all() else math.inf


# -- 3. the optimizer step --------------------------------------------------------------------------

# (label, parameters in millions, tensors)
STEP_SIZES = [("25M in 100 tensors", 25.0, 100), ("1B in 200 tensors", 1000.0, 200)]
DRY_STEP_SIZES = [("100K in 50 tensors", 0.1, 50), ("400K in 10 tensors", 0.4, 10)]


BREAKDOWN_ROW = "MTAdam N=1"  # its gather and kernel are timed alone too


def step_candidates() -> list[tuple[str, list[tuple[str, Callable, int]]]]:
    """(phase, [(row label, make optimizer from parameters, optimizer states)]) in the order
    they are measured: the rows that answer the targets first, for both sizes, then the rest."""
    import torch

    from mtdao import MTSGD, MTAdam, MTAdopt

    step = benchmark_module("optimizer_step")
    decay = step.WEIGHT_DECAY
    momenta = {1: dict(betas=(0.999,), omegas=(0.9,)), 2: step.N2}
    momenta[3] = dict(betas=(0.9, 0.99, 0.999), omegas=(0.3, 0.3, 0.3))

    def adamw(**options):
        return lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=decay, **options)

    def mt(cls, n, **options):
        settings = {**momenta[n], **options}
        return lambda ps: cls(ps, lr=1e-3, weight_decay=decay, **settings)

    core = [
        ("AdamW(fused=True)", adamw(fused=True), 2),
        ("AdamW(foreach=True)", adamw(foreach=True), 2),
        ("MTAdam N=1", mt(MTAdam, 1), 2),
        ("MTAdam N=2", mt(MTAdam, 2), 3),
        ("MTAdam N=1 omegas=(1,)", mt(MTAdam, 1, omegas=(1.0,)), 2),
        ("MTAdopt N=1", mt(MTAdopt, 1), 2),
        ("MTSGD N=1", mt(MTSGD, 1), 1),
        ("MTAdam N=1 per-tensor foreach", mt(MTAdam, 1, flat=False, foreach=True), 2),
        ("MTAdam N=1 flat foreach", mt(MTAdam, 1, flat=True, fused=False), 2),
    ]
    rest = [
        ("MTAdopt N=2", mt(MTAdopt, 2), 3),
        ("MTSGD N=2", mt(MTSGD, 2), 2),
        ("MTAdam N=3", mt(MTAdam, 3), 4),
        ("MTAdopt N=3", mt(MTAdopt, 3), 4),
        ("MTSGD N=3", mt(MTSGD, 3), 3),
        ("MTAdam N=2 per-tensor foreach", mt(MTAdam, 2, flat=False, foreach=True), 3),
        ("MTAdam N=1 per-tensor compiled", mt(MTAdam, 1, flat=False, fused=True), 2),
    ]
    return [("core", core), ("rest", rest)]


def optimizer_step(ctx: PartContext) -> None:
    import torch

    step = benchmark_module("optimizer_step")
    device = torch.device(ctx.device)
    sizes = DRY_STEP_SIZES if ctx.dry_run else STEP_SIZES
    timing = dict(warmup=1, rounds=2, repeats=2) if ctx.dry_run else dict(warmup=3, rounds=5)
    ctx.record("sizes", [label for label, _, _ in sizes])
    for phase in ("core", "rest"):
        for size, millions, count in sizes:
            if ctx.left < 15:
                ctx.append("skipped", f"{phase} rows of {size}: out of time")
                continue
            params = step.make_parameters(int(millions * 1e6), count, device)
            numel = sum(p.numel() for p in params)
            repeats = 2 if ctx.dry_run else max(3, min(10, int(2e8 // numel)))
            if phase == "core":
                copy_row(ctx, step, size, numel, device, repeats, timing)
                release(device)
            candidates = dict(step_candidates())[phase]
            for label, make, states in candidates:
                # a step of a 1B model takes tens of ms, its first (a compile) seconds
                if ctx.left < (10 if numel < 1e8 else 20):
                    ctx.append("skipped", f"{label} at {size}: out of time")
                    continue
                breakdown = label == BREAKDOWN_ROW
                row = time_candidate(step, params, make, states, device, repeats, timing, breakdown)
                row.update(size=size, label=label, numel=numel)
                ctx.append("rows", row)
                ctx.say(
                    f"{size} {label}: {row['median_ms']:.3f} ms ({row['layout']}, {row['kernel']})"
                )
            del params
            release(device)


def copy_row(ctx, step, size, numel, device, repeats, timing) -> None:
    """A device-to-device copy of a parameter-sized buffer: this machine's practical bandwidth."""
    import torch

    source, target = torch.randn(numel, device=device), torch.empty(numel, device=device)
    samples = [
        step.time_calls(lambda: target.copy_(source), repeats, device)
        for _ in range(timing["rounds"])
    ]
    moved = 2 * numel * 4
    ctx.append(
        "rows",
        dict(
            size=size,
            label="copy of a parameter-sized buffer",
            numel=numel,
            layout="-",
            kernel="copy",
            median_ms=1e3 * sorted(samples)[len(samples) // 2],
            fastest_ms=1e3 * min(samples),
            ideal_bytes=moved,
        ),
    )


def time_candidate(step, params, make, states, device, repeats, timing, breakdown=False) -> dict:
    """Median and fastest time of a step (and, with ``breakdown``, of its parts) of the optimizer
    ``make`` builds over its own copy of ``params``."""
    import torch

    own = step.own_copy(params)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    optimizer = make(own)
    first = step.time_calls(optimizer.step, 1, device)  # allocates states; compiles once
    step.time_calls(optimizer.step, timing["warmup"], device)
    samples = [step.time_calls(optimizer.step, repeats, device) for _ in range(timing["rounds"])]
    layout, kernel = path_taken(optimizer)
    row = dict(
        layout=layout,
        kernel=kernel,
        median_ms=1e3 * sorted(samples)[len(samples) // 2],
        fastest_ms=1e3 * min(samples),
        first_step_s=first,
        ideal_bytes=step.bytes_per_step(states, sum(p.numel() for p in own), 4),
    )
    if device.type == "cuda":
        row["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    if breakdown and layout == "flat" and kernel != "foreach":
        for name, call in step.flat_breakdown_calls(optimizer).items():
            part = name.split(": ")[-1].split()[0]  # the gather of the gradients, or the kernel
            step.time_calls(call, 1, device)
            times = [step.time_calls(call, repeats, device) for _ in range(timing["rounds"])]
            row[f"{part}_ms"] = 1e3 * sorted(times)[len(times) // 2]
    del optimizer, own
    release(device)
    return row


def path_taken(optimizer) -> tuple[str, str]:
    """(layout, kernel) an optimizer's first group took: flat or per-tensor; compiled, C++ or
    foreach (torch's own optimizers: torch, fused or foreach)."""
    group = optimizer.param_groups[0]
    if not hasattr(optimizer, "_flat_groups"):
        return "torch", "fused" if group.get("fused") else "foreach"
    if optimizer._flat_groups:
        (flat_group,) = optimizer._flat_groups.values()
        bucket = flat_group.buckets[0]
        params, _, momenta, _ = bucket.tensors()
        layout, tensors, state = "flat", [params], momenta[0]
    else:
        params = [p for p in group["params"] if p.grad is not None]
        layout, tensors, state = "per-tensor", params, optimizer.state[params[0]]["exp_avg_0"]
    path = optimizer._path(group, tensors, state)
    if path != "fused":
        return layout, path
    spec = optimizer.fused_rule.spec(len(group["betas"]), tensors[0], state)
    return layout, "C++" if optimizer.fused_rule.native(spec) else "compiled"


def release(device) -> None:
    """Hand the memory of the tensors just dropped back to the GPU (the next rows and the 1B size
    need it). On the CPU freed tensors are gone already, and a collection would cost a dry run
    ~0.2 s a row."""
    import torch

    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


# -- 4. mtdao train for every method -----------------------------------------------------------------


def train_flags(ctx: PartContext) -> list[str]:
    if ctx.dry_run:
        shape = ["--model", "micro", "--steps", "3", "--batch-size", "2", "--seq-len", "32"]
        shape += ["--eval-tokens", "256", "--eval-every", "3", "--sync-period", "2"]
    else:
        shape = ["--model", "tiny", "--steps", "40", "--batch-size", "16", "--seq-len", "64"]
        shape += ["--eval-tokens", "16384", "--eval-every", "20", "--sync-period", "8"]
    return ["--device", ctx.device, *shape, "--no-progress", *ctx.data_flags]


def train_methods(ctx: PartContext) -> None:
    runs = [(method, method, []) for method in METHODS]
    if not ctx.dry_run:  # float32 beside the default bf16 autocast (the CPU runs float32 anyway)
        runs.append(("mtdao --no-bf16", "mtdao", ["--no-bf16"]))
    threads = "1" if ctx.dry_run else "2"
    processes = []
    for name, method, extra in runs:
        directory = ctx.scratch / name.replace(" ", "")
        command = [sys.executable, "-m", "mtdao", "train", "--method", method, *train_flags(ctx)]
        command += [*extra, "--out", str(directory)]
        log = ctx.scratch / f"{name.replace(' ', '')}.log"
        with open(log, "w") as output:
            process = subprocess.Popen(
                command,
                stdout=output,
                stderr=subprocess.STDOUT,
                env={**python_env(), "OMP_NUM_THREADS": threads},
                cwd=REPO,
                start_new_session=True,
            )
        processes.append((name, directory, log, process))
    ctx.say(f"{len(processes)} runs started")
    for name, directory, log, process in processes:
        try:
            code = process.wait(timeout=max(1.0, ctx.left - 3))
        except subprocess.TimeoutExpired:
            kill_session(process)
            code = -9
        ctx.append("runs", train_summary(name, directory, log, code))


def train_summary(name: str, directory: Path, log: Path, code: int) -> dict:
    """What a finished ``mtdao train`` run shows: its losses (all finite?), autocast, speed."""
    summary: dict[str, Any] = {"run": name, "exit_code": code}
    results_file = directory / "results.json"
    if code != 0 or not results_file.exists():
        summary.update(passed=False, log_tail=log_tail(log))
        return summary
    results = json.loads(results_file.read_text())
    losses = []
    for line in (directory / "metrics.jsonl").read_text().splitlines():
        entry = json.loads(line)
        losses += [entry[k] for k in ("train_loss", "val_loss") if k in entry]
    config = results["config"]
    summary.update(
        steps=results["steps"],
        final_val_loss=results["final_val_loss"],
        losses_logged=len(losses),
        all_finite=all(finite(loss) for loss in losses),
        device=config["device"],
        bf16=config["bf16"],
        compute_s_per_worker_step=results["compute_s_per_worker_step"],
        wall_time_s=results["wall_time_s"],
        bytes_per_worker=results["bytes_per_worker"],
    )
    summary["passed"] = summary["all_finite"] and finite(summary["final_val_loss"])
    return summary


# -- 5. the simulator's vmapped workers ---------------------------------------------------------------


def vmapped_workers(ctx: PartContext) -> None:
    import torch

    check = benchmark_module("gpu_sharded_check")
    for dtype, tolerance in check.VMAP_TOLERANCE.items():
        gap = check.vmapped_gradient_gap(ctx.device, dtype)
        row = dict(dtype=str(dtype).split(".")[-1], worst_gap=gap, tolerance=tolerance)
        row["passed"] = gap < tolerance
        ctx.append("rows", row)
        ctx.say(f"{row}")
    del torch


# -- 6. sharded workers --------------------------------------------------------------------------------


def sharded(ctx: PartContext) -> None:
    import torch

    check = benchmark_module("gpu_sharded_check")
    verdict = check.check_fsdp(ctx.scratch, ctx.device, steps=3 if ctx.dry_run else check.STEPS)
    ctx.record("fsdp", dict(name=verdict.name, passed=verdict.passed, details=verdict.details))
    gpus = torch.cuda.device_count() if ctx.device == "cuda" else 1
    if gpus < 2:
        ctx.record(
            "shards_2", dict(skipped="--shards 2 needs two GPUs (NCCL: one process per GPU)")
        )
        return
    directory = ctx.scratch / "shards-2"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    command += ["2", "-m", "mtdao", "train", "--workers", "1", "--shards", "2", *train_flags(ctx)]
    command += ["--out", str(directory)]
    log = ctx.scratch / "shards-2.log"
    code = run_command(ctx, command, log, ctx.left - 3)
    ctx.record("shards_2", train_summary("--workers 1 --shards 2", directory, log, code))


# -- 7. torchrun on one process ---------------------------------------------------------------------------

TORCHRUN_STEPS = 30


def torchrun(ctx: PartContext) -> None:
    """``mtdao train`` launched by torchrun (at world size 1 it joins no process group: it trains as
    a plain process), then a one-process torchrun job that joins the process group (NCCL on a GPU)
    and trains a small Llama through mtdao's process-group communicator."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    directory = ctx.scratch / "train"
    command = [*launcher, "1", "-m", "mtdao", "train", "--method", "mtdao", *train_flags(ctx)]
    log = ctx.scratch / "train.log"
    code = run_command(ctx, [*command, "--out", str(directory)], log, ctx.left / 2)
    ctx.record("train", train_summary("torchrun ... mtdao train", directory, log, code))

    record = ctx.scratch / "group.json"
    steps = 3 if ctx.dry_run else TORCHRUN_STEPS
    command = [*launcher, "1", str(Path(__file__).resolve()), ctx.device, str(steps), str(record)]
    log = ctx.scratch / "group.log"
    code = run_command(ctx, command, log, ctx.left - 3)
    group = json.loads(record.read_text()) if record.exists() else {}
    group["exit_code"] = code
    losses = group.get("losses", [])
    group["passed"] = code == 0 and bool(losses) and all(finite(loss) for loss in losses)
    if not group["passed"]:
        group["log_tail"] = log_tail(log)
    ctx.record("group", group)


def torchrun_worker(device: str, steps: int, record: Path) -> None:
    """A process of a torchrun job: join the group, train a small Llama through the process-group
    communicator (gpu_sharded_check's, unsharded), record the backend and the losses."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    check = benchmark_module("gpu_sharded_check")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    try:
        world_size = dist.get_world_size()
        mesh = init_device_mesh(device, (world_size, 1), mesh_dim_names=("replicate", "shard"))
        run = check.train_small_llama(False, mesh, device, steps)
        optimizer = run["optimizer"]
        write_json(
            record,
            {
                "backend": dist.get_backend(),
                "world_size": world_size,
                "losses": run["losses"],
                "optimizer_layout": "flat" if optimizer._flat_groups else "per-tensor",
            },
        )
    finally:
        dist.destroy_process_group()


# -- 8. the paper's 16M setting ------------------------------------------------------------------------------

PAPER_METHODS = ["ddp", "local-adam", "mtdao"]
PAPER_MAX_STEPS = 1000  # the preset's own length
PAPER_MARGIN = 1.2  # a run's steps may take this much longer than the calibration's
CALIBRATION_STEPS = 21  # log lines at steps 10 and 20: a steady per-step time between them


def paper_16m(ctx: PartContext) -> None:
    base = [sys.executable, "-m", "mtdao", "compare", "--preset", "paper-16m", "--seeds", "0"]
    base += ["--jobs", "1", *ctx.data_flags]
    if ctx.dry_run:
        # the preset's flow (calibration, planned steps, the three methods) at the micro shape
        base += ["--model", "micro", "--batch-size", "1", "--seq-len", "32", "--eval-tokens", "256"]
        base += ["--threads", "1"]
    calibration_steps = 3 if ctx.dry_run else CALIBRATION_STEPS
    calibration = ctx.scratch / "calibration"
    command = [*base, "--methods", "mtdao", "--steps", str(calibration_steps)]
    started = time.monotonic()
    code = run_command(
        ctx, [*command, "--out", str(calibration)], ctx.scratch / "calibration.log", ctx.left - 5
    )
    calibration_s = time.monotonic() - started
    runs = run_results(calibration)
    if code != 0 or not runs:
        raise RuntimeError(
            f"the calibration run failed (exit code {code}): "
            f"{log_tail(ctx.scratch / 'calibration.log', 600)}"
        )
    (run,) = runs.values()
    per_step = run["steady_step_s"]
    overhead = max(0.0, calibration_s - run["train_time_s"])  # start, data, evals, saving
    ctx.record(
        "calibration",
        dict(steps=calibration_steps, wall_s=calibration_s, step_s=per_step, overhead_s=overhead),
    )
    available = ctx.left - 10 - len(PAPER_METHODS) * overhead
    steps = int(available / (len(PAPER_METHODS) * per_step * PAPER_MARGIN))
    steps = min(steps, 2 if ctx.dry_run else PAPER_MAX_STEPS)
    ctx.record("planned", dict(steps=steps, seconds_left=ctx.left))
    if steps < 2:
        raise RuntimeError(f"no time left for the runs ({ctx.left:.0f} s, {per_step:.3f} s a step)")
    out = ctx.scratch / "compare"
    command = [*base, "--steps", str(steps), "--eval-every", str(max(10, steps // 10))]
    command += ["--out", str(out)]
    code = run_command(ctx, command, ctx.scratch / "compare.log", ctx.left - 3)
    ctx.record("exit_code", code)
    results = run_results(out)
    ctx.record("runs", results)
    if code != 0:
        raise RuntimeError(f"mtdao compare failed: {log_tail(ctx.scratch / 'compare.log', 600)}")
    missing = [m for m in PAPER_METHODS if not any(r["method"] == m for r in results.values())]
    if missing:
        raise RuntimeError(f"no result for {missing}")


def run_results(compare_out: Path) -> dict[str, dict]:
    """Each finished run of an ``mtdao compare`` directory: method, steps, final loss, time."""
    found = {}
    for results_file in sorted((compare_out / "runs").glob("*/results.json")):
        results = json.loads(results_file.read_text())
        found[results_file.parent.name] = {
            "method": results["method"],
            "steps": results["steps"],
            "tokens": results["tokens"],
            "final_val_loss": results["final_val_loss"],
            "parameters": results["parameters"],
            "train_time_s": results["train_time_s"],
            "eval_time_s": results["eval_time_s"],
            "steady_step_s": steady_step_seconds(results_file.parent / "metrics.jsonl", results),
            "comm_reduction_vs_ddp": results["comm_reduction_vs_ddp"],
        }
    return found


def steady_step_seconds(metrics: Path, results: dict) -> float:
    """Seconds a step between the first and the last logged step (the first steps, which compile,
    left out), or the whole run's average where fewer than two were logged."""
    logged = []
    for line in metrics.read_text().splitlines():
        entry = json.loads(line)
        if "train_loss" in entry:
            logged.append((entry["step"], entry["train_time_s"]))
    if len(logged) >= 2 and logged[-1][0] > logged[0][0]:
        (first_step, first_s), (last_step, last_s) = logged[0], logged[-1]
        return (last_s - first_s) / (last_step - first_step)
    return results["train_time_s"] / max(1, results["steps"])


PARTS: dict[str, Callable[[PartContext], None]] = {
    "environment": environment,
    "exactness": exactness,
    "optimizer_step": optimizer_step,
    "train": train_methods,
    "vmapped_workers": vmapped_workers,
    "sharded": sharded,
    "torchrun": torchrun,
    "paper_16m": paper_16m,
}


if __name__ == "__main__":  # a process of the torchrun part's job: DEVICE STEPS RECORD
    torchrun_worker(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
