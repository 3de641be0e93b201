"""``mtdao slow-link``: DDP against MT-DAO with real gloo workers whose traffic crosses a slow link.

Each of M workers is one ``python -m mtdao train`` process in its own host namespace of
:func:`mtdao.testing.network.netem.emulated_link` (with ``--delay-ms`` on a kernel without netem, of
:func:`mtdao.testing.network.relay_link.slow_link`, whose switch makes the delay). They meet the way
torchrun's static rendezvous does, through RANK / WORLD_SIZE / MASTER_ADDR (worker 0's link
address) / MASTER_PORT, and
``GLOO_SOCKET_IFNAME=link0`` keeps gloo on the shaped interface; a namespace has no other way out.

What is measured, per link rate and method, from the real runs:

- wall-clock: rank 0's ``train_time_s`` (training steps including every wait on a collective;
  start-up and evaluation excluded), read at each evaluation from ``results.json``;
- time to DDP's final validation loss: wall-clock at the first evaluation at or below it, linearly
  interpolated from the one before (None when never reached);
- iso-token wall-clock: wall-clock when the run has seen as many tokens as DDP's whole run;
- bytes: the harness's payload count per worker, and the bytes each worker's interface really sent;
- the link's TCP throughput, measured before the runs.

Evaluations and metric lines come every K steps (right after a parameter average), so the untimed
collectives they contain never hide a worker's lag: the waits are charged to the timed sync.

Without root or network namespaces the command prints one line ``skipped: <reason>`` and exits 0.
Running is here, the workers' processes in :mod:`.workers`; the DDP-relative figures are
computed in :mod:`.summary`, the report and plot drawn in :mod:`.report`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtdao.experiments.common.formatting import format_bytes
from mtdao.experiments.common.results import stamped, write_report
from mtdao.experiments.common.study_flags import add_study_schedule_arguments, typed_command
from mtdao.experiments.slow_link.report import (
    plot_time_to_loss,
    plot_time_to_target,
    render,
    report_table,
)
from mtdao.experiments.slow_link.summary import KIND, SCHEMA, compare_to_ddp
from mtdao.experiments.slow_link.workers import launch_workers, sent_bytes
from mtdao.flags import add_dataclass_arguments, dataclass_from_args
from mtdao.methods.table import GRADIENT_AVERAGING_METHODS, METHODS, MULTI_TIMESCALE_METHODS
from mtdao.model.presets import MODEL_PRESETS
from mtdao.testing.network.netem import EmulatedLink, LinkUnavailable
from mtdao.testing.network.netem import measure_throughput_mbit as measure_link_mbit
from mtdao.testing.network.relay_link import RelayLink, emulation_of, slow_link
from mtdao.train.command import config_to_argv
from mtdao.train.config import TrainConfig, describe_default, resolve

DEFAULT_RATES = (100.0, 1000.0)
DEFAULT_METHODS = ("ddp", "mtdao")
FIRST_PORT = 29500
LINK_FIGURES = "link.json"  # what the link measured of a run, beside its results.json


# -- what each run trains ----------------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    """One row per link rate: a method, or a named variant (a method with extra train flags)."""

    name: str
    method: str
    flags: str = ""


def run_specs(args: argparse.Namespace) -> list[RunSpec]:
    """DDP first (its final loss is every other row's target), then the methods, then the
    variants, each checked before anything runs."""
    methods = sorted(dict.fromkeys(args.methods), key=lambda m: m != "ddp")
    specs = [RunSpec(method, method) for method in methods]
    for name, flags in args.variant:
        if any(spec.name == name for spec in specs):
            raise ValueError(f"--variant {name}: the name is taken")
        method = parse_train_flags(shlex.split(flags)).sync.method
        spec = RunSpec(name, method, flags)
        train_argv(spec, args, Path("unused"))  # refuses bad flags in one line, now
        specs.append(spec)
    return specs


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise ValueError(f"--variant: {message}")


def parse_train_flags(argv: list[str]) -> TrainConfig:
    """The (unresolved) config that ``mtdao train`` flags give; a bad flag raises ValueError."""
    parser = _RaisingParser(prog="--variant", add_help=False)
    add_dataclass_arguments(parser, TrainConfig, describe_default)
    return dataclass_from_args(TrainConfig, parser.parse_args(argv))


def train_argv(spec: RunSpec, args: argparse.Namespace, run_dir: Path) -> list[str]:
    """``mtdao train`` flags of one run: the experiment's settings, then the variant's flags on
    top; local methods get ``--local-steps`` steps."""
    argv = config_to_argv(base_config(spec.method, args, run_dir))
    if not spec.flags:
        return argv
    config = parse_train_flags(argv + shlex.split(spec.flags))
    resolve(config)  # a bad combination is refused before any worker starts
    return config_to_argv(config)


def base_config(method: str, args: argparse.Namespace, run_dir: Path) -> TrainConfig:
    multi_timescale = method in MULTI_TIMESCALE_METHODS
    return TrainConfig.of(
        method=method,
        workers=args.workers,
        steps=args.steps if method in GRADIENT_AVERAGING_METHODS else local_steps(args),
        model=args.model,
        sync_period=args.sync_period,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        eval_every=args.eval_every or eval_every(args.steps, args.sync_period),
        log_every=args.sync_period,
        eval_tokens=args.eval_tokens,
        seed=args.seed,
        out=str(run_dir),
        progress=False,
        data=args.data,
        lr=args.lr,
        schedule=args.schedule,
        warmup=args.warmup,
        betas=tuple(args.betas) if multi_timescale and args.betas else None,
        omegas=tuple(args.omegas) if multi_timescale and args.omegas else None,
    )


def local_steps(args: argparse.Namespace) -> int:
    return args.local_steps if args.local_steps is not None else 2 * args.steps


def eval_every(steps: int, sync_period: int) -> int:
    """About 10 evaluations over ``steps``, on a multiple of K (right after an average) that
    divides ``steps`` where one does, so that every run is evaluated at DDP's token count."""
    multiples = range(sync_period, steps + 1, sync_period)
    dividing = [every for every in multiples if steps % every == 0] or list(multiples)
    return min(dividing or [sync_period], key=lambda every: abs(every - steps / 10))


# -- one link rate ------------------------------------------------------------------------------


def run_method(
    link: EmulatedLink | RelayLink, spec: RunSpec, args: argparse.Namespace, out: Path, port: int
) -> dict[str, Any]:
    """One run's workers across ``link``: the run's outputs plus what the link and the machine
    measured meanwhile (interface bytes, launch-to-exit seconds, load average)."""
    name = f"{spec.name}-{link.rate_mbit:g}mbit"
    run_dir = out / "runs" / name
    argv = train_argv(spec, args, run_dir)
    settings = {"rate_mbit": link.rate_mbit, "delay_ms": args.delay_ms}
    if args.keep_finished:
        kept = finished_run(run_dir, argv, settings)
        if kept is not None:
            print(f"  {spec.name:>10}: kept the finished run in {run_dir}")
            return kept
    shutil.rmtree(run_dir, ignore_errors=True)  # a rerun replaces the previous one
    (out / "logs").mkdir(parents=True, exist_ok=True)
    sent_before = [sent_bytes(link, h) for h in range(args.workers)]
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    launch_workers(link, argv, port, out / "logs" / name, args.timeout)
    elapsed = time.perf_counter() - started
    sent = [sent_bytes(link, h) - b for h, b in enumerate(sent_before)]
    figures = {
        "process_time_s": elapsed,
        "wire_bytes_per_worker": sum(sent) / len(sent),
        "load_average": [load_before, os.getloadavg()[0]],
    }
    (run_dir / LINK_FIGURES).write_text(json.dumps({**settings, **figures}))
    return {**collect_run(run_dir), **figures}


def finished_run(
    run_dir: Path, argv: list[str], link_settings: dict[str, float]
) -> dict[str, Any] | None:
    """The row of a run already finished in ``run_dir`` with exactly the training settings of
    ``argv`` across a link of ``link_settings`` (rate, delay; its link.json says), else None.
    What the link measured (interface bytes, launch-to-exit seconds, load) comes from link.json
    too, None where it holds only the settings."""
    try:
        saved = TrainConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
        json.loads((run_dir / "results.json").read_text())  # written last: the run finished
        link = json.loads((run_dir / LINK_FIGURES).read_text())
    except (OSError, ValueError):
        return None
    if any(link.get(key) != value for key, value in link_settings.items()):
        return None
    wanted = resolve(parse_train_flags(argv)).to_dict()
    ignored = ("out", "progress")  # where it was written, and a progress bar
    if any(wanted[k] != v for k, v in resolve(saved).to_dict().items() if k not in ignored):
        return None
    figures = ("process_time_s", "wire_bytes_per_worker", "load_average")
    return {**collect_run(run_dir), **{key: link.get(key) for key in figures}, "kept": True}


def run_rate(rate_mbit: float, args: argparse.Namespace, out: Path, first_port: int) -> list[dict]:
    """Every method over one freshly built link of ``rate_mbit``; one row per method."""
    rows = []
    with slow_link(args.workers, rate_mbit, args.delay_ms, prefix="mtdaoslow") as link:
        measured = measure_link_mbit(link, 0, 1) if args.workers > 1 else math.nan
        emulation = emulation_of(link)
        delay = f", {args.delay_ms:g} ms one way ({emulation})" if args.delay_ms > 0 else ""
        print(f"link {rate_mbit:g} Mbit/s{delay}: measured {measured:.1f} Mbit/s (one TCP stream)")
        for index, spec in enumerate(args.runs):
            row = {"rate_mbit": rate_mbit, "measured_mbit": measured, "method": spec.name}
            row.update(delay_ms=args.delay_ms, emulation=emulation)
            row["flags"] = spec.flags
            row.update(run_method(link, spec, args, out, first_port + index))
            rows.append(row)
            print(
                f"  {spec.name:>10}: val {row['final_val_loss']:.4f}, {row['wall_time_s']:.1f} s "
                f"({row['compute_s_per_step']:.3f} s compute + {row['comm_s_per_step']:.3f} s "
                f"comm per step), {wire_line(row['wire_bytes_per_worker'])}"
            )
    return rows


def wire_line(wire_bytes: float | None) -> str:
    if wire_bytes is None:
        return "interface bytes not recorded (a kept run)"
    return f"{format_bytes(wire_bytes)} sent per worker"


def collect_run(run_dir: Path) -> dict[str, Any]:
    """What the report needs from one run's ``results.json`` and ``metrics.jsonl``."""
    results = json.loads((run_dir / "results.json").read_text())
    steps = max(results["steps"], 1)
    compute = results["compute_s_per_worker_step"]
    return {
        "run_dir": str(run_dir),
        "steps": results["steps"],
        "tokens": results["tokens"],
        "final_val_loss": results["final_val_loss"],
        "wall_time_s": results["train_time_s"],  # below: the steps' time, evaluation excluded
        "compute_s_per_step": compute,
        "comm_s_per_step": results["train_time_s"] / steps - compute,
        "bytes_per_worker": results["bytes_per_worker"],
        "comm_reduction_vs_ddp": results["comm_reduction_vs_ddp"],
        "parameters": results["parameters"],
        "evals": [
            {"wall_time_s": e["train_time_s"], **{k: e[k] for k in ("step", "tokens", "val_loss")}}
            for e in results["evals"]
        ],
        "progress": _progress(run_dir),
    }


def _progress(run_dir: Path) -> list[tuple[int, float]]:
    """(step, train_time_s) of every metric line, for wall-clock at a given token count."""
    points = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "step" in record and "train_time_s" in record:
            points.append((record["step"], record["train_time_s"]))
    return sorted(set(points))


# -- command line -------------------------------------------------------------------------------


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "slow-link",
        help="DDP vs MT-DAO with real gloo workers across an emulated slow link (root)",
        description="DDP against local-update methods, M real gloo worker processes whose traffic "
        "crosses an emulated link (network namespaces, token-bucket shaping): measured "
        "wall-clock to DDP's final validation loss, per link rate. Needs root.",
        epilog="Exit code 0 with 'skipped: <reason>' where the link cannot be built (not root).",
    )
    add = parser.add_argument
    add("--rates", type=float, nargs="+", default=list(DEFAULT_RATES), help="link Mbit/s")
    add(
        "--methods",
        nargs="+",
        choices=METHODS,
        default=list(DEFAULT_METHODS),
        help="methods to compare with ddp (default: %(default)s)",
    )
    add("--workers", type=int, default=4, help="worker processes M (default: %(default)s)")
    add("--steps", type=int, default=320, help="steps per worker (default: %(default)s)")
    add(
        "--local-steps",
        type=int,
        help="steps of the local-update methods (default: 2 x --steps, so that a method that is "
        "worse per token can still reach DDP's final loss; its iso-token time is read mid-run)",
    )
    add(
        "--model", default="tiny", choices=MODEL_PRESETS, help="model preset (default: %(default)s)"
    )
    add("--lr", type=float, help="peak learning rate of every method (default: the harness's)")
    add_study_schedule_arguments(parser)
    add("--sync-period", type=int, default=32, help="K (default: %(default)s)")
    add("--batch-size", type=int, default=4, help="sequences per worker per step")
    add("--seq-len", type=int, default=64, help="tokens per sequence")
    add(
        "--betas", type=float, nargs="+", help="mtdao / qh-ddp momentum decays (default: harness's)"
    )
    add("--omegas", type=float, nargs="+", help="their mixing weights (default: the harness's)")
    add("--data", help="training text (default: the harness's built-in sources)")
    add("--eval-every", type=int, help="steps between evaluations (default: ~10 per run, on K)")
    add("--eval-tokens", type=int, default=8192, help="held-out tokens per evaluation")
    add("--seed", type=int, default=0, help="seed")
    add(
        "--variant",
        nargs=2,
        action="append",
        default=[],
        metavar=("NAME", "FLAGS"),
        help="an extra row: a name and `mtdao train` flags on top of the experiment's (method "
        "mtdao unless they give one), e.g. --variant overlap '--sync-delay 8 --sync-fragments 4'; "
        "repeatable",
    )
    add(
        "--delay-ms",
        type=float,
        default=0.0,
        help="one-way delay between two workers (the kernel's netem, or where it has none a "
        "userspace switch between the workers' namespaces)",
    )
    add("--timeout", type=float, default=1800.0, help="seconds one run may take")
    add(
        "--keep-finished",
        action="store_true",
        help="keep a run already finished in --out with the same training and link settings "
        "instead of training it again (a long study resumed)",
    )
    add("--out", default="runs/slow-link", help="output directory (default: %(default)s)")
    parser.set_defaults(func=run_slow_link)


def environment() -> dict[str, Any]:
    """Where the rows are measured: the torch version and the machine's CPU cores."""
    import torch

    return {"torch": torch.__version__, "cores": os.cpu_count()}


def run_slow_link(args: argparse.Namespace) -> int:
    args.runs = run_specs(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    try:
        for index, rate in enumerate(args.rates):
            rows += run_rate(rate, args, out, FIRST_PORT + 10 * index)
    except LinkUnavailable as error:
        print(f"skipped: {error}")
        return 0
    rows = compare_to_ddp(rows)
    measured = {"command": typed_command("slow-link"), "workers": args.workers, **environment()}
    report = write_report(out, stamped(KIND, SCHEMA, {**measured, "rows": rows}), render)
    plots = [plot_time_to_loss(out, rows), plot_time_to_target(out, rows)]
    print(report_table(rows))
    print(f"report: {report}  plots: {' '.join(map(str, plots))}  rows: {out / 'results.json'}")
    return 0
