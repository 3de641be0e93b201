"""Slow, literal reference implementations of the MT-DAO update rules: the test oracle.

One function per variant, one tensor at a time, out of place, every line the algorithm's
pseudo-code; nothing is shared with :mod:`mtdao.optim.functional`, the fast path this checks.
State dicts use the optimizer's keys, ``step`` a Python int."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def initial_state(x: Tensor, num_momenta: int, second_moment: bool = True) -> dict[str, Any]:
    """Zero state for parameter ``x``: step 0, N zero momenta and (optionally) a zero v."""
    state: dict[str, Any] = {"step": 0}
    for j in range(num_momenta):
        state[f"exp_avg_{j}"] = torch.zeros_like(x)
    if second_moment:
        state["exp_avg_sq"] = torch.zeros_like(x)
    return state


def _momenta(state: dict[str, Any], num_momenta: int) -> list[Tensor]:
    return [state[f"exp_avg_{j}"] for j in range(num_momenta)]


def _new_state(step: int, momenta: list[Tensor], v: Tensor | None) -> dict[str, Any]:
    state: dict[str, Any] = {"step": step}
    for j, u in enumerate(momenta):
        state[f"exp_avg_{j}"] = u
    if v is not None:
        state["exp_avg_sq"] = v
    return state


def mt_adam_reference(
    x: Tensor,
    g: Tensor,
    state: dict[str, Any],
    *,
    lr: float,
    betas: Sequence[float],
    omegas: Sequence[float],
    beta2: float,
    eps: float,
    weight_decay: float,
) -> tuple[Tensor, dict[str, Any]]:
    """One MT-DAO-Adam step; returns ``(new_x, new_state)``."""
    b, w, lam = list(betas), list(omegas), weight_decay
    u, v = _momenta(state, len(b)), state["exp_avg_sq"]
    w_0 = 1.0 - sum(w)

    # t += 1
    t = state["step"] + 1
    # x *= (1 - lr * lam)
    x = x * (1.0 - lr * lam)
    # u_j = b_j * u_j + (1 - b_j) * g        for each j
    u = [b[j] * u[j] + (1.0 - b[j]) * g for j in range(len(b))]
    # v = b2 * v + (1 - b2) * g*g
    v = beta2 * v + (1.0 - beta2) * g * g
    # d = ( w_0 * g + sum_j w_j * u_j / (1 - b_j**t) ) / ( sqrt(v / (1 - b2**t)) + eps )
    numerator = w_0 * g
    for j in range(len(b)):
        numerator = numerator + w[j] * u[j] / (1.0 - b[j] ** t)
    d = numerator / (torch.sqrt(v / (1.0 - beta2**t)) + eps)
    # x -= lr * d
    x = x - lr * d
    return x, _new_state(t, u, v)


def mt_adopt_reference(
    x: Tensor,
    g: Tensor,
    state: dict[str, Any],
    *,
    lr: float,
    betas: Sequence[float],
    omegas: Sequence[float],
    beta2: float,
    eps: float,
    weight_decay: float,
    clip: bool = True,
) -> tuple[Tensor, dict[str, Any]]:
    """One MT-DAO-ADOPT step; returns ``(new_x, new_state)``. ``clip=False`` drops the clamp."""
    b, w, lam = list(betas), list(omegas), weight_decay
    u, v = _momenta(state, len(b)), state["exp_avg_sq"]
    w_0 = 1.0 - sum(w)

    # t += 1
    t = state["step"] + 1
    # x *= (1 - lr * lam)       applied on every call, the first included
    x = x * (1.0 - lr * lam)
    # if t == 1:  v = g*g ; no further update this call
    if t == 1:
        v = g * g
        return x, _new_state(t, [u_j.clone() for u_j in u], v)
    # n = g / max(sqrt(v), eps) ; n = clamp(n, -t**0.25, t**0.25)
    n = g / torch.clamp(torch.sqrt(v), min=eps)
    if clip:
        n = torch.clamp(n, min=-(t**0.25), max=t**0.25)
    # u_j = b_j * u_j + (1 - b_j) * n      for each j
    u = [b[j] * u[j] + (1.0 - b[j]) * n for j in range(len(b))]
    # x -= lr * ( w_0 * n + sum_j w_j * u_j )
    update = w_0 * n
    for j in range(len(b)):
        update = update + w[j] * u[j]
    x = x - lr * update
    # v = b2 * v + (1 - b2) * g*g        after the step, as in ADOPT
    v = beta2 * v + (1.0 - beta2) * g * g
    return x, _new_state(t, u, v)


def mt_sgd_reference(
    x: Tensor,
    g: Tensor,
    state: dict[str, Any],
    *,
    lr: float,
    betas: Sequence[float],
    omegas: Sequence[float],
    weight_decay: float,
) -> tuple[Tensor, dict[str, Any]]:
    """One MT-DAO-SGDM step; returns ``(new_x, new_state)`` (the state has no ``exp_avg_sq``)."""
    b, w, lam = list(betas), list(omegas), weight_decay
    u = _momenta(state, len(b))
    w_0 = 1.0 - sum(w)

    t = state["step"] + 1
    # x *= (1 - lr * lam)       decoupled weight decay, as in the adaptive variants
    x = x * (1.0 - lr * lam)
    # u_j = b_j u_j + (1 - b_j) g
    u = [b[j] * u[j] + (1.0 - b[j]) * g for j in range(len(b))]
    # x -= lr (w_0 g + sum_j w_j u_j)
    update = w_0 * g
    for j in range(len(b)):
        update = update + w[j] * u[j]
    x = x - lr * update
    return x, _new_state(t, u, None)
