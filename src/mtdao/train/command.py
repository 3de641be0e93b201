"""``mtdao train``: one flag per :class:`~mtdao.train.config.TrainConfig` field, generated."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from mtdao.flags import add_dataclass_arguments, dataclass_from_args, dataclass_to_argv
from mtdao.methods.table import METHOD_TABLE
from mtdao.train.config import OPTIMIZER_DEFAULTS, ParallelSettings, TrainConfig, describe_default

SUMMARY_KEYS = (
    "method",
    "steps",
    "tokens",
    "final_val_loss",
    "val_ppl",
    "comm_reduction_vs_ddp",
    "comm_reduction_steady_state",
    "wall_time_s",
)

EXAMPLES = """
examples:
  mtdao train                                   # MT-DAO, 4 simulated workers, built-in data
  mtdao train --method ddp --steps 600 --out runs/ddp
  torchrun --nproc-per-node 4 -m mtdao train --workers 4 --method mtdao
  mtdao train --out runs/x --resume             # continue a stopped run exactly
  mtdao train --out runs/x --resume --steps 2400 --extend   # re-plan it for more steps
  torchrun --nproc-per-node 4 --max-restarts 3 -m mtdao train --workers 4 --resume
                                                # a restart resumes from the newest checkpoint
  mtdao train --fault-tolerant --resume --workers 3 --replica-id 0 --lighthouse HOST:29510
                                                # one replica of a run that survives failures
                                                # (the same command line restarts it)
"""


def epilog() -> str:
    """The method table and the per-optimizer defaults, from the tables that define them."""
    lines = ["methods:"]
    lines += [f"  {name:<11} {spec.summary}" for name, spec in METHOD_TABLE.items()]
    lines += ["", "defaults per base optimizer (mtdao and qh-ddp use the slow betas/omegas, and"]
    lines += ["the beta ramp C, slow decay <= 1 - C / step, unless --betas is given):"]
    header = ("", "lr", "betas", "slow betas", "omegas", "beta2", "eps", "beta ramp")
    widths = (6, 6, 6, 11, 7, 7, 6, 10)
    lines.append("  " + " ".join(f"{h:>{w}}" for h, w in zip(header, widths)).rstrip())
    for name, row in OPTIMIZER_DEFAULTS.items():
        values = (row.lr, row.betas, row.mtdao_betas, row.mtdao_omegas, row.beta2, row.eps)
        values += (row.mtdao_beta_ramp,)
        cells = ["-" if v is None else " ".join(f"{x:g}" for x in _tuple(v)) for v in values]
        lines.append(f"  {name:<6} " + " ".join(f"{c:>{w}}" for c, w in zip(cells, widths[1:])))
    return "\n".join(lines) + "\n" + EXAMPLES


def _tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="pre-train a language model with any method (simulated or torchrun workers)",
        description="Pre-train a Llama-style language model with a local-update method.",
        epilog=epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_dataclass_arguments(parser, TrainConfig, describe_default)
    # None: --workers not given, taken from torchrun's processes (see default_workers)
    parser.set_defaults(func=run_train, on_interrupt=interrupted_train, workers=None)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The config the flags describe, as given (unresolved: see config.resolve)."""
    values = vars(args).copy()
    if values.get("workers") is None:
        values["workers"] = default_workers(values["shards"], values["fault_tolerant"])
    return dataclass_from_args(TrainConfig, argparse.Namespace(**values))


def default_workers(shards: int, fault_tolerant: bool) -> int:
    """--workers when not given: under torchrun, its processes / --shards (when they divide);
    otherwise TrainConfig's default. A fault-tolerant replica's processes are one worker of
    many, so it keeps the default."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not fault_tolerant and shards >= 1 and world_size % shards == 0:
        return world_size // shards
    return ParallelSettings.workers


def config_to_argv(config: TrainConfig) -> list[str]:
    """``mtdao train`` flags that rebuild ``config`` exactly: the inverse of the train parser."""
    return dataclass_to_argv(config, describe_default)


def config_from_argv(argv: list[str]) -> TrainConfig:
    """The config ``mtdao train`` flags describe (unresolved), parsed as the command does."""
    parser = argparse.ArgumentParser(prog="mtdao", exit_on_error=False)
    add_parser(parser.add_subparsers())
    return config_from_args(parser.parse_args(["train", *argv]))


def run_train(args: argparse.Namespace) -> int:
    from mtdao.train.distributed import leave_process_group
    from mtdao.train.launch import train
    from mtdao.train.results import traffic_line
    from mtdao.train.threads import one_thread_if_busy
    from mtdao.train.trainer import say

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and (note := one_thread_if_busy()):
        say(note)  # torchrun sets OMP_NUM_THREADS itself
    try:
        results = train(config_from_args(args))
    finally:
        leave_process_group()
    # one summary per job: under torchrun only rank 0 prints it
    if int(os.environ.get("RANK", "0")) == 0:
        out = results["config"]["out"]
        print(json.dumps({k: results[k] for k in SUMMARY_KEYS}), file=sys.stdout)
        where = f"results: {out}/results.json"
        if (Path(out) / "loss.png").is_file():
            where += f"  plot: {out}/loss.png"
        where += f"  metrics: {out}/metrics.jsonl"
        if (Path(out) / "tensorboard").is_dir():
            where += f"  tensorboard: {out}/tensorboard"
        print(where)
        print(traffic_line(results))
    return 0


def interrupted_train(args: argparse.Namespace, argv: list[str]) -> str | None:
    """What to say after Ctrl-C: the newest checkpoint and the command that continues the run
    (``argv``: this command's arguments). None on processes other than rank 0 of a job."""
    from mtdao.train.checkpoint.index import latest_checkpoint
    from mtdao.train.config import resolve

    if int(os.environ.get("RANK", "0")) != 0:
        return None
    try:
        config = resolve(config_from_args(args))
    except ValueError:  # a config that never started: nothing to continue
        return "mtdao train: interrupted"
    run_dir = Path(config.job.out)
    words = [word for word in argv if word != "--overwrite"]  # --resume keeps what is there
    words += [] if "--resume" in words else ["--resume"]
    command = shlex.join(["mtdao", *words])
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        command = f"the same torchrun command with -m {command}"
    latest = latest_checkpoint(run_dir)
    if latest is None:
        saved = f"no checkpoint in {run_dir} yet (--checkpoint-every N saves them)"
        return f"mtdao train: interrupted; {saved}; start it again with: {command}"
    where = f"{latest.path} (step {latest.step} of {config.training.steps})"
    return f"mtdao train: interrupted; last checkpoint: {where}; continue with: {command}"
