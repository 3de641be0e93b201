"""``mtdao wan-drill``: a fault-tolerant run across emulated WAN sites that fail, and checks.

The lighthouse and each replica run in a network namespace of their own (:mod:`mtdao.testing.network.sites`),
every site on a shaped link; a scenario (:mod:`mtdao.testing.network.scenario`) kills and restarts replicas,
partitions a site, slows a link, makes a straggler and restarts the lighthouse at set times.
Then the drill checks (:mod:`.checks`) and exits 1 if one fails: no replica hung, every
replica finished with the same model, no metric or checkpoint lost, and the final loss within
the run-to-run spread of drills without events (``--baseline-seeds``, or ``--baseline`` records
of earlier ones). ``--ddp`` adds DDP over the same links for the loss-against-time plot.

Without root or namespaces it prints ``skipped: <reason>`` and exits 0, like ``mtdao
slow-link``. Every process of the drill runs with one thread, so the two cores of a small
machine measure the links rather than a CPU oversubscribed by thread pools.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

from mtdao.experiments.common.results import stamped, write_report
from mtdao.experiments.common.study_flags import typed_command
from mtdao.experiments.wan_drill.checks import mean_final_loss, run_checks
from mtdao.experiments.wan_drill.drill import DrillSettings, run_drill
from mtdao.experiments.wan_drill.report import (
    KIND,
    SCHEMA,
    baseline_summary,
    plot_bytes,
    plot_loss,
    plot_timeline,
    render,
)
from mtdao.flags import DefaultsHelpFormatter
from mtdao.testing.network.netem import LinkUnavailable
from mtdao.testing.network.scenario import Scenario, load_scenario
from mtdao.testing.network.sites import WanSites, cleanup_stale, exit_on_sigterm
from mtdao.testing.network.straggler import cleanup_stale_cgroups

PREFIX = "mtdaowan"
DDP_PORT = 29500  # inside the DDP workers' own namespaces


SETTING_HELP = {
    "replicas": "fault-tolerant replicas, one site each",
    "model": "model preset",
    "steps": "steps per replica (a multiple of --sync-period)",
    "sync_period": "K, steps between rounds",
    "batch_size": "sequences per replica per step",
    "seq_len": "tokens per sequence",
    "eval_tokens": "held-out tokens per evaluation",
    "seed": "seed of the drill with events",
    "data": "training text (default: the harness's built-in sources)",
    "checkpoint_every": "steps between a replica's checkpoints (a restart resumes from one)",
    "heartbeat_timeout_s": "lighthouse: seconds of silence after which a replica is dead",
    "join_timeout_s": "lighthouse: seconds a new quorum waits for live replicas to join",
    "connect_timeout_s": "replica: seconds to reach the lighthouse",
    "quorum_timeout_s": "replica: seconds to wait for a quorum",
    "collective_timeout_s": "replica: seconds an all-reduce or a heal may take",
    "hang_limit_s": "a live replica whose step stays put this long is a hang (a failure)",
    "start_timeout_s": "seconds the replicas may take to take their first step",
    "deadline_s": "seconds one drill (or the DDP run) may take in all",
}


def run_ddp(scenario: Scenario, settings: DrillSettings, out: Path, prefix: str) -> dict:
    """DDP over the same links, one gloo worker per replica site; rank 0's results."""
    from mtdao.experiments.slow_link.workers import worker_env

    names = [f"r{i}" for i in range(settings.replicas)]
    sites = WanSites(
        {n: scenario.link(n) for n in names}, prefix, settings.emulation, settings.seed
    )
    run_dir = out / "ddp"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    argv = [sys.executable, "-m", "mtdao", "train", "--method", "ddp", "--out", str(run_dir)]
    argv += [a for a in settings.train_flags() if a != "--no-progress"] + ["--no-progress"]
    try:
        sites.build()
        processes = []
        for rank, site in enumerate(names):
            env = worker_env(rank, len(names), sites.addresses["r0"], DDP_PORT)
            log = open(out / f"ddp-rank{rank}.log", "w")  # noqa: SIM115 (closed below)
            processes.append(sites.run(site, argv, env=env, stdout=log, stderr=subprocess.STDOUT))
            log.close()
        deadline = time.time() + settings.deadline_s
        while any(p.poll() is None for p in processes) and time.time() < deadline:
            time.sleep(0.5)
        codes = [p.poll() for p in processes]
    finally:
        sites.close()
    if None in codes:
        raise RuntimeError(f"DDP over the links did not finish within --deadline "
                           f"{settings.deadline_s:g} s (exit codes {codes})")  # fmt: skip
    if codes != [0] * len(codes):
        tail = (out / "ddp-rank0.log").read_text(errors="replace").splitlines()[-5:]
        raise RuntimeError(f"DDP over the links failed (exit codes {codes}): " + " | ".join(tail))
    results = json.loads((run_dir / "results.json").read_text())
    evals = [{"wall_time_s": e["train_time_s"], "val_loss": e["val_loss"], "step": e["step"]}
             for e in results["evals"]]  # fmt: skip
    return {"steps": results["steps"], "final_val_loss": results["final_val_loss"],
            "train_time_s": results["train_time_s"], "evals": evals}  # fmt: skip


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "wan-drill",
        help="fault-tolerant replicas across emulated WAN sites that fail, checked (root)",
        description=re.sub(r":mod:`[^`]*`|``", "", __doc__.split("\n\n")[1]).replace(" ()", ""),
        formatter_class=DefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--scenario", default="default",
        help="the events: default (each event once; full is another name for it), none, or a "
        "JSON/YAML file")  # fmt: skip
    defaults = DrillSettings()
    for field in fields(DrillSettings):
        if field.name == "emulation":
            continue
        flag = "--" + field.name.removesuffix("_s").replace("_", "-")
        kind = type(getattr(defaults, field.name)) if field.name != "data" else str
        add(flag, dest=field.name, type=kind, default=getattr(defaults, field.name),
            help=SETTING_HELP[field.name])  # fmt: skip
    add("--emulation", choices=("auto", "netem", "relay"), default="auto",
        help="how delay, jitter, loss and partitions are made (auto: netem where the kernel has it)")  # fmt: skip
    add("--baseline-seeds", type=int, nargs="*", default=[0, 1],
        help="seeds of the drills without events whose spread the final loss is held to "
        "(none: no loss check)")  # fmt: skip
    add(
        "--baseline",
        nargs="*",
        default=[],
        help="drill.json files of earlier drills without events, used instead of running them",
    )
    add("--loss-slack", type=float, default=1.0,
        help="the loss band is the no-event range widened by this many times its width")  # fmt: skip
    add("--ddp", action="store_true", help="also run DDP over the same links (for the plot)")
    add("--replica-flags", default="",
        help="extra `mtdao train` flags of every replica (after the drill's own: each replica "
        "binds its site's address and gets the drill's secret); {site}, {address} and {hostname} "
        "are replaced by the replica's own, e.g. '--sync-delay 2 --sync-fragments 4'")  # fmt: skip
    add("--lighthouse-flags", default="", help="extra `mtdao lighthouse` flags (same replacements)")
    add("--out", default="runs/wan-drill", help="output directory")
    add("--prefix", default=PREFIX, help="name prefix of the namespaces and CPU groups")
    parser.set_defaults(func=run_wan_drill)


def settings_from_args(args: argparse.Namespace) -> DrillSettings:
    return DrillSettings(**{f.name: getattr(args, f.name) for f in fields(DrillSettings)})


def run_wan_drill(args: argparse.Namespace) -> int:
    with exit_on_sigterm():  # every phase tears its sites down on SIGTERM
        return _run_wan_drill(args)


def _run_wan_drill(args: argparse.Namespace) -> int:
    scenario = load_scenario(args.scenario)
    scenario = replace(
        scenario,
        replica_flags=scenario.replica_flags + tuple(shlex.split(args.replica_flags)),
        lighthouse_flags=scenario.lighthouse_flags + tuple(shlex.split(args.lighthouse_flags)),
    )
    settings = settings_from_args(args)
    scenario.check_sites(settings.replicas)
    if settings.steps % settings.sync_period:
        raise ValueError(f"--steps {settings.steps} must be a multiple of --sync-period "
                         f"{settings.sync_period}: the drill compares states after the last round")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        stale = cleanup_stale(args.prefix) + cleanup_stale_cgroups(args.prefix)
    except LinkUnavailable as error:
        print(f"skipped: {error}")
        return 0
    if stale:
        print(f"removed leftovers of an earlier drill: {', '.join(stale)}")
    try:
        baselines = [json.loads(Path(p).read_text()) for p in args.baseline]
        for seed in [] if args.baseline else args.baseline_seeds:
            none = Scenario("none", links=scenario.links, replica_flags=scenario.replica_flags,
                            lighthouse_flags=scenario.lighthouse_flags)  # fmt: skip
            print(f"drill without events, seed {seed} ...", flush=True)
            base = run_drill(
                none, replace(settings, seed=seed), out / f"baseline-{seed}", args.prefix
            )
            baselines.append(base)
        print(f"drill, scenario {scenario.name} ...", flush=True)
        record = run_drill(scenario, settings, out / "drill", args.prefix)
        ddp = run_ddp(scenario, settings, out, args.prefix) if args.ddp else None
    except LinkUnavailable as error:
        print(f"skipped: {error}")
        return 0
    losses = [x for x in map(mean_final_loss, baselines) if x is not None]
    want_loss = bool(args.baseline or args.baseline_seeds)
    checks = run_checks(record, losses if want_loss else None, args.loss_slack)
    write_outputs(out, record, checks, baselines, ddp, typed_command("wan-drill"))
    for check in checks:
        print(f"{'pass' if check.passed else 'FAIL'}  {check.name}: {check.detail}")
    print(f"report: {out / 'report.md'}")
    return 0 if all(check.passed for check in checks) else 1


def write_outputs(out: Path, record, checks, baselines, ddp, command: str) -> None:
    """``results.json`` (everything the report is drawn from), the plots and ``report.md``."""
    summaries = [baseline_summary(b) for b in baselines]
    content = {"command": command, "checks": [vars(c) for c in checks], "baselines": summaries}
    write_report(out, stamped(KIND, SCHEMA, {**content, "ddp": ddp, "record": record}), render)
    plot_timeline(out, record)
    plot_loss(out, record, summaries, ddp)
    plot_bytes(out, record)
