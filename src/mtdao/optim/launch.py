"""Running a compiled update kernel over a bucket of tensors.

Contiguous tensors are passed flattened (one kernel serves every shape). Buckets of at least
``SLOTS`` tensors go ``SLOTS`` at a time through the many-tensor kernel, the last call padded with
empty tensors: a call costs tens of microseconds of Python whatever its size, worth spreading over
several tensors. Small CPU tensors run on one thread. Tensors in other layouts (transposed views,
channels-last) run through the same update function eagerly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

import torch
from torch import Tensor

from mtdao.optim.compilation import KernelSpec, compiled_kernel

# Tensors per call of the many-tensor kernel.
SLOTS = 8

# Below this many elements a CPU tensor is updated on one thread (torch's own element-wise kernels
# start a second thread at 32768 elements too): a second thread costs more than it saves, and on a
# busy machine waiting for it can cost milliseconds.
PARALLEL_MIN_NUMEL = 32768


class Columns:
    """Tensor sets as the kernel takes them: xs, gs, momenta (a list of N per set), vs."""

    def __init__(self) -> None:
        self.xs: list[Tensor] = []
        self.gs: list[Tensor] = []
        self.momenta: list[list[Tensor]] = []
        self.vs: list[Tensor | None] = []

    def append(self, x: Tensor, g: Tensor, momenta: list[Tensor], v: Tensor | None) -> None:
        self.xs.append(x.view(-1))
        self.gs.append(g.view(-1))
        self.momenta.append([u.view(-1) for u in momenta])
        self.vs.append(None if v is None else v.view(-1))

    def slice(self, start: int, stop: int) -> tuple[list, list, list, list]:
        return (
            self.xs[start:stop],
            self.gs[start:stop],
            self.momenta[start:stop],
            self.vs[start:stop],
        )

    def __len__(self) -> int:
        return len(self.xs)


def launch(
    spec: KernelSpec,
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[list[Tensor]],
    exp_avg_sqs: list[Tensor] | None,
    c: Tensor,
) -> None:
    """Update every tensor set (``exp_avgs[j][i]`` is momentum j of parameter i)."""
    small, large = Columns(), Columns()
    for i, (x, g) in enumerate(zip(params, grads)):
        momenta = [u[i] for u in exp_avgs]
        v = None if exp_avg_sqs is None else exp_avg_sqs[i]
        numel = x.numel()
        if numel == 0:
            continue
        if not contiguous_set(x, g, momenta, v):
            spec.update(x, g, momenta, v, c)
        else:
            (large if numel >= PARALLEL_MIN_NUMEL else small).append(x, g, momenta, v)
    with _one_thread(len(small) > 0 and spec.device.type == "cpu"):
        _run(spec, small, c)
    _run(spec, large, c)


def contiguous_set(x: Tensor, g: Tensor, momenta: list[Tensor], v: Tensor | None) -> bool:
    """Whether a tensor set can go to a kernel flattened: every tensor of it contiguous."""
    return (
        x.is_contiguous()
        and g.is_contiguous()
        and all(u.is_contiguous() for u in momenta)
        and (v is None or v.is_contiguous())
    )


def _run(spec: KernelSpec, sets: Columns, c: Tensor) -> None:
    many = replace(spec, slots=SLOTS)
    if len(sets) >= SLOTS and (kernel := compiled_kernel(many)) is not None:
        padding = _padding(spec)
        for start in range(0, len(sets), SLOTS):
            xs, gs, momenta, vs = sets.slice(start, start + SLOTS)
            missing = SLOTS - len(xs)
            if missing:
                xs, gs = xs + [padding.xs[0]] * missing, gs + [padding.gs[0]] * missing
                momenta = momenta + [padding.momenta[0]] * missing
                vs = vs + [padding.vs[0]] * missing
            kernel(xs, gs, momenta, vs, c)
        return
    kernel = compiled_kernel(spec)
    if kernel is None:
        raise RuntimeError(f"no compiled kernel for {spec.describe()}; check available() first")
    for i in range(len(sets)):
        kernel(*sets.slice(i, i + 1), c)


def _padding(spec: KernelSpec) -> Columns:
    """One empty tensor set of the spec's dtypes and device."""

    def empty(dtype: torch.dtype) -> Tensor:
        return torch.empty(0, dtype=dtype, device=spec.device)

    padding = Columns()
    momenta = [empty(spec.state_dtype) for _ in range(spec.num_momenta)]
    v = empty(spec.state_dtype) if spec.second_moment else None
    padding.append(empty(spec.param_dtype), empty(spec.param_dtype), momenta, v)
    return padding


@contextlib.contextmanager
def _one_thread(active: bool) -> Iterator[None]:
    """One intra-op thread for the block (the compiled kernel reads torch's count at each call)."""
    threads = torch.get_num_threads()
    if not active or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
