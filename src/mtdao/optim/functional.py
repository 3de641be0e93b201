"""The MT-DAO update rules as pure functions over lists of tensors.

Each rule has a for-loop form (``*_single_tensor``) and a multi-tensor form (``*_multi_tensor``,
``torch._foreach_*`` kernels) with one shared signature, shared also by the compiled form in
:mod:`mtdao.optim.fused`; the optimizer classes only route tensors here. All tensors in one call share device and dtype, and all parameters share one ``step`` value
(the caller buckets by it), so bias corrections are plain Python floats.

Notation: x parameter, g gradient, u_j the j-th first momentum (decay b_j, mixing weight w_j),
w_0 = 1 - sum_j w_j the weight of the raw (ADOPT: normalized) gradient, v the second moment.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

# Mixing weights below this are treated as zero so that, e.g., omegas=(1.0,) skips the raw-gradient
# term entirely and costs exactly what AdamW costs.
_NEGLIGIBLE_WEIGHT = 1e-12


def raw_gradient_weight(omegas: Sequence[float]) -> float:
    """w_0 = 1 - sum(omegas): the weight of the raw (or normalized) gradient in the update."""
    weight = 1.0 - math.fsum(omegas)
    return 0.0 if abs(weight) < _NEGLIGIBLE_WEIGHT else weight


# --------------------------------------------------------------------------------------------
# MT-DAO-Adam
# --------------------------------------------------------------------------------------------


def mt_adam_single_tensor(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[list[Tensor]],
    exp_avg_sqs: list[Tensor],
    *,
    step: int,
    lr: float,
    betas: Sequence[float],
    omegas: Sequence[float],
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One MT-DAO-Adam step; ``exp_avgs[j][i]`` is momentum j of parameter i; ``step`` counts from 1."""
    grad_weight = raw_gradient_weight(omegas)
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    momentum_step_sizes = [lr * w / (1.0 - b**step) for b, w in zip(betas, omegas)]
    for i, (x, g, v) in enumerate(zip(params, grads, exp_avg_sqs)):
        if weight_decay != 0.0:
            x.mul_(1.0 - lr * weight_decay)  # x *= 1 - lr * lam (decoupled)
        for j, beta in enumerate(betas):
            exp_avgs[j][i].lerp_(g, 1.0 - beta)  # u_j = b_j u_j + (1 - b_j) g
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)  # v = b2 v + (1 - b2) g^2
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)  # sqrt(v / (1 - b2^t)) + eps
        # x -= lr (w_0 g + sum_j w_j u_j / (1 - b_j^t)) / denom, one term at a time
        if grad_weight != 0.0:
            x.addcdiv_(g, denom, value=-lr * grad_weight)
        for j, step_size in enumerate(momentum_step_sizes):
            if step_size != 0.0:
                x.addcdiv_(exp_avgs[j][i], denom, value=-step_size)


def mt_adam_multi_tensor(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[list[Tensor]],
    exp_avg_sqs: list[Tensor],
    *,
    step: int,
    lr: float,
    betas: Sequence[float],
    omegas: Sequence[float],
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """Same as :func:`mt_adam_single_tensor`, with one foreach kernel per operation."""
    if not params:
        return
    grad_weight = raw_gradient_weight(omegas)
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    if weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    for beta, momentum in zip(betas, exp_avgs):
        torch._foreach_lerp_(momentum, grads, 1.0 - beta)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    if grad_weight != 0.0:
        torch._foreach_addcdiv_(params, grads, denom, -lr * grad_weight)
    for beta, omega, momentum in zip(betas, omegas, exp_avgs):
        if omega != 0.0:
            torch._foreach_addcdiv_(params, momentum, denom, -lr * omega / (1.0 - beta**step))


# --------------------------------------------------------------------------------------------
# MT-DAO-ADOPT
# --------------------------------------------------------------------------------------------


def mt_adopt_single_tensor(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[list[Tensor]],
    exp_avg_sqs: list[Tensor],
    *,
    step: int,
    lr: float,
    betas: Sequence[float],
    omegas: Sequence[float],
    beta2: float,
    eps: float,
    weight_decay: float,
    clip: bool,
) -> None:
    """One MT-DAO-ADOPT step (official ADOPT step convention: the first call only fills v)."""
    grad_weight = raw_gradient_weight(omegas)
    clip_value = step**0.25
    for i, (x, g, v) in enumerate(zip(params, grads, exp_avg_sqs)):
        if weight_decay != 0.0:
            x.mul_(1.0 - lr * weight_decay)  # decoupled, on every call including the first
        if step == 1:
            v.copy_(g * g)  # v = g^2; no parameter update on the first call
            continue
        normed = g / v.sqrt().clamp_(min=eps)  # n = g / max(sqrt(v), eps)
        if clip:
            normed.clamp_(-clip_value, clip_value)  # n = clamp(n, -t^(1/4), t^(1/4))
        for j, beta in enumerate(betas):
            exp_avgs[j][i].lerp_(normed, 1.0 - beta)  # u_j = b_j u_j + (1 - b_j) n
        if grad_weight != 0.0:
            x.add_(normed, alpha=-lr * grad_weight)  # x -= lr w_0 n
        for j, omega in enumerate(omegas):
            if omega != 0.0:
                x.add_(exp_avgs[j][i], alpha=-lr * omega)  # x -= lr w_j u_j
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)  # v updated after the step, as in ADOPT


def mt_adopt_multi_tensor(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[list[Tensor]],
    exp_avg_sqs: list[Tensor],
    *,
    step: int,
    lr: float,
    betas: Sequence[float],
    omegas: Sequence[float],
    beta2: float,
    eps: float,
    weight_decay: float,
    clip: bool,
) -> None:
    """Same as :func:`mt_adopt_single_tensor`, with one foreach kernel per operation."""
    if not params:
        return
    grad_weight = raw_gradient_weight(omegas)
    if weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    if step == 1:
        torch._foreach_copy_(exp_avg_sqs, torch._foreach_mul(grads, grads))
        return
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_clamp_min_(denom, eps)  # max(sqrt(v), eps)
    normed = torch._foreach_div(grads, denom)  # n = g / max(sqrt(v), eps)
    del denom
    if clip:
        clip_value = step**0.25
        torch._foreach_clamp_min_(normed, -clip_value)
        torch._foreach_clamp_max_(normed, clip_value)
    for beta, momentum in zip(betas, exp_avgs):
        torch._foreach_lerp_(momentum, normed, 1.0 - beta)
    if grad_weight != 0.0:
        torch._foreach_add_(params, normed, alpha=-lr * grad_weight)
    for omega, momentum in zip(omegas, exp_avgs):
        if omega != 0.0:
            torch._foreach_add_(params, momentum, alpha=-lr * omega)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)


# --------------------------------------------------------------------------------------------
# MT-DAO-SGDM
# --------------------------------------------------------------------------------------------


def mt_sgd_single_tensor(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[list[Tensor]],
    *,
    lr: float,
    betas: Sequence[float],
    omegas: Sequence[float],
    weight_decay: float,
) -> None:
    """One MT-DAO-SGDM step: x -= lr (w_0 g + sum_j w_j u_j), u_j an EMA of g."""
    grad_weight = raw_gradient_weight(omegas)
    for i, (x, g) in enumerate(zip(params, grads)):
        if weight_decay != 0.0:
            x.mul_(1.0 - lr * weight_decay)
        for j, beta in enumerate(betas):
            exp_avgs[j][i].lerp_(g, 1.0 - beta)  # u_j = b_j u_j + (1 - b_j) g
        if grad_weight != 0.0:
            x.add_(g, alpha=-lr * grad_weight)
        for j, omega in enumerate(omegas):
            if omega != 0.0:
                x.add_(exp_avgs[j][i], alpha=-lr * omega)


def mt_sgd_multi_tensor(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[list[Tensor]],
    *,
    lr: float,
    betas: Sequence[float],
    omegas: Sequence[float],
    weight_decay: float,
) -> None:
    """Same as :func:`mt_sgd_single_tensor`, with one foreach kernel per operation."""
    if not params:
        return
    grad_weight = raw_gradient_weight(omegas)
    if weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    for beta, momentum in zip(betas, exp_avgs):
        torch._foreach_lerp_(momentum, grads, 1.0 - beta)
    if grad_weight != 0.0:
        torch._foreach_add_(params, grads, alpha=-lr * grad_weight)
    for omega, momentum in zip(omegas, exp_avgs):
        if omega != 0.0:
            torch._foreach_add_(params, momentum, alpha=-lr * omega)
