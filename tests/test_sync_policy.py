"""Sync policies: validation, the period rules, and communication per step (docs/design.md)."""

from __future__ import annotations

import math

import pytest
import torch

from mtdao import MTAdam
from mtdao.sync import (
    LocalUpdateSync,
    OuterOptimizerConfig,
    SimulatedWorkers,
    SyncPolicy,
    SyncRule,
    desloc,
    explicit,
    gradient_averaging,
    half_life_policy,
    keep_local,
    state_decays,
    unified,
)
from mtdao.sync.policy import communication_per_step, half_life_period

MTDAO_ADAM_KEYS = ["step", "exp_avg_0", "exp_avg_sq"]


@pytest.mark.parametrize("period", [0, -1, -32, 2.0, 1.5, "4", True])
def test_bad_periods_are_refused(period):
    for build in (unified, desloc, lambda k: half_life_policy(k, {"exp_avg_0": 0.9})):
        with pytest.raises(ValueError, match="sync period"):
            build(period)
    with pytest.raises(ValueError, match="sync period"):
        SyncRule(period)
    with pytest.raises(ValueError, match="sync period"):
        explicit(params=period)
    with pytest.raises(ValueError, match="sync period"):
        explicit(params=2, states={"exp_avg_sq": period})


def test_none_keeps_a_tensor_local():
    rule = SyncRule(None)
    assert not any(rule.is_due(step) for step in range(1, 100))
    assert [step for step in range(1, 13) if SyncRule(4).is_due(step)] == [4, 8, 12]


def test_counters_and_outer_without_params_are_refused():
    with pytest.raises(ValueError, match="counter"):
        explicit(params=2, states={"step": 2})
    with pytest.raises(ValueError, match="outer optimizer needs a parameter sync period"):
        SyncPolicy(params=SyncRule(None), outer=OuterOptimizerConfig())


@pytest.mark.parametrize("lr, momentum", [(0.0, 0.9), (-0.7, 0.9), (0.7, 1.0), (0.7, -0.1)])
def test_bad_outer_hyperparameters_are_refused(lr, momentum):
    with pytest.raises(ValueError, match="outer"):
        OuterOptimizerConfig(lr=lr, momentum=momentum)


def test_outer_momentum_is_constant_without_a_schedule():
    config = OuterOptimizerConfig(momentum=0.9)
    assert {config.momentum_at(step, 4) for step in range(1, 200)} == {0.9}


def test_outer_momentum_warms_up_over_the_first_syncs_then_decays_to_its_final_value():
    config = OuterOptimizerConfig(
        momentum=0.9,
        momentum_warmup=3,
        momentum_start=0.5,
        momentum_decay_from=80,
        momentum_decay_to=100,
        momentum_final=0.5,
    )
    # syncs 1, 2, 3 ramp (every K = 4 steps), sync 4 reaches 0.9; a delayed or fragment's
    # step counts with the sync it belongs to
    assert config.momentum_at(4, 4) == pytest.approx(0.5, abs=1e-15)
    assert config.momentum_at(3, 4) == pytest.approx(0.5, abs=1e-15)
    assert config.momentum_at(8, 4) == pytest.approx(0.5 + 0.4 / 3, abs=1e-15)
    assert config.momentum_at(12, 4) == pytest.approx(0.5 + 0.8 / 3, abs=1e-15)
    assert config.momentum_at(16, 4) == pytest.approx(0.9, abs=1e-15)
    assert config.momentum_at(80, 4) == pytest.approx(0.9, abs=1e-15)
    assert config.momentum_at(90, 4) == pytest.approx(0.7, abs=1e-15)
    assert config.momentum_at(100, 4) == pytest.approx(0.5, abs=1e-15)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(momentum_start=1.0), "momentum_start"),
        (dict(momentum_final=-0.1), "momentum_final"),
        (dict(momentum_warmup=-1), "momentum_warmup"),
        (dict(momentum_warmup=2.5), "momentum_warmup"),
        (dict(momentum_decay_from=10), "decay steps"),
        (dict(momentum_decay_from=10, momentum_decay_to=10), "decay steps"),
    ],
)
def test_bad_outer_momentum_schedules_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        OuterOptimizerConfig(**settings)


def test_unknown_state_names_are_refused_with_the_valid_names():
    param = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.float64))
    optimizer = MTAdam([param], lr=1e-2, betas=(0.9,), omegas=(1.0,))
    sync = LocalUpdateSync(
        optimizer, explicit(params=2, states={"exp_avg_7": 3}), SimulatedWorkers(2)
    )
    param.grad = torch.ones_like(param)
    with pytest.raises(ValueError, match="exp_avg_7") as error:
        sync.step()
    assert "['exp_avg_0', 'exp_avg_sq']" in str(error.value)


@pytest.mark.parametrize(
    "beta, period",
    [(0.0, 32), (0.9, 32), (0.99, 64), (0.995, 128), (0.999, 512), (0.9999, 512)],
)
def test_half_life_period_follows_the_spec_rule(beta, period):
    # K_s = K * clamp(round(tau(beta) / K), 1, 16); tau(0.99) = 69, tau(0.999) = 693 (capped).
    assert half_life_period(32, beta) == period


def test_half_life_policy_from_optimizer_decays():
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = MTAdam([param], betas=(0.9, 0.99), omegas=(0.5, 0.4), beta2=0.999)
    decays = state_decays(optimizer)
    assert decays == {"exp_avg_0": 0.9, "exp_avg_1": 0.99, "exp_avg_sq": 0.999}
    policy = half_life_policy(32, decays)
    assert policy.periods() == {
        "params": 32,
        "exp_avg_0": 32,
        "exp_avg_1": 64,
        "exp_avg_sq": 512,
        "other states": 32,
    }
    assert half_life_policy(32, decays, max_multiple=4).state_rule("exp_avg_sq").period == 128
    with pytest.raises(ValueError, match="max_multiple"):
        half_life_period(32, 0.9, max_multiple=0)


def test_state_decays_of_torch_optimizers():
    param = torch.nn.Parameter(torch.zeros(3))
    adamw = torch.optim.AdamW([param], betas=(0.8, 0.98))
    assert state_decays(adamw) == {"exp_avg": 0.8, "exp_avg_sq": 0.98}
    sgd = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    assert state_decays(sgd) == {"momentum_buffer": 0.9}
    with pytest.raises(ValueError, match="pass them explicitly"):
        state_decays(torch.optim.SGD([param], lr=0.1))


def test_desloc_periods():
    policy = desloc(32)
    assert policy.params.period == 32
    assert policy.state_rule("exp_avg_0").period == 96
    assert policy.state_rule("exp_avg_1").period == 96
    assert policy.state_rule("exp_avg").period == 96
    assert policy.state_rule("exp_avg_sq").period == 192


def test_communication_per_step_relative_to_ddp():
    unified_rate = communication_per_step(unified(32), MTDAO_ADAM_KEYS)
    assert unified_rate == pytest.approx(3 / 32)
    assert 1 / unified_rate == pytest.approx(10.667, abs=1e-3)

    desloc_rate = communication_per_step(desloc(32), MTDAO_ADAM_KEYS)
    assert desloc_rate == pytest.approx(1 / 32 + 1 / 96 + 1 / 192)
    assert 1 / desloc_rate == pytest.approx(21.333, abs=1e-3)

    diloco = SyncPolicy(params=SyncRule(32), outer=OuterOptimizerConfig())
    assert communication_per_step(diloco, MTDAO_ADAM_KEYS) == pytest.approx(1 / 32)

    assert communication_per_step(gradient_averaging(), MTDAO_ADAM_KEYS) == 1.0
    assert communication_per_step(keep_local(), MTDAO_ADAM_KEYS) == 0.0
    two_momenta = ["step", "exp_avg_0", "exp_avg_1", "exp_avg_sq"]
    assert communication_per_step(unified(32), two_momenta) == pytest.approx(4 / 32)


def test_periods_summary_names_every_rule():
    policy = explicit(params=2, states={"exp_avg_0": 3, "exp_avg_sq": None}, other_states=6)
    assert policy.periods() == {
        "params": 2,
        "exp_avg_0": 3,
        "exp_avg_sq": None,
        "other states": 6,
    }
    assert policy.state_rule("exp_avg_1").period == 6
    assert math.isclose(communication_per_step(policy, MTDAO_ADAM_KEYS), 1 / 2 + 1 / 3)


def test_with_state_period_holds_every_state_at_its_own_period():
    from mtdao.sync.policy import with_state_period

    policy = with_state_period(half_life_policy(128, {"exp_avg_0": 0.999, "exp_avg_sq": 0.95}), 16)
    assert policy.params.period == 128
    assert policy.state_rule("exp_avg_0").period == 16
    assert policy.state_rule("exp_avg_sq").period == 16
    with pytest.raises(ValueError, match="sync period"):
        with_state_period(unified(32), 0)
