"""The GPU campaign: what mtdao needs measured or checked on a GPU, in one run of at most nine
minutes on one H200, written to one report (``report.md`` and ``results.json``).

On the device machine, in the repository root (torch there is a CUDA build; mtdao is not
installed, so the script puts ``src`` on PYTHONPATH for itself and for every ``python -m mtdao``
it starts)::

    PYTHONUNBUFFERED=1 PYTHONPATH=src python benchmarks/gpu_campaign.py --out "$OUT"

(a ``run`` call with ``timeout_s=600``: the campaign stops itself by ``--budget-s``, 540 s), then
copy ``$OUT/report.md`` and ``$OUT/results.json`` to ``reports/gpu/``. Without ``--out`` it writes
to ``reports/gpu/``. It prints the torch and CUDA versions first.

The parts, in this order, each in a process of its own with its time budget (a share of
``--budget-s``; the paper's 16M runs take what is left):

1. ``environment``: Python, torch, CUDA, NCCL, the GPU, the packages mtdao uses;
2. ``exactness``: the flat-buffer step (``flat=True``, the CUDA default) of MTAdam, MTAdopt and
   MTSGD, N = 1..3, compiled and foreach kernels, float32 and bf16 parameters, against the literal
   reference in float64 and against the per-tensor path;
3. ``optimizer_step``: the step table, 25M parameters in 100 tensors and 1B in 200, float32
   states: every optimizer and N on its default path, the per-tensor foreach path of before, the
   flat path with foreach kernels, and torch's ``AdamW(fused=True)`` and ``AdamW(foreach=True)``;
   ratios, bandwidth against the H200's 4.8 TB/s, and the flat step split into its gather of the
   gradients and its kernel (:mod:`benchmarks.optimizer_step`'s machinery);
4. ``train``: ``mtdao train --device cuda`` for every method, 40 steps each (bf16 autocast, the
   default on a GPU; MT-DAO also in float32): finite losses;
5. ``vmapped_workers``: the simulator's vmapped workers' gradients against each worker's alone
   (:mod:`benchmarks.gpu_sharded_check`);
6. ``sharded``: FSDP2 on one GPU, a 1 x 1 mesh (``gpu_sharded_check``'s ``fsdp-cuda``), and
   ``--workers 1 --shards 2`` under torchrun where there are two GPUs;
7. ``torchrun``: ``mtdao train`` as a one-process NCCL torchrun job;
8. ``paper_16m``: ``mtdao compare --preset paper-16m`` (DDP, Local ADOPT, MT-DAO-ADOPT at the
   paper's 16M shape, K = 32, 4 simulated workers) at as many steps as the time left allows: a
   calibration run measures the time a step takes, then the steps are chosen so the three runs fit.

A part that fails or runs out of time is reported with its error and the end of its log, and the
next part runs. ``report.md`` and ``results.json`` are rewritten after each part and every few
seconds while one runs, so a campaign killed at any point leaves what it measured.

    python benchmarks/gpu_campaign.py --dry-run      # every part at toy size on the CPU (< 2 min)
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from gpu_campaign_parts import (
    PARTS,
    REPO,
    PartContext,
    kill_session,
    log_tail,
    python_env,
    write_json,
)
from gpu_campaign_report import render_report

KIND = "gpu-campaign"
SCHEMA = 1
BUDGET_S = 540.0  # nine minutes: a device call may run ten
REFRESH_S = 5.0  # the report is rewritten this often while a part runs
FINISH_S = 5.0  # kept back at the end for the last report


@dataclass(frozen=True)
class PartPlan:
    name: str
    share_s: float | None  # its budget at the default --budget-s (scaled with it); None: the rest
    minimum_s: float  # not started with less


PLAN = [
    PartPlan("environment", 30, 10),
    PartPlan("exactness", 60, 15),
    PartPlan("optimizer_step", 115, 30),
    PartPlan("train", 75, 20),
    PartPlan("vmapped_workers", 40, 10),
    PartPlan("sharded", 60, 15),
    PartPlan("torchrun", 60, 15),
    PartPlan("paper_16m", None, 60),
]
assert [p.name for p in PLAN] == list(PARTS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        help="where report.md and results.json go "
        "(default: reports/gpu, or a new temporary folder with --dry-run)",
    )
    parser.add_argument("--dry-run", action="store_true", help="every part at toy size on the CPU")
    parser.add_argument(
        "--budget-s", type=float, default=BUDGET_S, help="the whole campaign's time"
    )
    parser.add_argument("--data", help="training text for the runs (default: mtdao's built-in)")
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), help="only these parts")
    # a part, as the campaign runs it in a process of its own
    parser.add_argument("--run-part", choices=list(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--part-budget-s", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--record", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_part:
        return run_part(args)
    return run_campaign(args)


def run_part(args) -> int:
    ctx = PartContext(args.run_part, args.record, args.part_budget_s, args)
    ctx.flush()
    try:
        PARTS[args.run_part](ctx)
    except Exception as error:
        ctx.data["error"] = f"{type(error).__name__}: {error}"[:2000]
        ctx.data["traceback"] = traceback.format_exc()[-4000:]
        ctx.flush()
        print(ctx.data["traceback"], flush=True)
        return 1
    return 0


def run_campaign(args) -> int:
    if args.out is None:
        args.out = (
            Path(tempfile.mkdtemp(prefix="gpu-campaign-"))
            if args.dry_run
            else REPO / "reports" / "gpu"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="gpu-campaign-scratch-"))
    started = time.monotonic()
    deadline = started + args.budget_s
    scale = args.budget_s / BUDGET_S
    results = {
        "kind": KIND,
        "schema": SCHEMA,
        "dry_run": args.dry_run,
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "budget_s": args.budget_s,
        "elapsed_s": 0.0,
        "finished": False,
        "scratch": str(scratch),
        "parts": {},
    }

    def save() -> None:
        results["elapsed_s"] = round(time.monotonic() - started, 1)
        write_json(args.out / "results.json", results)
        (args.out / "report.md").write_text(render_report(results))

    print(
        f"GPU campaign{' (dry run)' if args.dry_run else ''}: {args.out}, {args.budget_s:.0f} s",
        flush=True,
    )
    no_device = None
    for index, part in enumerate(PLAN):
        entry = results["parts"].setdefault(part.name, {"status": "pending"})
        if args.parts and part.name not in args.parts:
            entry.update(status="skipped", note="not asked for (--parts)")
            continue
        left = deadline - time.monotonic() - FINISH_S
        later = sum(
            p.minimum_s * scale for p in PLAN[index + 1 :] if not args.parts or p.name in args.parts
        )
        budget = left if part.share_s is None else min(part.share_s * scale, left - later)
        if no_device:
            entry.update(status="skipped", note=no_device)
        elif budget < part.minimum_s * scale:
            entry.update(
                status="skipped", note=f"out of time ({max(0.0, budget):.0f} s left for it)"
            )
        else:
            run_one(part.name, budget, args, scratch, entry, save)
        save()
        if part.name == "environment":
            environment = entry.get("data", {}).get("environment", {})
            print(
                f"torch {environment.get('torch')}, CUDA {environment.get('cuda')}, "
                f"GPU {environment.get('gpu', 'none')}",
                flush=True,
            )
            if entry["status"] != "ok" and not args.dry_run:
                no_device = f"the environment part failed: {entry.get('note', '')}"
    results["finished"] = True
    save()
    for name, entry in results["parts"].items():
        print(
            f"{name:16s} {entry['status']:9s} {entry.get('seconds', 0):6.1f} s  {entry.get('note', '')}",
            flush=True,
        )
    print(f"report: {args.out / 'report.md'}", flush=True)
    return 0 if all(e["status"] in ("ok", "skipped") for e in results["parts"].values()) else 1


def run_one(name: str, budget: float, args, scratch: Path, entry: dict, save) -> None:
    """Run part ``name`` in a process of its own, killed at ``budget`` seconds; its record goes
    into ``entry`` as it comes (``save`` writes the report)."""
    record, log = scratch / f"{name}.json", scratch / f"{name}.log"
    command = [sys.executable, str(Path(__file__).resolve()), "--run-part", name]
    command += ["--part-budget-s", f"{max(1.0, budget - 3):.1f}", "--record", str(record)]
    command += ["--scratch", str(scratch)]
    if args.dry_run:
        command.append("--dry-run")
    if args.data:
        command += ["--data", args.data]
    entry.update(status="running", budget_s=round(budget, 1))
    print(f"{name}: up to {budget:.0f} s", flush=True)
    started = time.monotonic()
    with open(log, "w") as output:
        process = subprocess.Popen(
            command,
            stdout=output,
            stderr=subprocess.STDOUT,
            env=python_env(),
            cwd=REPO,
            start_new_session=True,
        )
        timed_out, last_save = False, started
        while process.poll() is None:
            time.sleep(0.5)
            now = time.monotonic()
            if now - started > budget:
                kill_session(process)
                timed_out = True
                break
            if now - last_save > REFRESH_S:
                entry.update(data=read_record(record), seconds=round(now - started, 1))
                save()
                last_save = now
    entry["seconds"] = round(time.monotonic() - started, 1)
    entry["data"] = read_record(record)
    error = entry["data"].pop("error", None)
    entry["data"].pop("traceback", None)
    if timed_out:
        entry.update(status="timed out", note=f"stopped at its budget, {budget:.0f} s")
    elif error:
        entry.update(status="failed", note=error)
    elif process.returncode != 0:
        entry.update(status="failed", note=f"exit code {process.returncode}")
    else:
        entry["status"] = "ok"
    if entry["status"] != "ok":
        entry["log_tail"] = log_tail(log, 3000)


def read_record(record: Path) -> dict:
    try:
        return json.loads(record.read_text())
    except (OSError, ValueError):
        return {}


if __name__ == "__main__":
    sys.exit(main())
