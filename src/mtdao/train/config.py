"""The training configuration: one dataclass, a docstring per field, every default in one place.

A :class:`TrainConfig` holds what the user asked for; fields left ``None`` take a default that
depends on the method and the base optimizer (:data:`OPTIMIZER_DEFAULTS`, in
:mod:`mtdao.sync.optimizer_defaults`; the method table in :mod:`mtdao.sync.methods`).
:func:`resolve` validates a config once (:mod:`mtdao.train.config_checks`) and fills in every
default; the resolved config is what a run uses, what ``config.json`` and ``results.json`` hold,
and what a resume is compared with. Resolving is idempotent, so a saved resolved config resolves
to itself, and a ``config.json`` written with unset (null) fields, as older versions wrote it,
resolves to the values those fields take today.

The ``mtdao train`` flags are generated from the fields (:mod:`mtdao.train.command`): the help
text is the field's docstring, ``metadata`` names choices and the spelling of boolean switches.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from mtdao.data.batches import SPLITS as DATA_SPLITS
from mtdao.model.presets import MODEL_PRESETS
from mtdao.optim.named import BASE_OPTIMIZERS
from mtdao.sync.config import NON_FINITE_ACTIONS, OUTER_STEPS, method_defaults
from mtdao.sync.methods import METHOD_TABLE, METHODS, SYNC_POLICIES
from mtdao.sync.optimizer_defaults import OPTIMIZER_DEFAULTS as OPTIMIZER_DEFAULTS
from mtdao.sync.optimizer_defaults import default_lr as default_lr
from mtdao.train.config_checks import check_config
from mtdao.train.config_checks import config_warnings as config_warnings
from mtdao.train.schedule import DEFAULT_WARMUP_FRACTION, DEFAULT_WARMUP_STEPS, warmup_steps_of

SCHEDULES = ("cosine", "wsd", "constant")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_STEPS = 1200
EVALUATIONS_PER_RUN = 10

# Fields that may differ between a run and its resumption; everything else must match.
RESUMABLE_FIELDS = frozenset(
    {"steps", "tokens", "out", "resume", "eval_every", "checkpoint_every", "log_every", "progress"}
    | {"keep_checkpoints", "extend", "overwrite", "collective_timeout", "final_round"}
    | {"shards"}  # a sharded checkpoint loads into any number of shards per worker
    | {"lighthouse", "connect_timeout", "quorum_timeout", "bind_host", "auth_token_file"}
)


def _choice(default: str, choices: tuple[str, ...]):
    return field(default=default, metadata={"choices": choices})


def _switch_off(flag: str, off: str):
    """A field that defaults to True, turned off by ``flag``, whose help says ``off``."""
    return field(default=True, metadata={"flag": flag, "off": off})


@dataclass(frozen=True)
class TrainConfig:
    method: str = _choice("mtdao", METHODS)
    """Training method (see the method table below)."""
    optimizer: str = _choice("adam", BASE_OPTIMIZERS)
    """Base optimizer."""
    workers: int = 4
    """Data-parallel workers M, simulated in one process unless launched by torchrun (there the
    default is the number of processes / --shards)."""
    shards: int = 1
    """Processes per worker S, sharding its model with FSDP2 (torchrun world size M x S; for a
    fault-tolerant replica, S)."""
    sync_period: int = 32
    """K: local steps between parameter averages (local methods)."""
    sync_policy: str | None = field(default=None, metadata={"choices": SYNC_POLICIES})
    """Period rule for the optimizer states of local methods."""
    state_sync_period: int | None = None
    """Average every optimizer state every N steps, whatever the period rule."""
    sync_delay: int = 0
    """D: apply each sync round D steps after it starts, its collectives running meanwhile and
    the local progress merged in (0: blocking rounds)."""
    sync_fragments: int = 1
    """P: split the layers and their states into P fragments synced at staggered steps."""
    sync_dtype: tuple[str, ...] | None = None
    """What crosses the link: one dtype for every kind, or KIND=DTYPE per kind (params, momenta,
    second-moment); dtypes fp32, bf16, fp8, int8, int4, int2, top<k> (k of every 256 values kept,
    e.g. top8; not for the second moment); parameters go as pseudo-gradients."""
    error_feedback: bool = False
    """Carry each worker's quantization error of the parameters into its next round."""
    final_round: bool = _switch_off(
        "--no-final-round", "Do not average at the end: each worker keeps its own model."
    )
    """When training ends, land the rounds in flight and average whatever is still apart, so
    every worker (or replica) holds the same global model (nothing is sent when the last step
    synced everything)."""
    betas: tuple[float, ...] | None = None
    """First-momentum decays, e.g. --betas 0.9 0.99."""
    omegas: tuple[float, ...] | None = None
    """Mixing weights of the momenta; the raw gradient gets 1 - sum."""
    beta2: float | None = None
    """Second-moment decay."""
    eps: float | None = None
    """Denominator epsilon."""
    lr: float | None = None
    """Peak learning rate."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (not on norms or embeddings)."""
    omega_warmup: float = 0.0
    """Fraction of the run over which the omegas ramp linearly from 0 to their value."""
    beta_warmup: float | None = None
    """Fraction of the run over which each momentum decay above 0.9 rises from 0.9 to its value,
    its half-life growing linearly (AdEMAMix's schedule for its slow momentum)."""
    beta_ramp: float | None = None
    """C: each momentum decay above 0.9 is at most 1 - C / t at step t, so its half-life (about
    0.69 t / C) grows with the steps taken, not with --steps (0: off)."""
    outer_step: str = _choice("average", OUTER_STEPS)
    """local-adam, desloc, mtdao: at each parameter sync take the plain worker average, or
    DiLoCo's Nesterov outer step on it (--outer-lr, --outer-momentum); diloco always takes it."""
    outer_lr: float = 0.7
    """Outer learning rate (diloco, or --outer-step nesterov)."""
    outer_momentum: float = 0.9
    """Outer Nesterov momentum (diloco, or --outer-step nesterov)."""
    steps: int | None = field(default=None, metadata={"exclusive": "budget"})
    """Optimizer steps per worker."""
    tokens: int | None = field(default=None, metadata={"exclusive": "budget"})
    """Total training tokens over all workers, instead of --steps (converted to steps)."""
    batch_size: int = 16
    """Sequences per worker per step."""
    seq_len: int = 64
    """Tokens per sequence."""
    model: str = _choice("tiny", MODEL_PRESETS)
    """Model preset."""
    data: str | None = None
    """Training text: builtin, a text file or directory of text files, or hf:NAME[:CONFIG]."""
    tokenizer: str = "byte"
    """byte | bpe:VOCAB | hf:NAME."""
    data_split: str = _choice("shuffled", DATA_SPLITS)
    """Worker shards: shuffled (IID: the documents in a seeded random order, cut in equal
    shares), by-file (non-IID: each worker its own run of files in path order), or contiguous
    (non-IID: equal cuts of the path order, what "iid" was until 2026-12-02)."""
    schedule: str = _choice("wsd", SCHEDULES)
    """Learning-rate schedule after a linear warmup (wsd: warmup-stable-decay, the peak held until
    the last --decay-fraction of the steps; the default since 2026-12-04, cosine before)."""
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
    grad_clip: float = 1.0
    """Per-worker gradient norm clip (0 disables)."""
    eval_every: int | None = None
    """Steps between validation evaluations."""
    eval_tokens: int = 65536
    """Held-out tokens per evaluation."""
    log_every: int = 10
    """Steps between metric lines."""
    checkpoint_every: int | None = None
    """Steps between checkpoints."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept in --out (the newest N): a damaged newest one falls back to the
    one before it."""
    seed: int = 0
    """Seed for the model init and the data streams."""
    out: str | None = None
    """Run directory."""
    resume: bool = field(default=False, metadata={"flag": "--resume"})
    """Continue the run in --out from its newest good checkpoint, exactly as if it had not stopped;
    a directory with no checkpoint yet starts fresh (so one command line serves the first start
    and every restart under torchrun --max-restarts)."""
    extend: bool = field(default=False, metadata={"flag": "--extend"})
    """With --resume: allow a --steps other than the run's and re-plan the schedules for it. Exact
    (the same run as one given the new --steps from the start) when both plans agree on every step
    already taken: wsd resumed before its decay starts, or constant, with warmups of the same
    number of steps (the default LR warm-up and the step-counted --beta-ramp are, up to 3000
    steps; --warmup, --omega-warmup and --beta-warmup are fractions of --steps, so they differ
    unless 0). Otherwise it says so: cosine, or wsd past its decay start, is re-stretched and the
    learning rate jumps at the resume step (both values are printed). Without --extend a changed
    --steps is refused with that explanation."""
    overwrite: bool = field(default=False, metadata={"flag": "--overwrite"})
    """Replace the run in --out: delete the files a run writes there (config, metrics, results,
    checkpoints, plots), nothing else. Without it a fresh run refuses a directory holding one."""
    collective_timeout: float = 180.0
    """Seconds a worker waits for the others in one collective (torchrun workers, gloo or NCCL)
    before it stops with an error: a frozen or lost peer ends the job instead of hanging it. A
    fault-tolerant replica instead discards that round (or state transfer) and goes on; raise it
    for large models on slow links."""
    device: str = _choice("auto", DEVICES)
    """Device (auto: CUDA when available)."""
    bf16: bool = _switch_off("--no-bf16", "Do not autocast to bf16 on GPU: run float32.")
    """bf16 autocast on GPU (CPU always runs float32)."""
    on_non_finite: str = _choice("raise", NON_FINITE_ACTIONS)
    """NaN/inf in a worker at a sync: stop (raise), or leave that worker out and heal it with the
    others' average of everything it holds (skip; evaluation and checkpoints meanwhile leave it
    out or heal it first). Large finite values are averaged like any other (docs/design.md)."""
    track_alignment: bool = _switch_off(
        "--no-alignment", "Do not log the worker/global pseudo-gradient cosine and drift at syncs."
    )
    """Log worker/global pseudo-gradient cosine and drift at each parameter sync."""
    progress: bool = _switch_off("--no-progress", "Hide the progress bar.")
    """Show a progress bar."""
    fault_tolerant: bool = False
    """Run one replica of a fault-tolerant run (torchft): replicas may die, rejoin and heal."""
    replica_id: int | None = None
    """This replica's number, 0 .. --workers - 1: its data shard (with --fault-tolerant)."""
    lighthouse: str | None = None
    """The lighthouse's host:port (with --fault-tolerant; start one with mtdao lighthouse)."""
    connect_timeout: float = 30.0
    """Seconds to reach the lighthouse or a peer before giving up (with --fault-tolerant)."""
    quorum_timeout: float = 600.0
    """Seconds to wait for a quorum; keep it above the time between syncs (--fault-tolerant)."""
    bind_host: str = "127.0.0.1"
    """The address this replica's listeners serve on (manager, store, collectives, heal state;
    with --fault-tolerant): loopback for replicas on one machine, this machine's address on the
    network the replicas share for several (see docs/security.md)."""
    auth_token_file: str | None = None
    """A file holding the run's secret, the same for every replica (else $MTDAO_AUTH_TOKEN): a
    peer without it is neither averaged with nor healed from. Required unless --bind-host is
    loopback (with --fault-tolerant; see docs/security.md)."""

    @property
    def tokens_per_step(self) -> int:
        return self.workers * self.batch_size * self.seq_len

    def total_steps(self) -> int:
        if self.steps is not None:
            return self.steps
        if self.tokens is not None:
            return max(1, math.ceil(self.tokens / self.tokens_per_step))
        return DEFAULT_STEPS

    def run_name(self) -> str:
        """<method>-<optimizer>-M<workers>[-S<shards>][-K<K>]-seed<seed> (no K for gradient
        averaging, no S unsharded)."""
        period = "" if METHOD_TABLE[self.method].averages_gradients else f"-K{self.sync_period}"
        shards = f"-S{self.shards}" if self.shards > 1 else ""
        return f"{self.method}-{self.optimizer}-M{self.workers}{shards}{period}-seed{self.seed}"

    def to_dict(self) -> dict:
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown config field(s) {unknown}")
        missing = sorted(known - set(values))
        if missing:  # every field is saved, so this config is from an earlier version
            raise ValueError(
                f"a config without the field(s) {missing}, written by an earlier version of "
                "mtdao, which this one does not read"
            )
        values = dict(values)
        for name in ("betas", "omegas", "sync_dtype"):
            if values.get(name) is not None:
                values[name] = tuple(values[name])
        return cls(**values)

    def differences(self, other: TrainConfig) -> list[str]:
        """Fields (outside RESUMABLE_FIELDS) whose values differ, as 'name: a -> b'. The LR
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


# -- resolving ----------------------------------------------------------------------------------

# how the LR warm-up is given: compared by the steps it comes to (TrainConfig.differences,
# suite.stale_settings)
WARMUP_FIELDS = frozenset({"warmup", "warmup_steps"})


def resolve(config: TrainConfig) -> TrainConfig:
    """``config`` validated, with every default filled in; raises ValueError naming a bad flag."""
    check_config(config)
    steps = config.total_steps()
    return dataclasses.replace(
        config,
        lr=config.lr if config.lr is not None else default_lr(config.method, config.optimizer),
        **method_defaults(config),  # the library's: mtdao.sync.config
        steps=steps,
        tokens=None,
        eval_every=config.eval_every or max(1, steps // EVALUATIONS_PER_RUN),
        data=config.data or "builtin",
        out=config.out or default_out(config),
    )


def default_out(config: TrainConfig) -> str:
    """runs/<run name>, and a directory per replica in a fault-tolerant run."""
    out = Path("runs") / config.run_name()
    return str(out / f"replica-{config.replica_id}" if config.fault_tolerant else out)


def describe_default(name: str) -> str | None:
    """How an unset (None) field is resolved, for ``--help``; None for fields with a value."""
    rules = [f"{spec.period_rule} for {m}" for m, spec in METHOD_TABLE.items() if spec.period_rule]
    descriptions = {
        "sync_policy": "the method's: " + ", ".join(rules),
        "state_sync_period": "the period rule's",
        "sync_dtype": "fp32 for every kind",
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
