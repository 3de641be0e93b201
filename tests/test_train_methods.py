"""The compared methods: their defaults, and identical data on M workers == one worker."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from mtdao import MTSGD, MTAdam, MTAdopt
from mtdao.methods import SyncConfig, method_parts
from mtdao.methods.optimizers import BASE_OPTIMIZERS, build_optimizer
from mtdao.methods.recipes import RECIPES
from mtdao.methods.table import METHODS
from mtdao.sync import LocalUpdateSync, SimulatedWorkers, SingleWorker
from mtdao.train.config import TrainConfig, resolve

D_IN, D_OUT, BATCH = 5, 2, 16
SYNC_PERIOD, STEPS = 2, 13  # rounds at even steps; desloc's second moment syncs at step 12
LR = {"adam": 2e-2, "adopt": 2e-2, "sgdm": 5e-2}


def batch(step: int) -> tuple[Tensor, Tensor]:
    """Logistic-regression data, the same on every worker."""
    gen = torch.Generator().manual_seed(step)
    inputs = torch.randn(BATCH, D_IN, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 2, (BATCH, D_OUT), generator=gen).to(torch.float64)
    return inputs, labels


def loss_fn(weight: Tensor, bias: Tensor, inputs: Tensor, labels: Tensor) -> Tensor:
    """Sum over workers of each worker's mean logistic loss (with or without a worker dim)."""
    logits = torch.einsum("nd,...od->...no", inputs, weight) + bias.unsqueeze(-2)
    per_worker = torch.nn.functional.binary_cross_entropy_with_logits(
        logits, labels.expand_as(logits), reduction="none"
    )
    return per_worker.mean(dim=(-2, -1)).sum()


def run(method: str, base: str, num_workers: int | None) -> tuple[list[Tensor], dict]:
    """Train ``method``; ``num_workers`` None is one unstacked worker (SingleWorker)."""
    gen = torch.Generator().manual_seed(0)
    params = [
        torch.randn(D_OUT, D_IN, generator=gen, dtype=torch.float64),
        torch.randn(D_OUT, generator=gen, dtype=torch.float64),
    ]
    if num_workers is not None:
        params = [p.expand(num_workers, *p.shape).clone() for p in params]
    params = [torch.nn.Parameter(p) for p in params]
    config = resolve(TrainConfig.of(method=method, optimizer=base, lr=LR[base], weight_decay=0.0))
    optimizer = build_optimizer(
        params, config.sync, config.lr_schedule.lr, config.training.weight_decay
    )
    policy = method_policy(method, SYNC_PERIOD, optimizer)
    communicator = SingleWorker() if num_workers is None else SimulatedWorkers(num_workers)
    sync = LocalUpdateSync(optimizer, policy, communicator)
    for step in range(STEPS):
        optimizer.zero_grad()
        loss_fn(*params, *batch(step)).backward()
        sync.step()
    return params, optimizer.state


@pytest.mark.parametrize("base", BASE_OPTIMIZERS)
@pytest.mark.parametrize("method", METHODS)
def test_identical_data_on_every_worker_matches_one_worker(method, base):
    workers = 3
    single_params, single_state = run(method, base, None)
    params, state = run(method, base, workers)
    for param, single in zip(params, single_params):
        assert torch.isfinite(single).all()
        for w in range(workers):
            assert_close(param[w], single.detach(), rtol=1e-10, atol=1e-12)
            for key, value in single_state[single].items():
                if key != "step":
                    assert_close(state[param][key][w], value, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("base", BASE_OPTIMIZERS)
def test_diloco_outer_step_is_not_the_identity(base):
    """Guards the test above: at one worker diloco differs from local-adam only by its outer step."""
    diloco, _ = run("diloco", base, None)
    local, _ = run("local-adam", base, None)
    assert not torch.allclose(diloco[0], local[0], rtol=1e-3, atol=1e-6)
    diloco_m, _ = run("diloco", base, 2)
    assert not torch.allclose(diloco_m[0][0], local[0], rtol=1e-3, atol=1e-6)


def settings(method: str, optimizer: str = "adam", **given) -> tuple:
    config = resolve(TrainConfig.of(method=method, optimizer=optimizer, **given))
    return config.sync.betas, config.sync.omegas, config.sync.beta2, config.sync.eps


def test_resolved_defaults():
    assert settings("ddp") == ((0.9,), (1.0,), 0.95, 1e-8)
    assert settings("mtdao")[:2] == ((0.99,), (0.9,))
    betas, _, beta2, eps = settings("mtdao", "adopt")
    assert (betas, beta2, eps) == ((0.999,), 0.9999, 1e-6)
    betas, omegas, beta2, eps = settings("qh-ddp", "sgdm", betas=(0.9, 0.99))
    assert omegas == pytest.approx((0.45, 0.45))
    assert (beta2, eps) == (None, None)  # SGDM has neither
    assert settings("local-adam", betas=(0.9, 0.99))[1] == (0.5, 0.5)


def test_build_optimizer_types():
    param = torch.nn.Parameter(torch.zeros(3))
    for name, kind in [("adam", MTAdam), ("adopt", MTAdopt), ("sgdm", MTSGD)]:
        config = resolve(TrainConfig.of(method="mtdao", optimizer=name))
        assert type(build_optimizer([param], config.sync, config.lr_schedule.lr)) is kind


def method_policy(method: str, sync_period: int, optimizer, **settings):
    """The policy the engine carries out for ``method`` over ``optimizer``."""
    config = SyncConfig(method=method, sync_period=sync_period, **settings)
    return method_parts(config, optimizer).sync_policy()


def test_each_method_composes_its_optimizer_policy_and_outer_step():
    param = torch.nn.Parameter(torch.zeros(3))
    slow = resolve(TrainConfig.of(method="mtdao", betas=(0.99,), omegas=(0.9,)))
    optimizer = build_optimizer([param], slow.sync, slow.lr_schedule.lr)
    ddp = method_parts(SyncConfig(method="ddp"), optimizer)
    assert ddp.optimizer is optimizer and ddp.outer is None and ddp.policy.name == "ddp"
    assert ddp.policy.average_gradients and ddp.policy.params.period is None
    diloco = method_parts(SyncConfig(method="diloco", sync_period=32), optimizer)
    assert diloco.policy.outer is None and diloco.sync_policy().outer is diloco.outer
    assert (diloco.outer.lr, diloco.outer.momentum) == (0.7, 0.9) and diloco.outer.nesterov
    assert diloco.policy.other_states.period is None
    assert method_policy("mtdao", 32, optimizer).periods()["other states"] == 32
    half_life = method_policy("mtdao", 32, optimizer, sync_policy="half-life")
    # exp_avg_0 decays with 0.99 (tau 69), exp_avg_sq with the default 0.95 (tau 13.5).
    assert half_life.state_rule("exp_avg_0").period == 64
    assert half_life.state_rule("exp_avg_sq").period == 32
    assert method_policy("desloc", 32, optimizer).state_rule("exp_avg_sq").period == 192
    sgdm_config = resolve(TrainConfig.of(method="desloc", optimizer="sgdm"))
    sgdm = build_optimizer([param], sgdm_config.sync, sgdm_config.lr_schedule.lr)
    sgdm_desloc = method_policy("desloc", 32, sgdm)  # no second moment to name
    assert sgdm_desloc.periods() == {"params": 32, "other states": 96}
    nesterov = method_parts(SyncConfig(method="local-adam", outer_step="nesterov"), optimizer)
    assert nesterov.outer is not None and nesterov.sync_policy().params.period == 32


def test_every_method_has_one_recipe():
    assert set(RECIPES) == set(METHODS)


@pytest.mark.parametrize(
    "method, sync_policy, match",
    [
        ("ddp", "unified", "`sync_policy`: ddp does not average optimizer states"),
        ("diloco", "unified", "a sync policy does not apply"),
        ("mtdao", "sometimes", "`sync_policy`: unknown value 'sometimes'"),
        ("fsdp", None, "`method`: unknown value 'fsdp'"),
    ],
)
def test_bad_method_settings_are_refused(method, sync_policy, match):
    optimizer = MTAdam([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match=match):
        method_policy(method, 4, optimizer, sync_policy=sync_policy)
