"""``mtdao train``: flags map one to one onto :class:`mtdao.train.config.TrainConfig` fields."""

from __future__ import annotations

import argparse
import json
import os
import sys

from mtdao.model.presets import MODEL_PRESETS
from mtdao.sync.methods import BASE_OPTIMIZERS, METHODS, SYNC_POLICIES
from mtdao.train.config import DEFAULT_LR, DEVICES, NON_FINITE_ACTIONS, SCHEDULES, TrainConfig

EPILOG = """
method defaults (override any of them with flags):
  ddp         Adam/ADOPT/SGDM, betas 0.9, gradients averaged every step
  qh-ddp      MT-DAO optimizer, gradients averaged every step
  local-adam  base optimizer, parameters and all states averaged every K
  diloco      base optimizer local; every K a Nesterov outer step (lr 0.7, momentum 0.9)
  desloc      base optimizer; params every K, momenta every 3K, second moment every 6K
  mtdao       MT-DAO optimizer (adam: beta 0.95, omega 0.7; adopt: 0.999, 0.9), unified periods

examples:
  mtdao train                                   # MT-DAO, 4 simulated workers, built-in data
  mtdao train --method ddp --steps 600 --out runs/ddp
  torchrun --nproc-per-node 4 -m mtdao train --workers 4 --method mtdao
"""


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="pre-train a language model with any method (simulated or torchrun workers)",
        description="Pre-train a Llama-style language model with a local-update method.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = TrainConfig()
    add = parser.add_argument
    add("--method", default=defaults.method, choices=METHODS, help="method (default: %(default)s)")
    add("--optimizer", default=defaults.optimizer, choices=BASE_OPTIMIZERS, help="base optimizer")
    add("--workers", type=int, default=defaults.workers, help="workers M (default: %(default)s)")
    add("--sync-period", type=int, default=defaults.sync_period, help="K (default: %(default)s)")
    add("--sync-policy", choices=SYNC_POLICIES, help="period rule for the states of local methods")
    add(
        "--state-sync-period",
        type=int,
        help="average every optimizer state every N steps, whatever the period rule",
    )
    add("--betas", type=float, nargs="+", help="first-momentum decays, e.g. --betas 0.9 0.99")
    add("--omegas", type=float, nargs="+", help="their mixing weights (raw gradient: 1 - sum)")
    add("--beta2", type=float, help="second-moment decay (adam 0.95, adopt 0.9999)")
    add("--eps", type=float, help="denominator epsilon")
    lrs = ", ".join(f"{k} {v:g}" for k, v in DEFAULT_LR.items())
    add("--lr", type=float, help=f"peak learning rate (default: {lrs})")
    add("--weight-decay", type=float, default=defaults.weight_decay, help="decoupled weight decay")
    add(
        "--omega-warmup",
        type=float,
        default=defaults.omega_warmup,
        help="fraction of the run ramping omegas from 0",
    )
    add("--outer-lr", type=float, default=defaults.outer_lr, help="diloco outer learning rate")
    add(
        "--outer-momentum",
        type=float,
        default=defaults.outer_momentum,
        help="diloco outer momentum",
    )
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, help="optimizer steps per worker (default: 1200)")
    budget.add_argument("--tokens", type=int, help="total training tokens over all workers")
    add("--batch-size", type=int, default=defaults.batch_size, help="sequences per worker per step")
    add("--seq-len", type=int, default=defaults.seq_len, help="tokens per sequence")
    add("--model", default=defaults.model, choices=MODEL_PRESETS, help="model preset")
    add(
        "--data", help="text file, directory of text files, or hf:NAME[:CONFIG] (default: built-in)"
    )
    add("--tokenizer", default=defaults.tokenizer, help="byte | bpe:VOCAB | hf:NAME")
    add(
        "--data-split",
        default=defaults.data_split,
        choices=("iid", "by-file"),
        help="worker shards",
    )
    add("--schedule", default=defaults.schedule, choices=SCHEDULES, help="LR schedule after warmup")
    add("--warmup", type=float, default=defaults.warmup, help="warmup fraction of the steps")
    add(
        "--decay-fraction",
        type=float,
        default=defaults.decay_fraction,
        help="wsd: decaying fraction",
    )
    add("--min-lr-ratio", type=float, default=defaults.min_lr_ratio, help="final LR / peak LR")
    add("--grad-clip", type=float, default=defaults.grad_clip, help="per-worker gradient norm clip")
    add("--eval-every", type=int, help="steps between evaluations (default: 10 per run)")
    add(
        "--eval-tokens",
        type=int,
        default=defaults.eval_tokens,
        help="held-out tokens per evaluation",
    )
    add("--log-every", type=int, default=defaults.log_every, help="steps between metric lines")
    add("--checkpoint-every", type=int, help="steps between checkpoints (default: end only)")
    add("--seed", type=int, default=defaults.seed, help="seed (default: %(default)s)")
    add("--out", help="run directory (default: runs/<method>-<optimizer>-M<M>-K<K>-seed<seed>)")
    add("--resume", action="store_true", help="continue the run in --out up to --steps")
    add("--device", default=defaults.device, choices=DEVICES, help="auto | cpu | cuda")
    add("--no-bf16", dest="bf16", action="store_false", help="no bf16 autocast on GPU")
    add(
        "--on-non-finite",
        default=defaults.on_non_finite,
        choices=NON_FINITE_ACTIONS,
        help="NaN/inf in a worker at a sync: stop, or leave the worker out",
    )
    add(
        "--no-alignment",
        dest="track_alignment",
        action="store_false",
        help="do not log worker alignment",
    )
    add("--no-progress", dest="progress", action="store_false", help="no progress bar")
    parser.set_defaults(func=run_train)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values = {name: getattr(args, name) for name in TrainConfig.__dataclass_fields__}
    for name in ("betas", "omegas"):
        if values[name] is not None:
            values[name] = tuple(values[name])
    return TrainConfig(**values).validate()


def run_train(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    from mtdao.train.distributed import leave_process_group
    from mtdao.train.trainer import train

    try:
        results = train(config)
    finally:
        leave_process_group()
    # one summary per job: under torchrun only rank 0 prints it
    if int(os.environ.get("RANK", "0")) == 0:
        out = config.out or f"runs/{config.run_name()}"
        summary = {
            k: results[k]
            for k in (
                "method",
                "steps",
                "tokens",
                "final_val_loss",
                "val_ppl",
                "comm_reduction_vs_ddp",
                "wall_time_s",
            )
        }
        print(json.dumps(summary), file=sys.stdout)
        print(f"results: {out}/results.json  plot: {out}/loss.png  metrics: {out}/metrics.jsonl")
    return 0
