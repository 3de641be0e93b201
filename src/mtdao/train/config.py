"""The training configuration: one dataclass in sections, a docstring per setting (the ``mtdao
train`` flag's help), every default in one place.

Settings are marked where they may differ between a run and its resumption (``resumable``) or
between the replicas of one run (``replica_local``). :func:`resolve` checks a config once
(:mod:`mtdao.train.config_checks`) and fills in every default; the resolved config is what a run
uses, saves and compares a resume with. Resolving is idempotent, and a ``config.json`` with unset
(null) fields resolves to the values they take today."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from mtdao.data.batches import SPLITS as DATA_SPLITS
from mtdao.flags import as_flags, choice, flat_values, from_flat, leaf_fields, switch_off
from mtdao.ft.config import ReplicaConfig
from mtdao.methods.checks import checked_defaults
from mtdao.methods.config import SyncConfig
from mtdao.methods.defaults import (
    AVERAGE_OUTER_STEP,
    DEFAULT_ROUNDS,
    DEFAULT_SYNC_PERIOD,
    OUTER_LR_BY_WORKERS,
)
from mtdao.methods.defaults import OPTIMIZER_DEFAULTS as OPTIMIZER_DEFAULTS
from mtdao.methods.defaults import default_lr as default_lr
from mtdao.methods.table import METHOD_TABLE
from mtdao.model.presets import MODEL_PRESETS
from mtdao.train.config_checks import check_config
from mtdao.train.config_checks import config_warnings as config_warnings
from mtdao.train.schedule import DEFAULT_WARMUP_FRACTION, DEFAULT_WARMUP_STEPS, warmup_steps_of

SCHEDULES = ("cosine", "wsd", "constant")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_STEPS = 1200
EVALUATIONS_PER_RUN = 10


def _setting(default, *, resumable: bool = False, replica_local: bool = False, **metadata):
    """A field and its marks: ``resumable``, may differ between a run and its resumption (every
    other setting must match); ``replica_local``, may differ between the replicas of one
    fault-tolerant run (every other setting must match the quorum's)."""
    marks = {"resumable": resumable, "replica_local": replica_local}
    return field(default=default, metadata={**marks, **metadata})


@dataclass(frozen=True)
class ParallelSettings:
    """Workers and processes."""

    workers: int = 4
    """Data-parallel workers M, simulated in one process unless launched by torchrun."""
    shards: int = _setting(1, resumable=True)
    """Processes per worker S, sharding its model with FSDP2 (torchrun world size M x S; for a
    fault-tolerant replica, S)."""
    fault_tolerant: bool = False
    """Run one replica of a fault-tolerant run (torchft): replicas may die, rejoin and heal."""
    collective_timeout: float = _setting(180.0, resumable=True, replica_local=True)
    """Seconds a worker waits for the others in one collective (torchrun workers, gloo or NCCL)
    before it stops with an error: a frozen or lost peer ends the job instead of hanging it. A
    fault-tolerant replica instead discards that round (or state transfer) and goes on; raise it
    for large models on slow links."""


@dataclass(frozen=True)
class TrainingSettings:
    """Model, budget and training."""

    model: str = choice("tiny", MODEL_PRESETS)
    """Model preset."""
    steps: int | None = _setting(None, resumable=True, exclusive="budget")
    """Optimizer steps per worker."""
    tokens: int | None = _setting(None, resumable=True, exclusive="budget")
    """Total training tokens over all workers, instead of --steps (converted to steps)."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (not on norms or embeddings)."""
    grad_clip: float = 1.0
    """Per-worker gradient norm clip (0 disables)."""
    seed: int = 0
    """Seed for the model init and the data streams."""
    device: str = choice("auto", DEVICES, replica_local=True)
    """Device (auto: CUDA when available)."""
    bf16: bool = switch_off("--no-bf16", "Do not autocast to bf16 on GPU: run float32.")
    """bf16 autocast on GPU (CPU always runs float32)."""


@dataclass(frozen=True)
class LrSchedule:
    """Learning-rate schedule."""

    lr: float | None = None
    """Peak learning rate."""
    schedule: str = choice("wsd", SCHEDULES)
    """Learning-rate schedule after a linear warmup (wsd: warmup-stable-decay, the peak held until
    the last --decay-fraction of the steps)."""
    warmup: float | None = None
    """LR warm-up as a fraction of the steps (instead of --warmup-steps)."""
    warmup_steps: int | None = None
    """LR warm-up in steps."""
    # Both unset in a resolved config means the default rule (schedule.warmup_steps_of), kept a
    # rule of --steps so that a run re-planned by --extend follows it for its new length.
    decay_fraction: float = 0.2
    """wsd: fraction of the steps spent decaying."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""


@dataclass(frozen=True)
class TextSettings:
    """Data."""

    data: str | None = None
    """Training text: builtin, a text file or directory of text files, or hf:NAME[:CONFIG]."""
    tokenizer: str = "byte"
    """byte | bpe:VOCAB | hf:NAME."""
    data_split: str = choice("shuffled", DATA_SPLITS)
    """Worker shards: shuffled (IID: the documents in a seeded random order, cut in equal
    shares), by-file (non-IID: each worker its own run of files in path order), or contiguous
    (non-IID: equal cuts of the path order, what "iid" was until 2026-12-02)."""
    batch_size: int = 16
    """Sequences per worker per step."""
    seq_len: int = 64
    """Tokens per sequence."""
    eval_tokens: int = _setting(65536, replica_local=True)
    """Held-out tokens per evaluation."""


@dataclass(frozen=True)
class JobSettings:
    """Run directory, evaluation and logging."""

    out: str | None = _setting(None, resumable=True, replica_local=True)
    """Run directory."""
    resume: bool = _setting(False, resumable=True, replica_local=True, flag="--resume")
    """Continue the run in --out from its newest good checkpoint, exactly as if it had not stopped;
    a directory with no checkpoint yet starts fresh (so one command line serves the first start
    and every restart under torchrun --max-restarts)."""
    extend: bool = _setting(False, resumable=True, flag="--extend")
    """With --resume: allow a --steps other than the run's and re-plan the schedules for it. Exact
    (the same run as one given the new --steps from the start) when both plans agree on every step
    already taken: wsd resumed before its decay starts, or constant, with warmups of the same
    number of steps (the default LR warm-up and the step-counted --beta-ramp are, up to 3000
    steps; --warmup, --omega-warmup and --beta-warmup are fractions of --steps, so they differ
    unless 0). Otherwise it says so: cosine, or wsd past its decay start, is re-stretched and the
    learning rate jumps at the resume step (both values are printed). Without --extend a changed
    --steps is refused with that explanation."""
    overwrite: bool = _setting(False, resumable=True, flag="--overwrite")
    """Replace the run in --out: delete the files a run writes there (config, metrics, results,
    checkpoints, plots), nothing else. Without it a fresh run refuses a directory holding one."""
    eval_every: int | None = _setting(None, resumable=True, replica_local=True)
    """Steps between validation evaluations."""
    log_every: int = _setting(10, resumable=True, replica_local=True)
    """Steps between metric lines."""
    progress: bool = switch_off(
        "--no-progress", "Hide the progress bar.", resumable=True, replica_local=True
    )
    """Show a progress bar."""


@dataclass(frozen=True)
class CheckpointSettings:
    """Checkpoints."""

    checkpoint_every: int | None = _setting(None, resumable=True, replica_local=True)
    """Steps between checkpoints."""
    keep_checkpoints: int = _setting(2, resumable=True)
    """Complete checkpoints kept in --out (the newest N): a damaged newest one falls back to the
    one before it."""


@dataclass(frozen=True)
class TrainConfig:
    """What a run is asked to do, in sections; each setting's flag is its name (``--sync-period``
    for ``sync.sync_period``), and its name is unique across the sections."""

    sync: SyncConfig = field(default_factory=SyncConfig)
    parallel: ParallelSettings = field(default_factory=ParallelSettings)
    training: TrainingSettings = field(default_factory=TrainingSettings)
    lr_schedule: LrSchedule = field(default_factory=LrSchedule)
    text: TextSettings = field(default_factory=TextSettings)
    job: JobSettings = field(default_factory=JobSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    fault_tolerance: ReplicaConfig = field(default_factory=ReplicaConfig)

    @classmethod
    def of(cls, **settings) -> TrainConfig:
        """The config with these settings (named as the flags, ``sync_period=8``), every other at
        its default."""
        return from_flat(cls, settings)

    def replace(self, **settings) -> TrainConfig:
        """This config with these settings changed (named as the flags)."""
        return from_flat(type(self), {**flat_values(self), **settings})

    @property
    def tokens_per_step(self) -> int:
        return self.parallel.workers * self.text.batch_size * self.text.seq_len

    def total_steps(self) -> int:
        if self.training.steps is not None:
            return self.training.steps
        if self.training.tokens is not None:
            return max(1, math.ceil(self.training.tokens / self.tokens_per_step))
        return DEFAULT_STEPS

    def run_name(self) -> str:
        """<method>-<optimizer>-M<workers>[-S<shards>][-K<K>]-seed<seed> (no K for gradient
        averaging, no S unsharded)."""
        sync, parallel = self.sync, self.parallel
        period = "" if METHOD_TABLE[sync.method].averages_gradients else f"-K{sync.sync_period}"
        shards = f"-S{parallel.shards}" if parallel.shards > 1 else ""
        return (
            f"{sync.method}-{sync.optimizer}-M{parallel.workers}{shards}{period}"
            f"-seed{self.training.seed}"
        )

    def to_dict(self) -> dict:
        """Every setting by name (flat: the names are unique), as config.json holds it."""
        return {name: _jsonable(value) for name, value in flat_values(self).items()}

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        known = set(SETTINGS)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown config field(s) {unknown}")
        missing = sorted(known - set(values) - ADDED_AT_THEIR_DEFAULTS)
        if missing:  # every field is saved, so this config is from an earlier version
            raise ValueError(
                f"a config without the field(s) {missing}, written by an earlier version of "
                "mtdao, which this one does not read"
            )
        values = dict(values)
        for name in ("betas", "omegas", "sync_dtype", "radial_directional"):
            if values.get(name) is not None:
                values[name] = tuple(values[name])
        return cls.of(**values)

    def differences(self, other: TrainConfig) -> list[str]:
        """Settings (all but the resumable ones) whose values differ, as 'name: a -> b'. The LR
        warm-ups are compared as the steps each gives a run of this config's length (a
        fraction and a count of steps may agree; a re-planned length is --extend's to judge)."""
        mine, theirs = self.to_dict(), other.to_dict()
        differ = [
            f"{name}: {mine[name]!r} -> {theirs[name]!r}"
            for name in mine
            if name not in RESUMABLE_FIELDS | WARMUP_FIELDS and mine[name] != theirs[name]
        ]
        steps = self.total_steps()
        warmups = warmup_steps_of(self, steps), warmup_steps_of(other, steps)
        if warmups[0] != warmups[1]:
            differ.append(f"LR warm-up: {warmups[0]} -> {warmups[1]} steps (of {steps})")
        return differ


# every setting's field (name -> dataclasses.Field), across the sections
SETTINGS = {f.name: f for _, f in leaf_fields(TrainConfig)}
# settings added since runs were saved without them, whose defaults do what those runs did: a
# config that lacks one reads as its default, so such a run still resumes and a study reuses it
ADDED_AT_THEIR_DEFAULTS = frozenset(
    {
        "outer_momentum_warmup",
        "outer_momentum_start",
        "outer_momentum_decay",
        "outer_momentum_final",
        "radial_directional",
    }
)


def marked(mark: str) -> frozenset[str]:
    """The settings that carry ``mark`` (resumable, replica_local)."""
    return frozenset(name for name, f in SETTINGS.items() if f.metadata.get(mark))


# settings that may differ between a run and its resumption; every other must match
RESUMABLE_FIELDS = marked("resumable")


# -- resolving ----------------------------------------------------------------------------------

# how the LR warm-up is given: compared by the steps it comes to (TrainConfig.differences,
# suite.stale_settings)
WARMUP_FIELDS = frozenset({"warmup", "warmup_steps"})


def resolve(config: TrainConfig) -> TrainConfig:
    """``config`` validated, with every default filled in; raises ValueError naming a bad flag
    (the library's messages name the field, `sync_period`: spelled here as its flag)."""
    try:
        return _resolve(config)
    except ValueError as error:
        raise ValueError(as_flags(str(error))) from None


def _resolve(config: TrainConfig) -> TrainConfig:
    check_config(config)
    steps, sync, lr = config.total_steps(), config.sync, config.lr_schedule.lr
    config = config.replace(**checked_defaults(sync, config.parallel.workers))  # the library's
    out = config.job.out or default_out(config)
    return config.replace(
        lr=lr if lr is not None else default_lr(sync.method, sync.optimizer),
        steps=steps,
        tokens=None,
        eval_every=config.job.eval_every or max(1, steps // EVALUATIONS_PER_RUN),
        data=config.text.data or "builtin",
        out=out,
    )


def default_out(config: TrainConfig) -> str:
    """runs/<run name>, and a directory per replica in a fault-tolerant run."""
    out, ft = Path("runs") / config.run_name(), config.fault_tolerance
    return str(out / f"replica-{ft.replica_id}" if config.parallel.fault_tolerant else out)


def describe_default(name: str) -> str | None:
    """How an unset (None) field is resolved, for ``--help``; None for fields with a value."""
    rules = [f"{spec.period_rule} for {m}" for m, spec in METHOD_TABLE.items() if spec.period_rule]
    rounds = DEFAULT_ROUNDS
    mtdao = (
        "mtdao-adam with 2 or more workers, unless --sync-period, --state-sync-period, "
        "--sync-dtype or --sync-policy is given"
    )
    outer_rule = (
        f"mtdao's default rounds from {min(OUTER_LR_BY_WORKERS)} workers, unless --outer-step, "
        "--outer-lr or --outer-momentum is given"
    )
    outer_lrs = ", ".join(f"{lr:g} from {m} workers" for m, lr in OUTER_LR_BY_WORKERS.items())
    descriptions = {
        "sync_policy": "the method's: " + ", ".join(rules),
        "sync_period": f"{DEFAULT_SYNC_PERIOD}; {mtdao}: {rounds['sync_period']}",
        "state_sync_period": f"the period rule's; {mtdao}: {rounds['state_sync_period']}",
        "sync_dtype": f"fp32 for every kind; {mtdao}: {' '.join(rounds['sync_dtype'])} "
        "with --error-feedback",
        "outer_step": f"average; {outer_rule}: nesterov",
        "outer_lr": f"{AVERAGE_OUTER_STEP['outer_lr']:g}; {outer_rule}: {outer_lrs}",
        "outer_momentum": f"{AVERAGE_OUTER_STEP['outer_momentum']:g}; {outer_rule}: 0",
        "betas": f"{_per_optimizer('betas')}; mtdao and qh-ddp: {_per_optimizer('mtdao_betas')}",
        "omegas": f"1 for the baselines; mtdao and qh-ddp: {_per_optimizer('mtdao_omegas')}, "
        "or 0.9 shared equally among the user's own --betas",
        "beta_warmup": "0; mtdao and qh-ddp with the default --betas: "
        + _per_optimizer("mtdao_beta_warmup"),
        "beta_ramp": "0; mtdao and qh-ddp with the default --betas: "
        + _per_optimizer("mtdao_beta_ramp"),
        "beta2": _per_optimizer("beta2"),
        "eps": _per_optimizer("eps"),
        "lr": _per_optimizer("lr"),
        "steps": str(DEFAULT_STEPS),
        "workers": "4; under torchrun, the number of processes / --shards",
        "warmup": "--warmup-steps",
        "warmup_steps": f"{DEFAULT_WARMUP_STEPS}, or {DEFAULT_WARMUP_FRACTION:g} of --steps when "
        "that is longer, at most half the run: the same for every run of up to "
        f"{round(DEFAULT_WARMUP_STEPS / DEFAULT_WARMUP_FRACTION)} steps",
        "eval_every": f"steps / {EVALUATIONS_PER_RUN}",
        "checkpoint_every": "only at the end",
        "data": "builtin: the Python standard library's source, no download",
        "out": "runs/<method>-<optimizer>-M<workers>[-S<shards>][-K<K>]-seed<seed>[/replica-<id>]",
        "replica_id": "required with --fault-tolerant",
        "lighthouse": "required with --fault-tolerant",
        "auth_token_file": "$MTDAO_AUTH_TOKEN",
    }
    return descriptions.get(name)


def _per_optimizer(attribute: str) -> str:
    values = {name: getattr(row, attribute) for name, row in OPTIMIZER_DEFAULTS.items()}
    shown = [f"{name} {_text(value)}" for name, value in values.items() if value is not None]
    return ", ".join(shown)


def _text(value) -> str:
    if isinstance(value, tuple):
        return " ".join(f"{v:g}" for v in value)
    return f"{value:g}"


def _jsonable(value):
    return list(value) if isinstance(value, tuple) else value
