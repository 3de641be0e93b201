"""The MT-DAO update rules as fused kernels (``fused=True``): one C++ call per bucket on the CPU
(:mod:`mtdao.optim.native`), compiled kernels elsewhere (:mod:`mtdao.optim.compilation`), each
reading and writing every element once where the foreach form makes a pass per operation.

Each rule is an *element update*: a pure in-place function of one tensor set (``x``, ``g``,
momenta ``u_j``, ``v``) and a 1-D float64 tensor ``c`` of coefficients, agreeing with
:mod:`mtdao.optim.functional` to float rounding. Coefficients are float64 whatever the parameters
(a C++ compiler may then keep them in registers: a ``double*`` cannot alias the ``float*`` the
kernel writes, 10-15% of its time at memory speed), and every hyperparameter and step-dependent
factor is one of them, ``constant + lr * per_lr``, so a changing learning rate or step never
compiles anything again and a tensor learning rate stays on its device. bf16/fp16 parameters are
updated in their float32 state's precision and rounded back once, without float32 copies."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mtdao.optim.compilation import ElementUpdate, KernelSpec, compiled_kernel
from mtdao.optim.functional import raw_gradient_weight
from mtdao.optim.launch import launch
from mtdao.optim.native import native_available, native_launch

# When ``fused=None`` takes a compiled kernel where the C++ kernel does not serve (CUDA, or no
# C++ build), as measured on the 2-core CPU of BENCHMARKS.md:
# - per step, the kernel's fixed cost per tensor (~7-30 us of Python) against the foreach path's
#   extra passes over memory (cheap while tensors sit in cache) cross at ~8K elements per tensor;
# - once per process, compiling costs seconds (`git show 1bbf067:BENCHMARKS.md`, section 1), which a bucket of 4M
#   elements earns back within a few hundred steps; smaller models keep the foreach path.
# On CUDA (an H200, 25M parameters in 100 tensors) a compiled launch per tensor cost ~40 us, 4.2 ms
# a step against foreach's 1.3 ms, while the same kernel over one flat buffer took 0.23 ms: the
# kernel pays there once per bucket of flat buffers (mtdao.optim.flat), or per tensor of at least
# ~1M elements (where 40 us is what the foreach path's extra passes cost).
FUSED_MIN_MEAN_NUMEL = 1 << 13
FUSED_MIN_MEAN_NUMEL_CUDA = 1 << 20
FUSED_MIN_NUMEL = 1 << 22

# --------------------------------------------------------------------------------------------
# Element updates. Coefficient layouts are given by the matching *_coefficients function.
# --------------------------------------------------------------------------------------------


def adam_update(x: Tensor, g: Tensor, momenta: list[Tensor], v: Tensor, c: Tensor) -> None:
    """c = [decay, 1 - b_1 .. 1 - b_N, b2, 1 - b2, 1 / sqrt(1 - b2^t), eps, -lr w_0, -s_1 .. -s_N]
    with s_j = lr w_j / (1 - b_j^t).

    The step is summed before the one division (the foreach path divides term by term): a
    division costs as much as the rest of the arithmetic, and at memory speed it shows.
    """
    n = len(momenta)
    g = g.to(v.dtype)
    new_x = x.to(v.dtype) * c[0]  # x *= 1 - lr lam
    for j, u in enumerate(momenta):
        u.copy_(u + c[1 + j] * (g - u))  # u_j = b_j u_j + (1 - b_j) g
    v.copy_(v * c[n + 1] + c[n + 2] * g * g)  # v = b2 v + (1 - b2) g^2
    denom = v.sqrt() * c[n + 3] + c[n + 4]  # sqrt(v / (1 - b2^t)) + eps
    step = c[n + 5] * g  # -lr w_0 g
    for j, u in enumerate(momenta):
        step = step + c[n + 6 + j] * u  # - lr w_j u_j / (1 - b_j^t)
    x.copy_(new_x + step / denom)


def adopt_update(x: Tensor, g: Tensor, momenta: list[Tensor], v: Tensor, c: Tensor) -> None:
    """c = [decay, 1 - b_1 .. 1 - b_N, eps, clip, -lr w_0, -lr w_1 .. -lr w_N, b2, 1 - b2].

    For steps t >= 2; clip is t^(1/4), or inf without clipping.
    """
    n = len(momenta)
    g = g.to(v.dtype)
    new_x = x.to(v.dtype) * c[0]  # x *= 1 - lr lam
    normed = g / v.sqrt().clamp_min(c[n + 1])  # n = g / max(sqrt(v), eps)
    normed = normed.clamp(-c[n + 2], c[n + 2])  # n = clamp(n, -t^(1/4), t^(1/4))
    for j, u in enumerate(momenta):
        u.copy_(u + c[1 + j] * (normed - u))  # u_j = b_j u_j + (1 - b_j) n
    new_x = new_x + c[n + 3] * normed  # x -= lr w_0 n
    for j, u in enumerate(momenta):
        new_x = new_x + c[n + 4 + j] * u  # x -= lr w_j u_j
    x.copy_(new_x)
    v.copy_(v * c[2 * n + 4] + c[2 * n + 5] * g * g)  # v = b2 v + (1 - b2) g^2, after the step


def sgd_update(x: Tensor, g: Tensor, momenta: list[Tensor], v: None, c: Tensor) -> None:
    """c = [decay, 1 - b_1 .. 1 - b_N, -lr w_0, -lr w_1 .. -lr w_N]; ``v`` is unused (None)."""
    n = len(momenta)
    g = g.to(momenta[0].dtype)
    new_x = x.to(g.dtype) * c[0]  # x *= 1 - lr lam
    for j, u in enumerate(momenta):
        u.copy_(u + c[1 + j] * (g - u))  # u_j = b_j u_j + (1 - b_j) g
    new_x = new_x + c[n + 1] * g  # x -= lr w_0 g
    for j, u in enumerate(momenta):
        new_x = new_x + c[n + 2 + j] * u  # x -= lr w_j u_j
    x.copy_(new_x)


def fusing_pays(params: list[Tensor]) -> bool:
    """Whether the fused kernel beats the foreach path for these tensors (``fused=None``); a flat
    bucket comes as one tensor."""
    cuda = bool(params) and params[0].device.type == "cuda"
    min_mean_numel = FUSED_MIN_MEAN_NUMEL_CUDA if cuda else FUSED_MIN_MEAN_NUMEL
    numel = sum(p.numel() for p in params)
    return numel >= FUSED_MIN_NUMEL and numel >= min_mean_numel * len(params)


# --------------------------------------------------------------------------------------------
# Coefficients: (constant, per_lr) with coefficient = constant + lr * per_lr
# --------------------------------------------------------------------------------------------

Coefficients = tuple[list[float], list[float]]


def _momentum_decays(betas: Sequence[float], weight_decay: float) -> Coefficients:
    """The shared head: [decay, 1 - b_1 .. 1 - b_N]."""
    return [1.0] + [1.0 - b for b in betas], [-weight_decay] + [0.0] * len(betas)


def adam_coefficients(*, step, betas, omegas, beta2, eps, weight_decay) -> Coefficients:
    constant, per_lr = _momentum_decays(betas, weight_decay)
    constant += [beta2, 1.0 - beta2, 1.0 / math.sqrt(1.0 - beta2**step), eps, 0.0]
    per_lr += [0.0, 0.0, 0.0, 0.0, -raw_gradient_weight(omegas)]
    constant += [0.0] * len(betas)
    per_lr += [-w / (1.0 - b**step) for b, w in zip(betas, omegas)]
    return constant, per_lr


def adopt_coefficients(*, step, betas, omegas, beta2, eps, weight_decay, clip) -> Coefficients:
    constant, per_lr = _momentum_decays(betas, weight_decay)
    constant += [eps, step**0.25 if clip else math.inf, 0.0] + [0.0] * len(betas)
    per_lr += [0.0, 0.0, -raw_gradient_weight(omegas)] + [-w for w in omegas]
    return constant + [beta2, 1.0 - beta2], per_lr + [0.0, 0.0]


def sgd_coefficients(*, betas, omegas, weight_decay) -> Coefficients:
    constant, per_lr = _momentum_decays(betas, weight_decay)
    constant += [0.0] * (1 + len(omegas))
    per_lr += [-raw_gradient_weight(omegas)] + [-w for w in omegas]
    return constant, per_lr


# --------------------------------------------------------------------------------------------
# Rules: an element update, its coefficients, and the list-level step the optimizers call
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FusedRule:
    update: ElementUpdate
    coefficients: Callable[..., Coefficients]
    second_moment: bool
    extra_coefficients: int  # how many coefficients besides the two per momentum
    native_op: str  # its operator in the C++ kernel (torch.ops.mtdao_optim)

    def spec(self, num_momenta: int, param: Tensor, state: Tensor) -> KernelSpec:
        return KernelSpec(
            update=self.update,
            num_momenta=num_momenta,
            num_coefficients=2 * num_momenta + self.extra_coefficients,
            second_moment=self.second_moment,
            param_dtype=param.dtype,
            state_dtype=state.dtype,
            device=param.device,
        )

    def native(self, spec: KernelSpec) -> bool:
        """Whether the C++ kernel serves the spec (builds it on first request)."""
        return native_available(spec, self.native_op)

    def available(self, num_momenta: int, param: Tensor, state: Tensor) -> bool:
        """Whether a fused kernel exists for such tensors: the C++ kernel on the CPU, else a
        compiled one (built or compiled on first request)."""
        spec = self.spec(num_momenta, param, state)
        return self.native(spec) or compiled_kernel(spec) is not None

    def chosen(
        self, num_momenta: int, params: list[Tensor], state: Tensor, fused: bool | None
    ) -> bool:
        """Whether to take a fused kernel for ``params`` with ``fused=True`` or ``None``: the C++
        kernel wherever it serves (it beats the foreach path at every size), else a compiled one
        if asked for or where it pays (``fused=None``)."""
        spec = self.spec(num_momenta, params[0], state)
        if self.native(spec):
            return True
        if fused is None and not fusing_pays(params):
            return False
        return compiled_kernel(spec) is not None


ADAM = FusedRule(
    adam_update, adam_coefficients, second_moment=True, extra_coefficients=6, native_op="adam_step"
)
ADOPT = FusedRule(
    adopt_update,
    adopt_coefficients,
    second_moment=True,
    extra_coefficients=6,
    native_op="adopt_step",
)
SGD = FusedRule(
    sgd_update, sgd_coefficients, second_moment=False, extra_coefficients=2, native_op="sgd_step"
)


def coefficient_tensor(coefficients: Coefficients, lr: float | Tensor, like: Tensor) -> Tensor:
    """``constant + lr * per_lr`` as a float64 tensor on the device of ``like``."""
    constant, per_lr = coefficients
    options = dict(dtype=torch.float64, device=like.device)
    if isinstance(lr, Tensor):
        return _on_device(constant, like) + lr.to(**options) * _on_device(per_lr, like)
    return _on_device([a + lr * b for a, b in zip(constant, per_lr)], like)


def _on_device(values: list[float], like: Tensor) -> Tensor:
    """``values`` as a float64 tensor on ``like``'s device. To a GPU through pinned memory, without
    waiting: a plain copy from pageable memory waits for the GPU's queue, every step."""
    host = torch.tensor(values, dtype=torch.float64)
    if like.device.type != "cuda":
        return host.to(like.device)
    return host.pin_memory().to(like.device, non_blocking=True)


@torch.no_grad()
def apply_rule(
    rule: FusedRule,
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[list[Tensor]],
    exp_avg_sqs: list[Tensor],
    coefficients: Coefficients,
    lr: float | Tensor,
) -> None:
    """One fused update of every tensor set (all of one device, parameter dtype and state dtype)."""
    if not params:
        return
    spec = rule.spec(len(exp_avgs), params[0], exp_avgs[0][0])
    if len(coefficients[0]) != spec.num_coefficients:
        raise ValueError(f"{len(coefficients[0])} coefficients for {spec.describe()}")
    c = coefficient_tensor(coefficients, lr, exp_avgs[0][0])
    run_kernels(rule, spec, params, grads, exp_avgs, exp_avg_sqs, c)


def run_kernels(rule, spec, params, grads, exp_avgs, exp_avg_sqs, c: Tensor) -> None:
    """The update of every tensor set by the C++ kernel where it serves, else compiled ones."""
    second_moments = exp_avg_sqs if rule.second_moment else None
    if rule.native(spec):
        native_launch(rule.native_op, params, grads, exp_avgs, second_moments, c)
    else:
        launch(spec, params, grads, exp_avgs, second_moments, c)


# --------------------------------------------------------------------------------------------
# List-level steps with the signatures of the foreach forms in functional.py
# --------------------------------------------------------------------------------------------


def mt_adam_fused(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, **hyper) -> None:
    """Same as :func:`mtdao.optim.functional.mt_adam_multi_tensor`, as compiled kernels."""
    apply_rule(
        ADAM, params, grads, exp_avgs, exp_avg_sqs, adam_coefficients(step=step, **hyper), lr
    )


def mt_adopt_fused(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, **hyper) -> None:
    """Same as :func:`mtdao.optim.functional.mt_adopt_multi_tensor`, as compiled kernels."""
    if step == 1:  # the first call only fills v (and decays x): once per run, not worth a kernel
        _adopt_first_step(params, grads, exp_avg_sqs, lr, hyper["weight_decay"])
        return
    coefficients = adopt_coefficients(step=step, **hyper)
    apply_rule(ADOPT, params, grads, exp_avgs, exp_avg_sqs, coefficients, lr)


def mt_sgd_fused(params, grads, exp_avgs, *, lr, **hyper) -> None:
    """Same as :func:`mtdao.optim.functional.mt_sgd_multi_tensor`, as compiled kernels."""
    apply_rule(SGD, params, grads, exp_avgs, [], sgd_coefficients(**hyper), lr)


@torch.no_grad()
def _adopt_first_step(params, grads, exp_avg_sqs, lr, weight_decay) -> None:
    lr = float(lr)
    for x, g, v in zip(params, grads, exp_avg_sqs):
        if weight_decay != 0.0:
            x.copy_(x.to(v.dtype) * (1.0 - lr * weight_decay))  # x *= 1 - lr lam
        g = g.to(v.dtype)
        v.copy_(g * g)  # v = g^2
