"""The fast paths (fused, foreach, for-loop) against the literal reference, and convergence."""

from __future__ import annotations

import math

import pytest
import torch
from optimizer_cases import MOMENTA, OPTIMIZER_CASES

from mtdao import MTSGD, MTAdam, MTAdopt
from mtdao.optim.reference import initial_state

SHAPES = [(), (5,), (3, 4), (2, 3, 2)]
STEPS = 60
WEIGHT_DECAY = 0.1


def lr_at(step: int, peak: float) -> float:
    """A learning rate that changes on every step (warm-up, then cosine decay)."""
    warmup = min(1.0, (step + 1) / 10)
    return peak * warmup * (0.55 + 0.45 * math.cos(math.pi * step / STEPS))


def make_gradient(noise: torch.Tensor, x: torch.Tensor, step: int) -> torch.Tensor:
    """Noise plus a pull towards zero; spikes now and then (to exercise ADOPT's clip) and some
    exact zeros on the first step (ADOPT then divides by eps)."""
    g = noise + 0.5 * x
    if step % 13 == 7:
        g = 20.0 * g
    if step == 0 and g.numel() > 1:
        g = g.clone()
        g.view(-1)[:2] = 0.0
    return g


# How each implementation is asked for (see MultiTimescaleOptimizer): the tensors where they are,
# or in flat buffers, each with every kind of kernel.
KERNELS = {"fused": dict(fused=True), "foreach": dict(foreach=True), "loop": dict(foreach=False)}
PATHS = {name: dict(flat=False, **options) for name, options in KERNELS.items()}
PATHS.update({f"flat-{name}": dict(flat=True, **options) for name, options in KERNELS.items()})


def run_fast_and_reference(variant: str, num_momenta: int, path: str):
    case = OPTIMIZER_CASES[variant]
    optimizer_class, reference_step, peak_lr = case.optimizer_class, case.reference, case.peak_lr
    betas, omegas = MOMENTA[num_momenta]
    hyper = dict(betas=betas, omegas=omegas, weight_decay=WEIGHT_DECAY, **case.hyperparameters)
    generator = torch.Generator().manual_seed(1234)
    initial = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in SHAPES]

    params = [x.clone().requires_grad_(True) for x in initial]
    optimizer = optimizer_class(params, lr=peak_lr, **PATHS[path], **hyper)
    second_moment = variant != "sgd"
    ref_params = [x.clone() for x in initial]
    ref_states = [initial_state(x, num_momenta, second_moment) for x in initial]

    for step in range(STEPS):
        lr = lr_at(step, peak_lr)
        optimizer.param_groups[0]["lr"] = lr
        for i, shape in enumerate(SHAPES):
            noise = torch.randn(shape, generator=generator, dtype=torch.float64)
            params[i].grad = make_gradient(noise, params[i].detach(), step)
            ref_grad = make_gradient(noise, ref_params[i], step)
            ref_params[i], ref_states[i] = reference_step(
                ref_params[i], ref_grad, ref_states[i], lr=lr, **hyper
            )
        optimizer.step()
    # the comparison is not vacuous: every parameter moved
    assert all(not torch.allclose(p.detach(), x) for p, x in zip(params, initial))
    return params, optimizer, ref_params, ref_states


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("num_momenta", [1, 2, 3])
@pytest.mark.parametrize("variant", sorted(OPTIMIZER_CASES))
def test_fast_path_matches_reference(variant, num_momenta, path):
    params, optimizer, ref_params, ref_states = run_fast_and_reference(variant, num_momenta, path)
    for p, x_ref, state_ref in zip(params, ref_params, ref_states):
        torch.testing.assert_close(p.detach(), x_ref, rtol=1e-10, atol=1e-12)
        state = optimizer.state[p]
        assert set(state) == set(state_ref)
        assert int(state["step"].item()) == state_ref["step"] == STEPS
        for key in state_ref:
            if key != "step":
                torch.testing.assert_close(state[key], state_ref[key], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("num_momenta", [1, 3])
@pytest.mark.parametrize("variant", sorted(OPTIMIZER_CASES))
def test_foreach_matches_for_loop(variant, num_momenta):
    foreach_params, foreach_optimizer, _, _ = run_fast_and_reference(
        variant, num_momenta, "foreach"
    )
    loop_params, loop_optimizer, _, _ = run_fast_and_reference(variant, num_momenta, "loop")
    for p, q in zip(foreach_params, loop_params):
        torch.testing.assert_close(p, q, rtol=1e-13, atol=1e-15)
        for key, value in foreach_optimizer.state[p].items():
            torch.testing.assert_close(value, loop_optimizer.state[q][key], rtol=1e-13, atol=1e-15)


# --------------------------------------------------------------------------------------------
# Behaviour: the optimizers actually optimize.
# --------------------------------------------------------------------------------------------


def logistic_problem():
    """A fixed, well-conditioned binary logistic regression with 256 points in 8 dimensions."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(256, 8, generator=generator)
    true_weights = torch.randn(8, generator=generator)
    labels = (features @ true_weights + 0.3 * torch.randn(256, generator=generator) > 0).float()
    return features, labels


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda ps: MTAdam(ps, lr=5e-2),
        lambda ps: MTAdam(ps, lr=5e-2, betas=(0.9, 0.999), omegas=(0.45, 0.45)),
        lambda ps: MTAdopt(ps, lr=5e-2),
        lambda ps: MTSGD(ps, lr=0.5, betas=(0.9, 0.99), omegas=(0.5, 0.3)),
    ],
    ids=["adam", "adam-n2", "adopt", "sgd-n2"],
)
def test_decreases_logistic_loss(make_optimizer, one_thread):
    features, labels = logistic_problem()
    weights = torch.zeros(8, requires_grad=True)
    bias = torch.zeros((), requires_grad=True)
    optimizer = make_optimizer([weights, bias])

    def closure():
        optimizer.zero_grad()
        logits = features @ weights + bias
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        loss.backward()
        return loss

    initial_loss = closure().item()  # ln 2 at zero weights
    losses = [optimizer.step(closure).item() for _ in range(200)]
    assert initial_loss == pytest.approx(math.log(2.0))
    assert losses[-1] < 0.5 * initial_loss
    assert min(losses[-20:]) < min(losses[:20])
