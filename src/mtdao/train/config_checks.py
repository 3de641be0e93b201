"""The checks of a training configuration: :func:`check_config` refuses a bad one in one line
naming the flag, :func:`config_warnings` lists what is allowed but probably not meant. The method's
own settings are :func:`mtdao.methods.checks.check_method`'s. Takes the config as ``Any``:
:mod:`mtdao.train.config` imports this module."""

from __future__ import annotations

import math
from typing import Any

from mtdao.flags import flag, flat_values, leaf_fields
from mtdao.methods.checks import (
    check_choice,
    check_method,
    non_negative,
    positive,
    positive_int,
)
from mtdao.methods.table import METHOD_TABLE
from mtdao.optim.warmups import BETA_WARMUP_START, step_capped_beta


def check_config(config: Any) -> None:
    """Raise ValueError naming the first bad field of a :class:`~mtdao.train.config.TrainConfig`."""
    settings = flat_values(config)
    for _, f in leaf_fields(type(config)):
        check_choice(f, settings[f.name])
    # sync_period is the method's: check_method below
    names = ("workers", "shards", "batch_size", "seq_len", "eval_tokens")
    for name in names + ("log_every", "keep_checkpoints"):
        positive_int(name, settings[name])
    if config.text.eval_tokens < config.text.seq_len:
        raise ValueError(
            f"--eval-tokens {config.text.eval_tokens} is less than one window of --seq-len "
            f"{config.text.seq_len}: raise --eval-tokens or lower --seq-len"
        )
    batch_size, shards = config.text.batch_size, config.parallel.shards
    if batch_size % shards != 0:
        raise ValueError(
            f"--batch-size {batch_size} does not split over --shards {shards} "
            "(each process of a worker takes batch-size / shards of its sequences)"
        )
    for name in ("steps", "tokens", "eval_every", "checkpoint_every"):
        if settings[name] is not None:
            positive_int(name, settings[name])
    if config.training.steps is not None and config.training.tokens is not None:
        raise ValueError("give --steps or --tokens, not both")
    check_method(config.sync)  # the method's settings: the library's rules
    for name in ("weight_decay", "grad_clip", "min_lr_ratio", "lr"):
        if settings[name] is not None:
            non_negative(name, settings[name])
    positive("collective_timeout", config.parallel.collective_timeout)
    if config.lr_schedule.min_lr_ratio > 1.0:
        raise ValueError(
            f"--min-lr-ratio must lie in [0, 1] (the final learning rate as a fraction of the "
            f"peak), got {config.lr_schedule.min_lr_ratio}"
        )
    if config.job.resume and config.job.overwrite:
        raise ValueError("give --resume (continue the run in --out) or --overwrite, not both")
    if config.job.extend and not config.job.resume:
        raise ValueError("--extend re-plans a resumed run: it needs --resume")
    for name in ("warmup", "decay_fraction"):
        value = settings[name]
        if value is not None and not 0.0 <= value <= 1.0:
            raise ValueError(f"--{flag(name)} must lie in [0, 1], got {value}")
    if config.lr_schedule.warmup is not None and config.lr_schedule.warmup_steps is not None:
        raise ValueError(
            "give --warmup (a fraction of --steps) or --warmup-steps (a number of steps), not both"
        )
    if config.lr_schedule.warmup_steps is not None and not (
        isinstance(config.lr_schedule.warmup_steps, int)
        and 0 <= config.lr_schedule.warmup_steps <= config.total_steps()
    ):
        raise ValueError(
            f"--warmup-steps must be a whole number of steps from 0 to the run's "
            f"{config.total_steps()}, got {config.lr_schedule.warmup_steps!r}"
        )
    _check_fault_tolerance(config.fault_tolerance, config.parallel)


def _check_fault_tolerance(config: Any, parallel: Any) -> None:
    workers = parallel.workers
    for name in ("connect_timeout", "quorum_timeout"):
        value = getattr(config, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"--{flag(name)} must be a number of seconds > 0, got {value!r}")
    if not config.bind_host or not config.bind_host.strip():
        raise ValueError("--bind-host is empty; give an address, e.g. 127.0.0.1")
    if not parallel.fault_tolerant:
        for name in ("replica_id", "lighthouse", "auth_token_file"):
            if getattr(config, name) is not None:
                raise ValueError(f"--{flag(name)} needs --fault-tolerant")
        return
    if config.replica_id is None or config.lighthouse is None:
        raise ValueError("--fault-tolerant needs --replica-id and --lighthouse")
    if _is_ipv6_wildcard(config.bind_host):
        raise ValueError(
            f"--bind-host {config.bind_host} serves every address, loopback included, so "
            "torchft's manager could not be kept behind the front that refuses its Kill call; "
            "give this machine's address on the replicas' network (or 0.0.0.0 for every IPv4 "
            "interface)"
        )
    if isinstance(config.replica_id, bool) or not isinstance(config.replica_id, int):
        raise ValueError(f"--replica-id must be an integer, got {config.replica_id!r}")
    if not 0 <= config.replica_id < workers:
        raise ValueError(
            f"--replica-id {config.replica_id} is outside 0 .. {workers - 1} "
            f"(--workers {workers} replicas, one data shard each)"
        )
    if not config.lighthouse.strip():
        raise ValueError("--lighthouse is empty; give the lighthouse's host:port")


# The shortest run of the defaults card (BENCHMARKS.md): below it, MT-DAO's default is unmeasured.
SHORTEST_MEASURED_RUN = 300
# From this many workers on the workers study (BENCHMARKS.md) finds MT-DAO's default behind DDP.
TRAILS_DDP_FROM_WORKERS = 16


def config_warnings(config: Any) -> list[str]:
    """Settings of a resolved ``config`` that are allowed but probably not what was meant."""
    found, sync = [], config.sync
    steps = config.total_steps()
    if not METHOD_TABLE[sync.method].averages_gradients and sync.sync_period > steps:
        average = (
            "average their parameters only in the final round"
            if sync.final_round
            else "never average their parameters"
        )
        found.append(
            f"--sync-period {sync.sync_period} is larger than --steps {steps}: the workers "
            f"{average} in this run (evaluation still averages them)"
        )
    slowest = max(sync.betas or (0.0,))
    ramped = sync.beta_ramp and slowest > BETA_WARMUP_START
    ramped_at = round(sync.beta_ramp / (1 - slowest)) if ramped else 0
    if steps < min(ramped_at, SHORTEST_MEASURED_RUN):  # unmeasured, its momentum still ramping
        final = step_capped_beta(slowest, steps, sync.beta_ramp)
        found.append(
            f"--steps {steps} is shorter than any run MT-DAO's default was measured at "
            f"({SHORTEST_MEASURED_RUN} steps and up; BENCHMARKS.md, the defaults card); its slow "
            f"momentum is still ramping up and ends this run at decay {final:.3f} (target "
            f"{slowest:g} from step {ramped_at})"
        )
    workers = config.parallel.workers
    if sync.method == "mtdao" and workers >= TRAILS_DDP_FROM_WORKERS:
        found.append(
            f"--workers {workers}: from {TRAILS_DDP_FROM_WORKERS} workers on MT-DAO trails DDP "
            "(BENCHMARKS.md, the workers study, micro model, 3000 steps): with its default rounds "
            "(the parameters every 4 steps as int4 pseudo-gradients, the states as int8 every 32; "
            "20x less traffic than DDP; from 32 workers a step of 1.5 past their average) by "
            "0.7-2.2% at 16 workers, 1.3-2.3% at 32 and 2.7-6.5% at 64 at a global batch of 64 "
            "sequences, 1.5-5.8% at 32 to 128 workers at 128; with K = 32 in float32 (10.6x less) "
            "by 3-8% at 16 and 12-24% at 64"
        )
    if sync.state_sync_period is not None and sync.state_sync_period > steps:
        averaged = (
            "are averaged only by the final round" if sync.final_round else "are never averaged"
        )
        found.append(
            f"--state-sync-period {sync.state_sync_period} is larger than --steps {steps}: the "
            f"optimizer states {averaged} in this run"
        )
    return found


def _is_ipv6_wildcard(host: str) -> bool:
    import ipaddress

    try:
        address = ipaddress.ip_address(host.strip().strip("[]"))
    except ValueError:
        return False  # a name, or an IPv4 address
    return address.version == 6 and address.is_unspecified
