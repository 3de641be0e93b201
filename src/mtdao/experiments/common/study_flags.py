"""The flags the experiment commands share (model size, budget, seeds, LR pins), and the
``TrainConfig`` every run of a study starts from."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from mtdao.experiments.common.suite import RUNS_DIR
from mtdao.methods.optimizers import BASE_OPTIMIZERS
from mtdao.model.presets import MODEL_PRESETS
from mtdao.train.config import DATA_SPLITS, SCHEDULES, TextSettings, TrainConfig, describe_default

MIN_EVAL_EVERY = 10
# the study commands' LR warm-up: mtdao train's default until 2026-12-04, as their reports ran
STUDY_WARMUP = 0.05


def add_study_schedule_arguments(parser: argparse.ArgumentParser) -> None:
    """``--schedule`` and ``--warmup`` of a study command: the defaults its reports ran under
    (cosine, 5% of --steps), not ``mtdao train``'s of today."""
    parser.add_argument(
        "--schedule",
        default="cosine",
        choices=SCHEDULES,
        help="LR schedule (default: cosine, as the studies ran; mtdao train's default is wsd)",
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=STUDY_WARMUP,
        help=f"LR warm-up as a fraction of --steps (default: {STUDY_WARMUP:g}, as the studies ran; "
        "mtdao train's default is a number of steps)",
    )


def add_budget_arguments(
    parser: argparse.ArgumentParser, *, out: str, seeds: list[int], steps: int = 1000
) -> None:
    """Model, data and budget flags of ``mtdao compare`` and ``mtdao frontier``."""
    add = parser.add_argument
    add("--model", default="micro", choices=MODEL_PRESETS, help="model preset (default: micro)")
    add("--optimizer", default="adam", choices=BASE_OPTIMIZERS, help="base optimizer (adam)")
    add("--workers", type=int, default=4, help="workers M (default: 4)")
    add("--steps", type=int, default=steps, help=f"optimizer steps per worker (default: {steps})")
    add("--batch-size", type=int, default=16, help="sequences per worker per step (default: 16)")
    add("--seq-len", type=int, default=64, help="tokens per sequence (default: 64)")
    add(
        "--eval-every",
        type=int,
        help=f"steps between evaluations (default: steps / 30, at least {MIN_EVAL_EVERY})",
    )
    add("--eval-tokens", type=int, default=32768, help="held-out tokens per eval (default: 32768)")
    add("--data", help="text file/dir or hf:NAME[:CONFIG] (default: built-in sources)")
    add("--tokenizer", default="byte", help="byte | bpe:VOCAB | hf:NAME (default: byte)")
    add(
        "--data-split",
        default=TextSettings.data_split,
        choices=DATA_SPLITS,
        help=f"worker shards (default: {TextSettings.data_split}; contiguous: the split of "
        "figures before 2026-12-02)",
    )
    add_study_schedule_arguments(parser)
    add(
        "--seeds",
        type=int,
        nargs="+",
        default=seeds,
        help=f"seeds (default: {' '.join(map(str, seeds))})",
    )
    add(
        "--lr",
        nargs="+",
        default=[],
        metavar="[METHOD=]VALUE",
        help="pin learning rates: METHOD=VALUE per method, or a bare VALUE for every method "
        f"(default: each method's own: {describe_default('lr')})",
    )
    add("--jobs", type=int, default=1, help="runs trained at once in subprocesses (default: 1)")
    add(
        "--threads",
        type=int,
        help="torch threads per run (default: $OMP_NUM_THREADS when set, else cores // jobs; 1 "
        "is often fastest for tiny models on a busy machine)",
    )
    add("--out", default=out, help=f"output directory (default: {out})")
    parser.set_defaults(on_interrupt=interrupted_suite)


def interrupted_suite(args: argparse.Namespace, argv: list[str]) -> str:
    """What to say after Ctrl-C: what is kept, and that the same command continues."""
    command = shlex.join(["mtdao", *argv])
    return (
        f"mtdao {args.command}: interrupted; the finished runs in {Path(args.out) / RUNS_DIR} are "
        f"kept (an unfinished one resumes from its last checkpoint); continue with: {command}"
    )


def typed_command(name: str, leave_out: Sequence[str] = ()) -> str:
    """The ``mtdao NAME ...`` command line this process was started with, less ``leave_out``: what
    a report names to rerun its study; ``mtdao NAME`` when the study was called otherwise."""
    argv = [arg for arg in sys.argv[1:] if arg not in leave_out]
    return shlex.join(["mtdao", *argv]) if argv[:1] == [name] else f"mtdao {name}"


def default_eval_every(steps: int) -> int:
    """About 30 evaluations per run, but none more often than every MIN_EVAL_EVERY steps: a short
    smoke run would otherwise spend a third of its time evaluating after every step."""
    return max(MIN_EVAL_EVERY, steps // 30)


def base_config(args: argparse.Namespace, seed: int) -> TrainConfig:
    """The TrainConfig every run of an experiment shares before its method's own settings."""
    return TrainConfig.of(
        optimizer=args.optimizer,
        workers=args.workers,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        model=args.model,
        data=args.data,
        tokenizer=args.tokenizer,
        data_split=args.data_split,
        schedule=args.schedule,
        warmup=args.warmup,
        eval_every=args.eval_every or default_eval_every(args.steps),
        eval_tokens=args.eval_tokens,
        seed=seed,
        progress=False,
    )


def parse_lr_pins(values: Sequence[str], methods: Sequence[str]) -> dict[str, float]:
    """``["mtdao=8e-3", "4e-3"]`` -> per-method LRs; a bare value applies to every method."""
    pins: dict[str, float] = {}
    # bare values first, so that METHOD=VALUE wins whatever the order on the command line
    for value in sorted(values, key=lambda v: "=" in v):
        method, _, number = value.rpartition("=")
        try:
            lr = float(number)
        except ValueError:
            raise ValueError(f"--lr: {value!r} is not METHOD=VALUE or VALUE") from None
        if not lr > 0:
            raise ValueError(f"--lr: {value!r}: the learning rate must be > 0")
        if method and method not in methods:
            raise ValueError(f"--lr: unknown method {method!r}; this run has {', '.join(methods)}")
        for name in [method] if method else methods:
            pins[name] = lr
    return pins
