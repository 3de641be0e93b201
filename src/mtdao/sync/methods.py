"""The compared methods (SPEC §4) as settings of one machinery: a base optimizer plus a policy.

| method      | optimizer                    | what is averaged                                   |
|-------------|------------------------------|----------------------------------------------------|
| ddp         | Adam / ADOPT / SGDM (b1=0.9) | gradients, every step                              |
| qh-ddp      | MT-DAO optimizer             | gradients, every step                              |
| local-adam  | Adam / ADOPT / SGDM          | parameters and all states every K                  |
| diloco      | Adam / ADOPT / SGDM          | parameters every K through a Nesterov outer step   |
| desloc      | Adam / ADOPT / SGDM          | parameters every K, momenta 3K, second moment 6K   |
| mtdao       | MT-DAO optimizer             | parameters and states, unified or half-life        |
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from torch.optim import Optimizer

from mtdao.optim import MTSGD, MTAdam, MTAdopt
from mtdao.sync import policy as policies
from mtdao.sync.policy import OuterOptimizerConfig, SyncPolicy

METHODS = ("ddp", "qh-ddp", "local-adam", "diloco", "desloc", "mtdao")
BASE_OPTIMIZERS = ("adam", "adopt", "sgdm")
SYNC_POLICIES = ("unified", "half-life", "desloc")

# Methods whose optimizer is the multi-timescale one; the others use the plain base optimizer
# (one momentum with weight 1, which is exactly AdamW / ADOPT / EMA-SGDM).
MULTI_TIMESCALE_METHODS = ("qh-ddp", "mtdao")
GRADIENT_AVERAGING_METHODS = ("ddp", "qh-ddp")


@dataclass(frozen=True)
class OptimizerSettings:
    """Hyperparameters of the base optimizer; None means the method's default."""

    name: str = "adam"
    lr: float = 3e-3
    betas: tuple[float, ...] | None = None
    omegas: tuple[float, ...] | None = None
    beta2: float | None = None
    eps: float | None = None
    weight_decay: float = 0.0


# Fast momentum of the baselines and the slow one of MT-DAO, per base optimizer. MT-DAO-Adam's
# (0.95, 0.7) is the best of the settings measured at CPU scale (BENCHMARKS.md §4); slower momenta
# (0.99 .. 0.999, the paper's) lost there and need longer horizons. ADOPT keeps the paper's code
# defaults (0.999, 0.9).
BASELINE_BETAS = {"adam": (0.9,), "adopt": (0.9,), "sgdm": (0.9,)}
MTDAO_BETAS = {"adam": (0.95,), "adopt": (0.999,), "sgdm": (0.99,)}
MTDAO_OMEGAS = {"adam": (0.7,), "adopt": (0.9,), "sgdm": (0.9,)}
DEFAULT_BETA2 = {"adam": 0.95, "adopt": 0.9999}
DEFAULT_EPS = {"adam": 1e-8, "adopt": 1e-6}


def check_method(method: str, optimizer: str) -> None:
    if method not in METHODS:
        raise ValueError(f"Unknown method {method!r}; choose from {', '.join(METHODS)}")
    if optimizer not in BASE_OPTIMIZERS:
        raise ValueError(
            f"Unknown optimizer {optimizer!r}; choose from {', '.join(BASE_OPTIMIZERS)}"
        )


def resolve_settings(method: str, settings: OptimizerSettings) -> OptimizerSettings:
    """Fill the method's defaults into every hyperparameter left as None."""
    check_method(method, settings.name)
    multi = method in MULTI_TIMESCALE_METHODS
    betas = settings.betas or (MTDAO_BETAS if multi else BASELINE_BETAS)[settings.name]
    if settings.omegas is not None:
        omegas = settings.omegas
    elif multi and settings.betas is None:
        omegas = MTDAO_OMEGAS[settings.name]
    elif multi:  # user's own momenta: share 0.9 equally among them
        omegas = tuple(0.9 / len(betas) for _ in betas)
    else:
        omegas = (1.0,) * len(betas) if len(betas) == 1 else tuple(1.0 / len(betas) for _ in betas)
    beta2 = settings.beta2 if settings.beta2 is not None else DEFAULT_BETA2.get(settings.name)
    eps = settings.eps if settings.eps is not None else DEFAULT_EPS.get(settings.name)
    return replace(settings, betas=tuple(betas), omegas=tuple(omegas), beta2=beta2, eps=eps)


def build_optimizer(param_groups: Iterable, settings: OptimizerSettings) -> Optimizer:
    """The optimizer for resolved ``settings`` (see :func:`resolve_settings`)."""
    common = dict(
        lr=settings.lr,
        betas=settings.betas,
        omegas=settings.omegas,
        weight_decay=settings.weight_decay,
    )
    if settings.name == "adam":
        return MTAdam(param_groups, beta2=settings.beta2, eps=settings.eps, **common)
    if settings.name == "adopt":
        return MTAdopt(param_groups, beta2=settings.beta2, eps=settings.eps, **common)
    if settings.name == "sgdm":
        return MTSGD(param_groups, **common)
    raise ValueError(f"Unknown optimizer {settings.name!r}; choose from {BASE_OPTIMIZERS}")


def build_policy(
    method: str,
    sync_period: int,
    optimizer: Optimizer,
    sync_policy: str | None = None,
    outer: OuterOptimizerConfig | None = None,
) -> SyncPolicy:
    """The sync policy of ``method``; ``sync_policy`` overrides the period rule of local methods."""
    if method in GRADIENT_AVERAGING_METHODS:
        if sync_policy is not None:
            raise ValueError(
                f"{method} averages gradients every step; a sync policy does not apply"
            )
        return replace(policies.gradient_averaging(), name=method)
    if method == "diloco":
        if sync_policy is not None:
            raise ValueError("diloco keeps optimizer states local; a sync policy does not apply")
        return SyncPolicy(
            params=policies.SyncRule(policies.check_period(sync_period)),
            outer=outer or OuterOptimizerConfig(),
            name=f"diloco(K={sync_period})",
        )
    default = "desloc" if method == "desloc" else "unified"
    rule = sync_policy or default
    if rule == "unified":
        built = policies.unified(sync_period, outer=outer)
    elif rule == "desloc":
        built = policies.desloc(sync_period, outer=outer)
        if "exp_avg_sq" not in policies.state_decays(optimizer):  # SGDM: no second moment
            built = replace(built, states={})
    elif rule == "half-life":
        built = policies.half_life_policy(
            sync_period, policies.state_decays(optimizer), outer=outer
        )
    else:
        raise ValueError(f"Unknown sync policy {rule!r}; choose from {', '.join(SYNC_POLICIES)}")
    return built
