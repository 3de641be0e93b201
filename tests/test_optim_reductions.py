"""Special cases that must hold exactly: AdamW, QHAdam, ADOPT and EMA-momentum SGD.

The known optimizers below are written out literally from their papers / official code, in
float64, with decoupled weight decay and a learning rate that changes on every step.
"""

from __future__ import annotations

import math

import pytest
import torch

from mtdao import MTSGD, MTAdam, MTAdopt

SHAPES = [(), (6,), (4, 3)]
STEPS = 80
WEIGHT_DECAY = 0.05
# How each implementation is asked for (see MultiTimescaleOptimizer): the tensors where they are,
# or in flat buffers, each with every kind of kernel.
KERNELS = {"fused": dict(fused=True), "foreach": dict(foreach=True), "loop": dict(foreach=False)}
PATHS = {name: dict(flat=False, **options) for name, options in KERNELS.items()}
PATHS.update({f"flat-{name}": dict(flat=True, **options) for name, options in KERNELS.items()})


def lr_at(step: int, peak: float) -> float:
    return peak * (0.6 + 0.4 * math.cos(0.37 * step))


def initial_params() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in SHAPES]


def gradients(step: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Deterministic per step, and dependent on the parameters (so the trajectories interact)."""
    generator = torch.Generator().manual_seed(1000 + step)
    scale = 15.0 if step % 11 == 5 else 1.0  # occasional spikes: exercises ADOPT's clip
    return [
        scale * (torch.randn(x.shape, generator=generator, dtype=torch.float64) + 0.3 * x)
        for x in params
    ]


def run_optimizer(make_optimizer, peak_lr: float) -> list[torch.Tensor]:
    params = [x.clone().requires_grad_(True) for x in initial_params()]
    optimizer = make_optimizer(params)
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, peak_lr)
        for p, g in zip(params, gradients(step, [p.detach() for p in params])):
            p.grad = g
        optimizer.step()
    return [p.detach() for p in params]


def run_literal(update, peak_lr: float) -> list[torch.Tensor]:
    """Run ``update(x, g, state, lr, t) -> x`` (in place on ``state``), t counted from 1."""
    params = initial_params()
    states = [{} for _ in params]
    for step in range(STEPS):
        lr = lr_at(step, peak_lr)
        grads = gradients(step, params)
        params = [update(x, g, s, lr, step + 1) for x, g, s in zip(params, grads, states)]
    return params


def assert_trajectories_match(actual, expected, exact: bool = False):
    moved = [not torch.allclose(x, x0) for x, x0 in zip(expected, initial_params())]
    assert all(moved)
    for a, e in zip(actual, expected):
        if exact:
            assert torch.equal(a, e), (a - e).abs().max()
        else:
            torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------------------------
# N = 1, w_1 = 1 is AdamW
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(PATHS))
def test_mtadam_one_momentum_full_weight_is_adamw(path):
    hyper = dict(eps=1e-8, weight_decay=WEIGHT_DECAY)
    kernel = path.removeprefix("flat-")
    torch_path = dict(foreach=False) if kernel == "loop" else KERNELS[kernel]
    expected = run_optimizer(
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.8, 0.99), **hyper, **torch_path), 1e-2
    )
    actual = run_optimizer(
        lambda ps: MTAdam(
            ps, lr=1e-2, betas=(0.8,), omegas=(1.0,), beta2=0.99, **hyper, **PATHS[path]
        ),
        1e-2,
    )
    # foreach and loop: the same operations in the same order as torch's AdamW, equal to the last
    # bit (also over flat buffers); fused: compiled code against torch's hand-written kernel, equal
    # to float rounding.
    assert_trajectories_match(actual, expected, exact=kernel != "fused")


# --------------------------------------------------------------------------------------------
# N = 1, w_1 = nu is QHAdam (Ma & Yarats, ICLR 2019) with nu2 = 1
# --------------------------------------------------------------------------------------------


def qhadam_update(beta1, beta2, nu1, nu2, eps, weight_decay):
    """QHAdam, Algorithm in §3 of Ma & Yarats (2019), plus AdamW-style decoupled weight decay:

    g_{t+1} = b1 g_t + (1 - b1) grad,     s_{t+1} = b2 s_t + (1 - b2) grad^2
    g' = g_{t+1} / (1 - b1^t),            s' = s_{t+1} / (1 - b2^t)
    theta -= lr [(1 - nu1) grad + nu1 g'] / (sqrt((1 - nu2) grad^2 + nu2 s') + eps)
    """

    def update(x, grad, state, lr, t):
        first = state.get("g", torch.zeros_like(x))
        second = state.get("s", torch.zeros_like(x))
        x = x * (1 - lr * weight_decay)
        first = beta1 * first + (1 - beta1) * grad
        second = beta2 * second + (1 - beta2) * grad * grad
        first_hat = first / (1 - beta1**t)
        second_hat = second / (1 - beta2**t)
        numerator = (1 - nu1) * grad + nu1 * first_hat
        denominator = torch.sqrt((1 - nu2) * grad * grad + nu2 * second_hat) + eps
        state["g"], state["s"] = first, second
        return x - lr * numerator / denominator

    return update


@pytest.mark.parametrize("nu", [0.0, 0.7, 0.9])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_mtadam_one_momentum_is_qhadam(path, nu):
    expected = run_literal(qhadam_update(0.995, 0.999, nu, 1.0, 1e-8, WEIGHT_DECAY), 1e-2)
    actual = run_optimizer(
        lambda ps: MTAdam(
            ps,
            lr=1e-2,
            betas=(0.995,),
            omegas=(nu,),
            beta2=0.999,
            eps=1e-8,
            weight_decay=WEIGHT_DECAY,
            **PATHS[path],
        ),
        1e-2,
    )
    assert_trajectories_match(actual, expected)


# --------------------------------------------------------------------------------------------
# N = 1, w_1 = 1 is ADOPT with its default clipping (Taniguchi et al., NeurIPS 2024)
# --------------------------------------------------------------------------------------------
# torch 2.13's torch.optim has no ADOPT (it has Adam, AdamW, NAdam, RAdam, Adafactor, Muon, ...),
# so this is a literal port of the official single-tensor step (github.com/iShohei220/adopt,
# clip_lambda = step**0.25, decoupled weight decay). Some third-party copies count the step from 0
# (clip 1 on the second call) and skip weight decay on the first call; the official code and
# the algorithm count from 1 and decay on every call.


def adopt_update(beta1, beta2, eps, weight_decay, clip_lambda=lambda step: step**0.25):
    def update(param, grad, state, lr, step):
        exp_avg = state.setdefault("exp_avg", torch.zeros_like(param))
        exp_avg_sq = state.setdefault("exp_avg_sq", torch.zeros_like(param))
        param = param.clone()
        param.mul_(1 - lr * weight_decay)
        if step == 1:
            exp_avg_sq.addcmul_(grad, grad)
            return param
        denom = torch.clamp(exp_avg_sq.sqrt(), eps)
        normed_grad = grad.div(denom)
        if clip_lambda is not None:
            clip = clip_lambda(step)
            normed_grad.clamp_(-clip, clip)
        exp_avg.lerp_(normed_grad, 1 - beta1)
        param.add_(exp_avg, alpha=-lr)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        return param

    return update


@pytest.mark.parametrize("clip", [True, False], ids=["clip", "noclip"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_mtadopt_one_momentum_full_weight_is_adopt(path, clip):
    clip_lambda = (lambda step: step**0.25) if clip else None
    expected = run_literal(adopt_update(0.9, 0.9999, 1e-6, WEIGHT_DECAY, clip_lambda), 1e-2)
    actual = run_optimizer(
        lambda ps: MTAdopt(
            ps,
            lr=1e-2,
            betas=(0.9,),
            omegas=(1.0,),
            beta2=0.9999,
            eps=1e-6,
            weight_decay=WEIGHT_DECAY,
            clip=clip,
            **PATHS[path],
        ),
        1e-2,
    )
    assert_trajectories_match(actual, expected)


def test_adopt_clip_is_active_in_this_setup():
    """Guard for the test above: with and without the clip the trajectories differ."""
    clipped = run_literal(adopt_update(0.9, 0.9999, 1e-6, WEIGHT_DECAY), 1e-2)
    unclipped = run_literal(adopt_update(0.9, 0.9999, 1e-6, WEIGHT_DECAY, None), 1e-2)
    assert any(not torch.allclose(a, b) for a, b in zip(clipped, unclipped))


# --------------------------------------------------------------------------------------------
# MTSGD, N = 1, w_1 = 1 is EMA-momentum SGD
# --------------------------------------------------------------------------------------------


def ema_sgd_update(beta, weight_decay):
    """u = beta u + (1 - beta) g;  x -= lr u  (decoupled weight decay first)."""

    def update(x, grad, state, lr, t):
        momentum = state.get("u", torch.zeros_like(x))
        momentum = beta * momentum + (1 - beta) * grad
        state["u"] = momentum
        return x * (1 - lr * weight_decay) - lr * momentum

    return update


@pytest.mark.parametrize("path", sorted(PATHS))
def test_mtsgd_one_momentum_full_weight_is_ema_sgd(path):
    expected = run_literal(ema_sgd_update(0.9, WEIGHT_DECAY), 5e-2)
    actual = run_optimizer(
        lambda ps: MTSGD(
            ps, lr=5e-2, betas=(0.9,), omegas=(1.0,), weight_decay=WEIGHT_DECAY, **PATHS[path]
        ),
        5e-2,
    )
    assert_trajectories_match(actual, expected)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_mtsgd_zero_weight_is_plain_sgd(path):
    """omegas=(0,) leaves only the raw gradient: torch.optim.SGD without momentum."""
    expected = run_optimizer(lambda ps: torch.optim.SGD(ps, lr=5e-2), 5e-2)
    actual = run_optimizer(
        lambda ps: MTSGD(ps, lr=5e-2, betas=(0.9,), omegas=(0.0,), **PATHS[path]), 5e-2
    )
    assert_trajectories_match(actual, expected)
