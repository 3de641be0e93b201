"""The training configuration: one dataclass, a docstring per field, validated in one place.

Resolution order: dataclass defaults, then the method's defaults (``resolve``), then the CLI
flags the user gave. The resolved config is written to the run directory and checked on resume.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from mtdao.model.presets import MODEL_PRESETS
from mtdao.sync.methods import BASE_OPTIMIZERS, METHODS, SYNC_POLICIES

SCHEDULES = ("cosine", "wsd", "constant")
DEVICES = ("auto", "cpu", "cuda")
NON_FINITE_ACTIONS = ("raise", "skip")

# Fields that may differ between a run and its resumption; everything else must match.
RESUMABLE_FIELDS = frozenset(
    {"steps", "tokens", "out", "resume", "eval_every", "checkpoint_every", "log_every", "progress"}
)

# Best learning rate per (method family, base optimizer) found by the sweeps in BENCHMARKS.md on
# the tiny preset; a starting point, to be re-tuned at other sizes.
DEFAULT_LR = {"adam": 8e-3, "adopt": 4e-3, "sgdm": 0.3}


@dataclass
class TrainConfig:
    method: str = "mtdao"
    """ddp | qh-ddp | local-adam | diloco | desloc | mtdao."""
    optimizer: str = "adam"
    """Base optimizer: adam | adopt | sgdm."""
    workers: int = 4
    """Number of data-parallel workers M (simulated in one process unless launched by torchrun)."""
    sync_period: int = 32
    """K: local steps between parameter averages."""
    sync_policy: str | None = None
    """unified | half-life | desloc period rule for the states of local methods (None: method's)."""
    state_sync_period: int | None = None
    """Average every optimizer state every N steps, whatever the period rule (local methods)."""
    betas: tuple[float, ...] | None = None
    """First-momentum decays (None: 0.9 for baselines, the slow MT-DAO defaults for mtdao)."""
    omegas: tuple[float, ...] | None = None
    """Mixing weights of the momenta; the raw gradient gets 1 - sum (None: method's default)."""
    beta2: float | None = None
    """Second-moment decay (None: 0.95 for adam, 0.9999 for adopt)."""
    eps: float | None = None
    """Denominator epsilon (None: 1e-8 adam, 1e-6 adopt)."""
    lr: float | None = None
    """Peak learning rate (None: the per-optimizer default in DEFAULT_LR)."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (not on norms or embeddings)."""
    omega_warmup: float = 0.0
    """Fraction of the run over which the omegas ramp linearly from 0 to their value."""
    outer_lr: float = 0.7
    """DiLoCo outer learning rate."""
    outer_momentum: float = 0.9
    """DiLoCo outer Nesterov momentum."""
    steps: int | None = None
    """Optimizer steps per worker (give steps or tokens; default 1200)."""
    tokens: int | None = None
    """Total training tokens over all workers; converted to steps."""
    batch_size: int = 16
    """Sequences per worker per step."""
    seq_len: int = 64
    """Tokens per sequence."""
    model: str = "tiny"
    """Model preset: tiny | small | 16m | 125m | 360m | 720m."""
    data: str | None = None
    """None: built-in Python stdlib sources; a text file/dir; or hf:NAME[:CONFIG]."""
    tokenizer: str = "byte"
    """byte | bpe:VOCAB | hf:NAME."""
    data_split: str = "iid"
    """iid (random shards) | by-file (non-IID: each worker its own files)."""
    schedule: str = "cosine"
    """cosine | wsd (warmup-stable-decay) | constant, after linear warmup."""
    warmup: float = 0.05
    """Warmup length as a fraction of the steps."""
    decay_fraction: float = 0.2
    """wsd: fraction of the steps spent decaying."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    grad_clip: float = 1.0
    """Per-worker gradient norm clip (0 disables)."""
    eval_every: int | None = None
    """Steps between validation evaluations (None: 10 per run)."""
    eval_tokens: int = 65536
    """Held-out tokens per evaluation."""
    log_every: int = 10
    """Steps between metric lines."""
    checkpoint_every: int | None = None
    """Steps between checkpoints (None: only at the end)."""
    seed: int = 0
    """Seed for the model init and the data streams."""
    out: str | None = None
    """Run directory (None: runs/<method>-<optimizer>-M<workers>-K<K>-seed<seed>)."""
    resume: bool = False
    """Continue the run in ``out`` from its checkpoint up to ``steps``."""
    device: str = "auto"
    """auto | cpu | cuda."""
    bf16: bool = True
    """bf16 autocast on GPU (CPU always runs float32)."""
    on_non_finite: str = "raise"
    """raise | skip: what a NaN/inf in a worker does at a sync."""
    track_alignment: bool = True
    """Log worker/global pseudo-gradient cosine and drift at each parameter sync."""
    progress: bool = True
    """Show a progress bar."""

    def validate(self) -> TrainConfig:
        """Raise ValueError naming the first bad field; returns self for chaining."""
        _choice("method", self.method, METHODS)
        _choice("optimizer", self.optimizer, BASE_OPTIMIZERS)
        _choice("model", self.model, MODEL_PRESETS)
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("device", self.device, DEVICES)
        _choice("on_non_finite", self.on_non_finite, NON_FINITE_ACTIONS)
        if self.sync_policy is not None:
            _choice("sync_policy", self.sync_policy, SYNC_POLICIES)
        for name in ("workers", "sync_period", "batch_size", "seq_len", "eval_tokens", "log_every"):
            _positive_int(name, getattr(self, name))
        if self.state_sync_period is not None and self.method in ("ddp", "qh-ddp", "diloco"):
            raise ValueError(
                f"--state-sync-period: {self.method} does not average optimizer states"
            )
        for name in ("steps", "tokens", "eval_every", "checkpoint_every", "state_sync_period"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.steps is not None and self.tokens is not None:
            raise ValueError("give --steps or --tokens, not both")
        for name in ("weight_decay", "grad_clip", "min_lr_ratio"):
            _non_negative(name, getattr(self, name))
        if self.lr is not None:
            _non_negative("lr", self.lr)
        self._validate_momenta()
        for name in ("warmup", "decay_fraction", "omega_warmup"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"--{_flag(name)} must lie in [0, 1], got {value}")
        return self

    def _validate_momenta(self) -> None:
        for index, beta in enumerate(self.betas or ()):
            if not 0.0 <= beta < 1.0:  # also refuses NaN
                raise ValueError(f"--betas: {beta} (index {index}) is outside [0, 1)")
        if self.betas is not None and len(self.betas) == 0:
            raise ValueError("--betas: give at least one momentum decay")
        for omega in self.omegas or ():
            if not (omega >= 0.0 and math.isfinite(omega)):
                raise ValueError(f"--omegas: {omega} is not a finite number >= 0")
        if self.omegas is not None and sum(self.omegas) > 1.0 + 1e-9:
            raise ValueError(f"--omegas: {list(self.omegas)} sum to {sum(self.omegas):g} > 1")
        if (
            self.betas is not None
            and self.omegas is not None
            and len(self.betas) != len(self.omegas)
        ):
            raise ValueError(
                f"--omegas: {len(self.omegas)} weights for {len(self.betas)} --betas (one per momentum)"
            )
        if self.beta2 is not None and not 0.0 <= self.beta2 < 1.0:
            raise ValueError(f"--beta2: {self.beta2} is outside [0, 1)")
        if self.eps is not None:
            _non_negative("eps", self.eps)
        if self.outer_lr <= 0 or not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(
                f"--outer-lr must be > 0 and --outer-momentum in [0, 1), got {self.outer_lr}, "
                f"{self.outer_momentum}"
            )

    @property
    def tokens_per_step(self) -> int:
        return self.workers * self.batch_size * self.seq_len

    def total_steps(self) -> int:
        if self.steps is not None:
            return self.steps
        if self.tokens is not None:
            return max(1, math.ceil(self.tokens / self.tokens_per_step))
        return 1200

    def run_name(self) -> str:
        return f"{self.method}-{self.optimizer}-M{self.workers}-K{self.sync_period}-seed{self.seed}"

    def to_dict(self) -> dict:
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown config field(s) {unknown}")
        values = dict(values)
        for name in ("betas", "omegas"):
            if values.get(name) is not None:
                values[name] = tuple(values[name])
        return cls(**values)

    def differences(self, other: TrainConfig) -> list[str]:
        """Fields (outside RESUMABLE_FIELDS) whose values differ, as 'name: a -> b'."""
        mine, theirs = self.to_dict(), other.to_dict()
        return [
            f"{name}: {mine[name]!r} -> {theirs[name]!r}"
            for name in mine
            if name not in RESUMABLE_FIELDS and mine[name] != theirs[name]
        ]


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(
            f"--{_flag(name)}: unknown value {value!r}; choose from {', '.join(choices)}"
        )


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"--{_flag(name)} must be a positive integer, got {value!r}")


def _non_negative(name: str, value) -> None:
    if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
        raise ValueError(f"--{_flag(name)} must be a finite number >= 0, got {value!r}")


def _jsonable(value):
    return list(value) if isinstance(value, tuple) else value
