"""Each named method as one short function of its parts: the base optimizer, the sync policy and
the outer step, as optax's ``adamw`` chains its transformations. The policy reads the optimizer's
decays (half-life periods, DeSLoc without a second moment), so a recipe takes the optimizer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

from torch.optim import Optimizer

from mtdao.methods.checks import check_method
from mtdao.methods.config import SyncConfig
from mtdao.methods.defaults import DEFAULT_SYNC_PERIOD, default_outer_step
from mtdao.methods.table import METHOD_TABLE, SYNC_POLICIES
from mtdao.sync import policy as policies
from mtdao.sync.codecs.compression import SyncCodecs
from mtdao.sync.communicator import Communicator
from mtdao.sync.engine import LocalUpdateSync
from mtdao.sync.policy import OuterOptimizerConfig, SyncPolicy, SyncRule


class MethodParts(NamedTuple):
    """What a method is made of."""

    optimizer: Optimizer
    """The base optimizer, stepping each worker locally."""
    policy: SyncPolicy
    """What is averaged when (gradients every step, or parameters and states by period)."""
    outer: OuterOptimizerConfig | None
    """What each parameter average becomes: DiLoCo's Nesterov outer step (None: the average)."""

    def sync_policy(self) -> SyncPolicy:
        """The policy the engine carries out: :attr:`policy` with the outer step."""
        return self.policy if self.outer is None else replace(self.policy, outer=self.outer)


def ddp(config: SyncConfig, optimizer: Optimizer, total_steps: int | None = None) -> MethodParts:
    """The base optimizer, its gradients averaged before every step."""
    return MethodParts(optimizer, replace(policies.gradient_averaging(), name="ddp"), None)


def qh_ddp(config: SyncConfig, optimizer: Optimizer, total_steps: int | None = None) -> MethodParts:
    """The MT-DAO optimizer (slow momenta mixed with the gradient), gradients averaged every
    step."""
    return MethodParts(optimizer, replace(policies.gradient_averaging(), name="qh-ddp"), None)


def local_adam(
    config: SyncConfig, optimizer: Optimizer, total_steps: int | None = None
) -> MethodParts:
    """The base optimizer; parameters and every state averaged every K."""
    return _local(config, optimizer, total_steps)


def diloco(config: SyncConfig, optimizer: Optimizer, total_steps: int | None = None) -> MethodParts:
    """The base optimizer kept local; every K steps a Nesterov outer step on the parameters'
    average."""
    params = SyncRule(policies.check_period(config.sync_period))
    policy = SyncPolicy(params=params, name=f"diloco(K={config.sync_period})")
    return MethodParts(optimizer, policy, outer_step_of(config, total_steps))


def desloc(config: SyncConfig, optimizer: Optimizer, total_steps: int | None = None) -> MethodParts:
    """The base optimizer; parameters every K, momenta every 3K, the second moment every 6K."""
    return _local(config, optimizer, total_steps)


def mtdao(config: SyncConfig, optimizer: Optimizer, total_steps: int | None = None) -> MethodParts:
    """The MT-DAO optimizer; parameters and states every K, or each state by its half-life."""
    return _local(config, optimizer, total_steps)


RECIPES: dict[str, Callable[..., MethodParts]] = {
    "ddp": ddp,
    "qh-ddp": qh_ddp,
    "local-adam": local_adam,
    "diloco": diloco,
    "desloc": desloc,
    "mtdao": mtdao,
}


def method_parts(
    config: SyncConfig, optimizer: Optimizer, total_steps: int | None = None
) -> MethodParts:
    """The parts of ``config``'s method over ``optimizer``; ``total_steps``: the run's length,
    which an outer momentum decay needs."""
    check_method(config)
    if config.sync_period is None:  # not resolved: K's default for one worker
        config = replace(config, sync_period=DEFAULT_SYNC_PERIOD)
    # not resolved: the outer step's defaults for one worker (a resolved config's own values)
    config = replace(config, **default_outer_step(config, workers=1))
    return RECIPES[config.method](config, optimizer, total_steps)


def build_sync(
    config: SyncConfig,
    optimizer: Optimizer,
    communicator: Communicator,
    clip_gradients: Callable[[], object] | None = None,
    total_steps: int | None = None,
) -> LocalUpdateSync:
    """The engine carrying out a resolved config's method over ``communicator``;
    ``clip_gradients`` runs between gradient averaging and each step (on each worker)."""
    if config.sync_period is None:  # not resolved: the defaults for the communicator's workers
        config = config.resolved(communicator.num_workers)
    parts = method_parts(config, optimizer, total_steps)
    sync = LocalUpdateSync(
        optimizer,
        parts.sync_policy(),
        communicator,
        on_non_finite=config.on_non_finite,
        track_alignment=config.track_alignment,
        fragments=config.sync_fragments,
        delay=config.sync_delay,
        codecs=SyncCodecs.parse(config.sync_dtype or (), config.error_feedback),
        radial_directional=config.radial_directional,
    )
    if clip_gradients is not None:
        sync.register_gradient_hook(clip_gradients)
    return sync


def outer_step_of(
    config: SyncConfig, total_steps: int | None = None
) -> OuterOptimizerConfig | None:
    """DiLoCo's outer step, or one a local method adds with ``outer_step="nesterov"``, with its
    momentum's warm-up and (over the last part of a run of ``total_steps``) decay."""
    if not (METHOD_TABLE[config.method].outer_step or config.outer_step == "nesterov"):
        return None
    decay_from = decay_to = None
    if config.outer_momentum_decay > 0:
        if total_steps is None:
            raise ValueError("`outer_momentum_decay` needs the run's total steps to end at")
        decay_to = total_steps
        decay_from = min(round(total_steps * (1 - config.outer_momentum_decay)), total_steps - 1)
    return OuterOptimizerConfig(
        lr=config.outer_lr,
        momentum=config.outer_momentum,
        momentum_warmup=config.outer_momentum_warmup,
        momentum_start=config.outer_momentum_start,
        momentum_decay_from=decay_from,
        momentum_decay_to=decay_to,
        momentum_final=config.outer_momentum_final,
    )


def _local(config: SyncConfig, optimizer: Optimizer, total_steps: int | None) -> MethodParts:
    """A local method: its period rule (or ``sync_policy``'s), every state on
    ``state_sync_period`` if given, an outer step if ``outer_step`` asks for one."""
    rule = config.sync_policy or METHOD_TABLE[config.method].period_rule
    policy = _period_rule(rule, config.sync_period, optimizer)
    if config.state_sync_period is not None:
        policy = policies.with_state_period(policy, config.state_sync_period)
    return MethodParts(optimizer, policy, outer_step_of(config, total_steps))


def _period_rule(rule: str | None, sync_period: int, optimizer: Optimizer) -> SyncPolicy:
    if rule == "unified":
        return policies.unified(sync_period)
    if rule == "desloc":
        built = policies.desloc(sync_period)
        if "exp_avg_sq" not in policies.state_decays(optimizer):  # SGDM: no second moment
            built = replace(built, states={})
        return built
    if rule == "half-life":
        return policies.half_life_policy(sync_period, policies.state_decays(optimizer))
    raise ValueError(
        f"`sync_policy`: unknown value {rule!r}; choose from {', '.join(SYNC_POLICIES)}"
    )
