"""torch.optim.Optimizer behaviour, dtypes, validation and the timescale helpers."""

from __future__ import annotations

import copy
import io
import re
import warnings
from functools import partial

import optimizer_cases as cases
import pytest
import torch

from mtdao import MTSGD, MTAdam, MTAdopt, beta_for_half_life, half_life
from mtdao.optim.reference import initial_state, mt_adam_reference
from mtdao.timescales import weight_left

OPTIMIZERS = {
    "adam": lambda ps: MTAdam(ps, lr=1e-2, weight_decay=0.01),
    "adam-n2": lambda ps: MTAdam(ps, lr=1e-2, betas=(0.9, 0.999), omegas=(0.4, 0.5)),
    "adopt": lambda ps: MTAdopt(ps, lr=1e-2, weight_decay=0.01),
    "sgd": lambda ps: MTSGD(ps, lr=1e-2, betas=(0.9, 0.99), omegas=(0.5, 0.3)),
}


SHAPES = [(), (5,), (3, 4)]
GRADIENTS = dict(drawn_in=torch.float32, pull=0.5)  # deterministic in the step, and in the params
make_params = partial(cases.make_params, shapes=SHAPES, drawn_in=torch.float32)
set_gradients = partial(cases.set_gradients, **GRADIENTS)
train = partial(cases.train, **GRADIENTS)


# --------------------------------------------------------------------------------------------
# torch.optim.Optimizer behaviour
# --------------------------------------------------------------------------------------------


def test_per_group_hyperparameters_even_different_n():
    fast, slow = make_params(torch.float64)[1:]
    groups = [
        {"params": [fast], "lr": 3e-2, "betas": (0.9,), "omegas": (0.8,)},
        {"params": [slow], "betas": (0.5, 0.99, 0.999), "omegas": (0.2, 0.3, 0.4)},
    ]
    optimizer = MTAdam(groups, lr=1e-2, beta2=0.99, weight_decay=0.1)
    references = {}
    for group in optimizer.param_groups:
        (p,) = group["params"]
        references[p] = (p.detach().clone(), initial_state(p.detach(), len(group["betas"])))
    for step in range(10):
        set_gradients([fast, slow], step)
        for group in optimizer.param_groups:
            (p,) = group["params"]
            x, state = references[p]
            hyper = {k: group[k] for k in ("lr", "betas", "omegas", "beta2", "eps", "weight_decay")}
            references[p] = mt_adam_reference(x, p.grad, state, **hyper)
        optimizer.step()
    assert set(optimizer.state[fast]) == {"step", "exp_avg_0", "exp_avg_sq"}
    assert set(optimizer.state[slow]) == {
        "step",
        "exp_avg_0",
        "exp_avg_1",
        "exp_avg_2",
        "exp_avg_sq",
    }
    for p, (x, _) in references.items():
        torch.testing.assert_close(p.detach(), x, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_lr_scheduler_drives_the_step(name):
    params = make_params()
    optimizer = OPTIMIZERS[name](params)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10, eta_min=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for step in range(10):
            train(optimizer, params, 1, first_step=step)
            scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
    # at lr = 0 a step changes nothing (weight decay is lr-scaled too)
    before = [p.detach().clone() for p in params]
    train(optimizer, params, 1, first_step=10)
    assert all(torch.equal(p, b) for p, b in zip(params, before))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_closure_loss_and_zero_grad(name):
    params = make_params()
    optimizer = OPTIMIZERS[name](params)

    def closure():
        optimizer.zero_grad()
        loss = sum((p * p).sum() for p in params)
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert isinstance(loss, torch.Tensor)
    assert loss.item() == pytest.approx(
        sum((p.detach() ** 2).sum().item() for p in params), rel=0.5
    )
    assert optimizer.step() is None
    optimizer.zero_grad()
    assert all(p.grad is None for p in params)
    before = [p.detach().clone() for p in params]
    steps = [optimizer.state[p]["step"].item() for p in params]
    optimizer.step()  # nothing has a gradient: nothing moves, no step is counted
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert [optimizer.state[p]["step"].item() for p in params] == steps


def test_params_without_gradient_are_skipped_and_keep_their_own_step():
    params = make_params(torch.float64)
    optimizer = MTAdam(params, lr=1e-2, betas=(0.9,), omegas=(0.7,), weight_decay=0.1)
    hyper = dict(lr=1e-2, betas=(0.9,), omegas=(0.7,), beta2=0.999, eps=1e-8, weight_decay=0.1)
    references = [(p.detach().clone(), initial_state(p.detach(), 1)) for p in params]
    frozen = params[1]
    for step in range(6):
        set_gradients(params, step)
        if step < 3:
            frozen.grad = None  # frozen for the first three steps
        for i, p in enumerate(params):
            if p.grad is not None:
                x, state = references[i]
                references[i] = mt_adam_reference(x, p.grad, state, **hyper)
        optimizer.step()
        if step < 3:
            assert frozen not in optimizer.state or len(optimizer.state[frozen]) == 0
    assert optimizer.state[params[0]]["step"].item() == 6
    assert optimizer.state[frozen]["step"].item() == 3  # its bias correction counts its own steps
    for p, (x, _) in zip(params, references):
        torch.testing.assert_close(p.detach(), x, rtol=1e-12, atol=1e-14)


@pytest.mark.exact
@pytest.mark.parametrize("through_file", [False, True], ids=["in-memory", "torch.save"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_dict_round_trip_continues_bit_identically(name, through_file):
    # uninterrupted run: 12 steps
    params = make_params()
    optimizer = OPTIMIZERS[name](params)
    train(optimizer, params, 5)
    snapshot_params = [p.detach().clone() for p in params]
    saved = copy.deepcopy(optimizer.state_dict())
    train(optimizer, params, 7, first_step=5)

    # interrupted run: a fresh optimizer over fresh parameter copies, state loaded, 7 more steps
    if through_file:
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
    resumed = [x.clone().requires_grad_(True) for x in snapshot_params]
    resumed_optimizer = OPTIMIZERS[name](resumed)
    resumed_optimizer.load_state_dict(saved)
    train(resumed_optimizer, resumed, 7, first_step=5)

    for p, q in zip(params, resumed):
        assert torch.equal(p, q)
        state, resumed_state = optimizer.state[p], resumed_optimizer.state[q]
        assert set(state) == set(resumed_state)
        for key in state:
            assert torch.equal(state[key], resumed_state[key]), key


def test_state_dict_is_positional():
    params = make_params()
    optimizer = MTAdam(
        [{"params": params[:2]}, {"params": params[2:], "betas": (0.9, 0.99), "omegas": (0.5, 0.5)}]
    )
    train(optimizer, params, 2)
    state_dict = optimizer.state_dict()
    assert sorted(state_dict["state"]) == [0, 1, 2]
    assert [g["params"] for g in state_dict["param_groups"]] == [[0, 1], [2]]
    assert set(state_dict["state"][2]) == {"step", "exp_avg_0", "exp_avg_1", "exp_avg_sq"}
    assert state_dict["param_groups"][1]["betas"] == (0.9, 0.99)


# --------------------------------------------------------------------------------------------
# dtypes and unsupported inputs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_low_precision_params_keep_float32_state(name, dtype):
    params = make_params(dtype)
    before = [p.detach().clone() for p in params]
    optimizer = OPTIMIZERS[name](params)
    # updates below half a bf16 ulp of the parameter are rounded away: take visible steps
    optimizer.param_groups[0]["lr"] = 0.1
    train(optimizer, params, 4)
    assert all(p.dtype == dtype for p in params)
    assert all(not torch.equal(p, b) for p, b in zip(params, before))
    for p in params:
        for key, value in optimizer.state[p].items():
            assert value.dtype == torch.float32, key
            assert torch.isfinite(value).all()

    saved = copy.deepcopy(optimizer.state_dict())
    resumed = [p.detach().clone().requires_grad_(True) for p in params]
    resumed_optimizer = OPTIMIZERS[name](resumed)
    resumed_optimizer.load_state_dict(saved)
    for i, q in enumerate(resumed):
        for key, value in resumed_optimizer.state[q].items():
            assert value.dtype == torch.float32, key
            assert torch.equal(value, saved["state"][i][key]), key
    train(optimizer, params, 3, first_step=4)
    train(resumed_optimizer, resumed, 3, first_step=4)
    assert all(torch.equal(p, q) for p, q in zip(params, resumed))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sparse_gradient_is_a_clear_error(name):
    param = torch.zeros(4, 3, requires_grad=True)
    optimizer = OPTIMIZERS[name]([param])
    param.grad = torch.eye(4, 3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        optimizer.step()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_complex_param_is_a_clear_error(name):
    param = torch.zeros(3, dtype=torch.complex64, requires_grad=True)
    with pytest.raises(ValueError, match="complex"):
        OPTIMIZERS[name]([param])


# --------------------------------------------------------------------------------------------
# validation: every bad hyperparameter raises ValueError naming the value
# --------------------------------------------------------------------------------------------

ALL_CLASSES = [MTAdam, MTAdopt, MTSGD]
BAD_COMMON = [
    (dict(betas=(1.0,), omegas=(0.5,)), "1.0"),
    (dict(betas=(-0.1,), omegas=(0.5,)), "-0.1"),
    (dict(betas=(0.9, 1.5), omegas=(0.5, 0.1)), "1.5"),
    (dict(lr=-0.001), "-0.001"),
    (dict(weight_decay=-0.25), "-0.25"),
    (dict(betas=(0.9, 0.99), omegas=(0.5,)), "(0.5,)"),
    (dict(betas=(0.9,), omegas=(-0.2,)), "-0.2"),
    (dict(betas=(0.9, 0.99), omegas=(0.75, 0.5)), "1.25"),
    (dict(betas=(), omegas=()), "()"),
]
BAD_ADAPTIVE = [(dict(beta2=1.0), "1.0"), (dict(beta2=-0.5), "-0.5"), (dict(eps=-1e-08), "-1e-08")]


def construct(optimizer_class, **kwargs):
    param = torch.zeros(3, requires_grad=True)
    kwargs.setdefault("lr", 1e-3)
    return optimizer_class([param], **kwargs)


@pytest.mark.parametrize("optimizer_class", ALL_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize(("kwargs", "bad_value"), BAD_COMMON, ids=lambda x: str(x))
def test_invalid_hyperparameter_raises(optimizer_class, kwargs, bad_value):
    with pytest.raises(ValueError, match=re.escape(bad_value)):
        construct(optimizer_class, **kwargs)


@pytest.mark.parametrize("optimizer_class", [MTAdam, MTAdopt], ids=lambda c: c.__name__)
@pytest.mark.parametrize(("kwargs", "bad_value"), BAD_ADAPTIVE, ids=lambda x: str(x))
def test_invalid_adaptive_hyperparameter_raises(optimizer_class, kwargs, bad_value):
    with pytest.raises(ValueError, match=re.escape(bad_value)):
        construct(optimizer_class, **kwargs)


@pytest.mark.parametrize(("kwargs", "bad_value"), BAD_COMMON + BAD_ADAPTIVE, ids=lambda x: str(x))
def test_invalid_param_group_raises_and_is_not_added(kwargs, bad_value):
    optimizer = construct(MTAdam)
    bad_group = {"params": [torch.zeros(2, requires_grad=True)], **kwargs}
    with pytest.raises(ValueError, match=re.escape(bad_value)):
        optimizer.add_param_group(bad_group)
    assert len(optimizer.param_groups) == 1


def test_valid_edge_hyperparameters_are_accepted():
    construct(MTAdam, betas=(0.0,), omegas=(0.0,), lr=0.0, eps=0.0, beta2=0.0)
    construct(MTAdam, betas=(0.9, 0.99, 0.999), omegas=(0.2, 0.3, 0.5))
    construct(MTSGD, betas=(0.9,), omegas=(1.0,))


# --------------------------------------------------------------------------------------------
# timescales
# --------------------------------------------------------------------------------------------


def test_half_life_values():
    assert half_life(0.9) == pytest.approx(6.579, abs=1e-3)
    assert half_life(0.999) == pytest.approx(692.8, abs=0.05)
    assert half_life(0.0) == 0.0


@pytest.mark.parametrize("beta", [0.5, 0.9, 0.95, 0.99, 0.999, 0.9999])
def test_beta_for_half_life_inverts_half_life(beta):
    assert beta_for_half_life(half_life(beta)) == pytest.approx(beta, rel=1e-12)
    assert beta ** half_life(beta) == pytest.approx(0.5, rel=1e-12)


# Timescales to the printed precision: beta | half-life (steps) | weight left after 32 steps
TIMESCALE_TABLE = [
    ("0.9", "6.6", "0.034"),
    ("0.95", "13.5", "0.19"),
    ("0.99", "69", "0.72"),
    ("0.995", "138", "0.85"),
    ("0.999", "693", "0.97"),
    ("0.9999", "6931", "0.997"),
]


def decimals(printed: str) -> int:
    return len(printed.partition(".")[2])


@pytest.mark.parametrize(("beta", "steps", "left"), TIMESCALE_TABLE)
def test_timescale_table(beta, steps, left):
    assert f"{half_life(float(beta)):.{decimals(steps)}f}" == steps
    assert f"{weight_left(float(beta), 32):.{decimals(left)}f}" == left


@pytest.mark.parametrize("beta", [1.0, -0.1, 1.5, float("nan")])
def test_half_life_rejects_invalid_beta(beta):
    with pytest.raises(ValueError):
        half_life(beta)


@pytest.mark.parametrize("steps", [0.0, -3.0, float("inf"), float("nan")])
def test_beta_for_half_life_rejects_invalid_steps(steps):
    with pytest.raises(ValueError):
        beta_for_half_life(steps)
