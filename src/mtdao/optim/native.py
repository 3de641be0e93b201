"""Running the hand-written CPU kernel (``csrc/multi_tensor_step.cpp``) over a bucket: one call for
all its tensors, as torch's fused AdamW does, whatever the number of momenta. Each kernel spec is
checked once against the element update run eagerly; a failure marks it unavailable with one
warning and the caller takes another path."""

from __future__ import annotations

import warnings
from itertools import chain

import torch
from torch import Tensor

from mtdao.native_build import native_library
from mtdao.optim.compilation import KernelSpec, probe_inputs, written_tensors

# (parameter dtype, state dtype) pairs the kernel is built for
SUPPORTED_DTYPES = {
    (torch.float32, torch.float32),
    (torch.float64, torch.float64),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
}

# spec -> whether the kernel passed its check for that spec
_checked: dict[KernelSpec, bool] = {}


def native_available(spec: KernelSpec, op_name: str) -> bool:
    """Whether the CPU kernel serves ``spec`` (builds and checks it on first request)."""
    if spec.device.type != "cpu" or (spec.param_dtype, spec.state_dtype) not in SUPPORTED_DTYPES:
        return False
    if spec not in _checked:
        _checked[spec] = native_library() and _passes_check(spec, op_name)
    return _checked[spec]


def _passes_check(spec: KernelSpec, op_name: str) -> bool:
    try:
        _check_against_eager(spec, op_name)
    except Exception as error:
        warnings.warn(
            f"mtdao: the C++ optimizer kernel disagrees with the reference for {spec.describe()} "
            f"({type(error).__name__}: {str(error).strip().splitlines()[0][:200]}); "
            "using another path.",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    return True


@torch.no_grad()
def _check_against_eager(spec: KernelSpec, op_name: str) -> None:
    # small: every element takes the same code whatever its tensor's size, and at first use on a
    # busy machine each eager operation here costs milliseconds
    native_inputs, eager_inputs = (probe_inputs(spec, slots=3, numel=1000) for _ in range(2))
    xs, gs, momenta, vs, c = native_inputs
    # momenta[i][j] is momentum j of set i; the kernel takes momentum j of every set together
    by_momentum = [[set_momenta[j] for set_momenta in momenta] for j in range(spec.num_momenta)]
    run_native(op_name, xs, gs, by_momentum, vs if spec.second_moment else [], c)
    xs, gs, momenta, vs, c = eager_inputs
    for x, g, set_momenta, v in zip(xs, gs, momenta, vs):
        spec.update(x, g, set_momenta, v, c)
    for got, expected in zip(written_tensors(native_inputs), written_tensors(eager_inputs)):
        torch.testing.assert_close(got, expected)


def run_native(
    op_name: str,
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[list[Tensor]],
    exp_avg_sqs: list[Tensor],
    c: Tensor,
) -> None:
    """One call of the kernel over contiguous tensors (``exp_avgs[j][i]``: momentum j of
    parameter i)."""
    op = getattr(torch.ops.mtdao_optim, op_name)
    op(params, grads, list(chain.from_iterable(exp_avgs)), exp_avg_sqs, c)


def native_launch(
    op_name: str,
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[list[Tensor]],
    exp_avg_sqs: list[Tensor] | None,
    c: Tensor,
) -> None:
    """Update every tensor set in one call. A tensor in another layout (a transposed view,
    channels-last) goes to the kernel as a contiguous copy, copied back once written: every element
    takes the kernel's arithmetic whatever its layout, so a per-tensor and a flat run agree bit for
    bit (the eager element update need not: torch's sqrt is not always correctly rounded)."""
    written: list[tuple[Tensor, Tensor]] = []  # (tensor, the contiguous copy the kernel writes)

    def contiguous(t: Tensor, writes: bool) -> Tensor:
        if t.is_contiguous():
            return t
        copy = t.contiguous()
        if writes:
            written.append((t, copy))
        return copy

    params = [contiguous(x, writes=True) for x in params]
    grads = [contiguous(g, writes=False) for g in grads]
    exp_avgs = [[contiguous(u, writes=True) for u in momentum] for momentum in exp_avgs]
    exp_avg_sqs = [contiguous(v, writes=True) for v in exp_avg_sqs or []]
    run_native(op_name, params, grads, exp_avgs, exp_avg_sqs, c)
    for tensor, copy in written:
        tensor.copy_(copy)


def forget_native_checks() -> None:
    """Check every spec again at its next request (tests use it with a simulated failed build)."""
    _checked.clear()
